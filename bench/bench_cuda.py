"""CUDA benchmark: DLPack conversion costs and copy bandwidths, dlbridge beside PyTorch, CuPy and
JAX, in one process and one run. Prints two tables (medians; ratios against the peer measured in
the same run). Usage: python bench/bench_cuda.py [--quick]
"""

import statistics
import sys
import time

import numpy as np

import dlbridge

QUICK = "--quick" in sys.argv


def per_call_us(fn, calls=2000, rounds=25):
    for _ in range(calls // 4):
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - t0) / calls / 1000)
    return statistics.median(samples)


def conversions():
    import cupy
    import jax
    import jax.dlpack
    import torch

    t = torch.arange(256, dtype=torch.float32, device="cuda")
    c = cupy.arange(256, dtype=cupy.float32)
    j = jax.numpy.arange(256, dtype=jax.numpy.float32)
    a = dlbridge.arange(256, dtype="float32", device="cuda:0")
    torch.cuda.synchronize()
    rows = [
        ("import a PyTorch tensor", "dlbridge.from_dlpack(t)", lambda: dlbridge.from_dlpack(t),
         "cupy.from_dlpack(t)", lambda: cupy.from_dlpack(t)),
        ("import a CuPy array", "dlbridge.from_dlpack(c)", lambda: dlbridge.from_dlpack(c),
         "torch.from_dlpack(c)", lambda: torch.from_dlpack(c)),
        ("import a JAX array", "dlbridge.from_dlpack(j)", lambda: dlbridge.from_dlpack(j),
         "torch.from_dlpack(j)", lambda: torch.from_dlpack(j)),
        ("PyTorch imports", "torch.from_dlpack(a)", lambda: torch.from_dlpack(a),
         "torch.from_dlpack(c)", lambda: torch.from_dlpack(c)),
        ("CuPy imports", "cupy.from_dlpack(a)", lambda: cupy.from_dlpack(a),
         "cupy.from_dlpack(t)", lambda: cupy.from_dlpack(t)),
        ("JAX imports", "jax.dlpack.from_dlpack(a)", lambda: jax.dlpack.from_dlpack(a),
         "jax.dlpack.from_dlpack(t)", lambda: jax.dlpack.from_dlpack(t)),
        ("PyTorch from PyTorch", "dlbridge.from_dlpack(t)", lambda: dlbridge.from_dlpack(t),
         "torch.from_dlpack(t)", lambda: torch.from_dlpack(t)),
    ]
    print("\n## DLPack conversions on CUDA (median µs per call)\n")
    print("| case | dlbridge side | µs | peer | µs | ratio |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for name, ours_label, ours, peer_label, peer in rows:
        calls = 200 if "jax" in ours_label + peer_label else 2000
        # Interleave: peer, ours, peer, ours; keep each side's median.
        o = [per_call_us(ours, calls, 7) for _ in range(2)]
        p = [per_call_us(peer, calls, 7) for _ in range(2)]
        o, p = min(o), min(p)
        print(f"| {name} | `{ours_label}` | {o:.2f} | `{peer_label}` | {p:.2f} | {o / p:.2f} |")


def timed_ms(fn, reps):
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def copies():
    import torch

    n = (1 << 28) if not QUICK else (1 << 24)  # float32 elements: 1 GiB
    nbytes = n * 4
    reps = 10
    t = torch.rand(n, device="cuda")
    a = dlbridge.from_dlpack(torch.rand(n, device="cuda"))
    t_dst = torch.empty_like(t)
    a_dst = dlbridge.empty((n,), dtype="float32", device="cuda:0")
    t_pin = torch.empty(n, pin_memory=True)
    a_pin = dlbridge.empty((n,), dtype="float32", device="cuda:0", storage="pinned")
    t_page = torch.empty(n)
    a_page = dlbridge.empty((n,), dtype="float32")
    side = int(np.sqrt(n))
    t2 = t[: side * side].view(side, side)
    a2 = a[: side * side].reshape((side, side))
    t2_dst = torch.empty_like(t2)
    a2_dst = dlbridge.empty((side, side), dtype="float32", device="cuda:0")

    def assign(dst, src):
        def run():
            dst[...] = src
        return run

    rows = [
        ("device → device", 2 * nbytes, assign(a_dst, a), lambda: t_dst.copy_(t)),
        ("host → device, pinned", nbytes, assign(a_dst, a_pin), lambda: t_dst.copy_(t_pin)),
        ("device → host, pinned", nbytes, assign(a_pin, a), lambda: t_pin.copy_(t)),
        ("host → device, pageable", nbytes, assign(a_dst, a_page), lambda: t_dst.copy_(t_page)),
        ("device → host, pageable", nbytes, assign(a_page, a), lambda: t_page.copy_(t)),
        ("transposed → contiguous", 2 * side * side * 4, assign(a2_dst, a2.T),
         lambda: t2_dst.copy_(t2.T)),
        ("transposed → new contiguous", 2 * side * side * 4, lambda: a2.T.copy(),
         lambda: t2.T.contiguous()),
    ]
    print(f"\n## Copies, {nbytes / 2**30:.2f} GiB, CUDA events (GB/s; D2D and transposes count bytes "
          "read + written)\n")
    print("| copy | dlbridge GB/s | PyTorch GB/s | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, moved, ours, peer in rows:
        o = [timed_ms(ours, reps) for _ in range(2)]
        p = [timed_ms(peer, reps) for _ in range(2)]
        o, p = min(o), min(p)
        go, gp = moved / o / 1e6, moved / p / 1e6
        print(f"| {name} | {go:.1f} | {gp:.1f} | {go / gp:.3f} |")
    # Correctness of what was timed.
    assert np.array_equal(np.asarray(a2_dst.to("cpu")), np.asarray(a2.to("cpu")).T)


if __name__ == "__main__":
    if not dlbridge.cuda.is_available():
        print(f"no CUDA GPU: {dlbridge.cuda.unavailable_reason()}")
        sys.exit(0)
    import torch

    print(f"# dlbridge {dlbridge.__version__} on {dlbridge.cuda.device_name()}, torch "
          f"{torch.__version__}")
    conversions()
    copies()
