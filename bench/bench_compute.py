"""Compute benchmark: dlbridge's built-in kernels beside PyTorch (CUDA) and NumPy (CPU) on the same
inputs, in one process and one run. Prints a table per device (medians; ratios against the peer).

CUDA: add and exp on 2^28 float32 (GB/s moved), sum over 2^28 float32 (GB/s read), matmul 8192³
in float32 and bfloat16 (TFLOP/s). Both libraries run on the legacy default stream and are timed
by CUDA events around each call (Python dispatch included, as a user sees it).
CPU: the same element-wise ops and sum on 2^24 float32 beside NumPy, and matmul 1024³ float32.
Both: the NumPy habits' reductions and indexing on the same sizes (max, argmax, prod, var,
floor_divide; on the CPU a boolean-mask selection and an integer-array gather).

Usage: python bench/bench_compute.py [--devices cpu,cuda] [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import dlbridge
from dlbridge import ops

QUICK = "--quick" in sys.argv


def devices() -> list[str]:
    for i, arg in enumerate(sys.argv):
        if arg == "--devices" and i + 1 < len(sys.argv):
            return sys.argv[i + 1].split(",")
    return ["cpu"] + (["cuda"] if dlbridge.cuda.is_available() else [])


# ---------------------------------------------------------------------------------------------
# CUDA


def cuda_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` between CUDA events on the legacy default stream."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e))
    return statistics.median(samples)


def bench_cuda() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default: true float32 GEMMs
    n = 1 << (24 if QUICK else 28)
    reps = 5 if QUICK else 20
    name = torch.cuda.get_device_name(0)
    print(f"\n## CUDA compute ({name}; dlbridge vs PyTorch {torch.__version__}, medians of {reps})\n")
    print("| case | dlbridge | PyTorch | ratio |")
    print("| --- | ---: | ---: | ---: |")
    tx = torch.rand(n, device="cuda") + 0.5
    ty = torch.rand(n, device="cuda")
    # The same bytes, shared with dlbridge without a copy.
    dx, dy = dlbridge.from_dlpack(tx), dlbridge.from_dlpack(ty)
    gb = n * 4 / 1e9
    for case, ours, peer, moved in [
        ("add 2^%d float32 (GB/s)" % (n.bit_length() - 1), lambda: ops.add(dx, dy), lambda: torch.add(tx, ty), 3 * gb),
        ("exp 2^%d float32 (GB/s)" % (n.bit_length() - 1), lambda: ops.exp(dx), lambda: torch.exp(tx), 2 * gb),
        ("sum 2^%d float32 (GB/s)" % (n.bit_length() - 1), lambda: ops.sum(dx), lambda: torch.sum(tx), gb),
    ]:
        p = cuda_ms(peer, reps)
        o = cuda_ms(ours, reps)
        print(f"| {case} | {moved / o * 1e3:.0f} | {moved / p * 1e3:.0f} | {p / o:.2f} |")
    # Check the results agree (same inputs).
    assert abs(float(ops.sum(dx)) - float(torch.sum(tx))) <= 1e-3 * float(torch.sum(tx))
    # The NumPy habits: max, argmax (one pass: value and position pairs), prod of values near 1,
    # var (one pass: batches of registers merged by Chan's formula).
    tn = 1.0 + (torch.rand(n, device="cuda") - 0.5) * 1e-6
    dn = dlbridge.from_dlpack(tn)
    for case, ours, peer, moved in [
        ("max 2^%d float32 (GB/s)" % (n.bit_length() - 1), lambda: ops.max(dx), lambda: torch.max(tx), gb),
        ("argmax 2^%d float32 (GB/s)" % (n.bit_length() - 1), lambda: ops.argmax(dx), lambda: torch.argmax(tx), gb),
        ("prod 2^%d float32 (GB/s)" % (n.bit_length() - 1), lambda: ops.prod(dn), lambda: torch.prod(tn), gb),
        ("var 2^%d float32 (GB/s)" % (n.bit_length() - 1), lambda: ops.var(dx), lambda: torch.var(tx, correction=0), gb),
    ]:
        p = cuda_ms(peer, reps)
        o = cuda_ms(ours, reps)
        print(f"| {case} | {moved / o * 1e3:.0f} | {moved / p * 1e3:.0f} | {p / o:.2f} |")
    assert int(ops.argmax(dx)) == int(torch.argmax(tx))
    want = float(torch.var(tx.double(), correction=0))
    assert abs(float(ops.var(dx)) - want) <= 1e-5 * want
    del tx, ty, dx, dy, tn, dn
    torch.cuda.empty_cache()
    dlbridge.empty_cache("cuda:0")
    m = 2048 if QUICK else 8192
    for dtype, tdtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        ta = torch.randn(m, m, device="cuda", dtype=tdtype)
        tb = torch.randn(m, m, device="cuda", dtype=tdtype)
        da, db = dlbridge.from_dlpack(ta), dlbridge.from_dlpack(tb)
        flops = 2 * m**3
        p = cuda_ms(lambda: torch.matmul(ta, tb), max(3, reps // 2))
        o = cuda_ms(lambda: ops.matmul(da, db), max(3, reps // 2))
        print(f"| matmul {m}³ {dtype} (TFLOP/s) | {flops / o / 1e9:.0f} | {flops / p / 1e9:.0f} | {p / o:.2f} |")
        diff = (torch.from_dlpack(ops.matmul(da, db)).float() - torch.matmul(ta, tb).float()).abs().max().item()
        scale = torch.matmul(ta, tb).float().abs().max().item()
        assert diff <= 2e-2 * scale, (dtype, diff, scale)
        del ta, tb, da, db
        torch.cuda.empty_cache()
        dlbridge.empty_cache("cuda:0")


# ---------------------------------------------------------------------------------------------
# CPU


def cpu_ms(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def paired_ms(ours, peer, rounds: int, calls: int = 5, pause: float = 0.25) -> tuple[float, float]:
    """Median milliseconds per call of ``ours()`` and ``peer()``, timed in alternating blocks of
    ``calls`` back-to-back calls with a pause before each block: a BLAS's worker threads spin for
    a while after a call (OpenBLAS's for about 0.1 s) and would otherwise take cores from the
    other library's block."""
    o, p = [], []
    for _ in range(rounds):
        for fn, samples in ((ours, o), (peer, p)):
            time.sleep(pause)
            fn()  # wakes the threads
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(o), statistics.median(p)


def bench_cpu() -> None:
    import os

    n = 1 << (20 if QUICK else 24)
    reps = 5 if QUICK else 15
    print(f"\n## CPU compute ({os.cpu_count()} logical CPUs; dlbridge vs NumPy {np.__version__}, medians of {reps})\n")
    print("| case | dlbridge | NumPy | ratio |")
    print("| --- | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    x = rng.random(n, dtype=np.float32) + 0.5
    y = rng.random(n, dtype=np.float32)
    dx, dy = dlbridge.from_dlpack(x), dlbridge.from_dlpack(y)  # the same memory
    gb = n * 4 / 1e9
    bits = n.bit_length() - 1
    for case, ours, peer, moved in [
        (f"add 2^{bits} float32 (GB/s)", lambda: ops.add(dx, dy), lambda: np.add(x, y), 3 * gb),
        (f"exp 2^{bits} float32 (GB/s)", lambda: ops.exp(dx), lambda: np.exp(x), 2 * gb),
        (f"sqrt 2^{bits} float32 (GB/s)", lambda: ops.sqrt(dx), lambda: np.sqrt(x), 2 * gb),
        (f"sum 2^{bits} float32 (GB/s)", lambda: ops.sum(dx), lambda: np.sum(x), gb),
    ]:
        p = cpu_ms(peer, reps)
        o = cpu_ms(ours, reps)
        print(f"| {case} | {moved / o * 1e3:.1f} | {moved / p * 1e3:.1f} | {p / o:.2f} |")
    # The NumPy habits: reductions (prod of values near 1, so that it stays finite), floor
    # division, a boolean-mask selection of about half the elements (bytes read: values and
    # mask), and a gather of n / 3 random positions (bytes read: positions and values).
    near_one = (1.0 + (rng.random(n, dtype=np.float32) - 0.5) * 1e-6).astype(np.float32)
    dn = dlbridge.from_dlpack(near_one)
    mask = y > 0.5
    dmask = dlbridge.asarray(mask)
    picks = rng.integers(0, n, n // 3)
    dpicks = dlbridge.asarray(picks)
    for case, ours, peer, moved in [
        (f"max 2^{bits} float32 (GB/s)", lambda: ops.max(dx), lambda: np.max(x), gb),
        (f"argmax 2^{bits} float32 (GB/s)", lambda: ops.argmax(dx), lambda: np.argmax(x), gb),
        (f"prod 2^{bits} float32 (GB/s)", lambda: ops.prod(dn), lambda: np.prod(near_one), gb),
        (f"var 2^{bits} float32 (GB/s)", lambda: ops.var(dx), lambda: np.var(x), gb),
        (f"floor_divide 2^{bits} float32 (GB/s)", lambda: dx // dy, lambda: x // y, 3 * gb),
        (f"x[mask] 2^{bits} float32 (GB/s)", lambda: dx[dmask], lambda: x[mask], gb * 1.25),
        (f"x[int64 array] 2^{bits} float32 (GB/s)", lambda: dx[dpicks], lambda: x[picks], gb),
    ]:
        p = cpu_ms(peer, reps)
        o = cpu_ms(ours, reps)
        print(f"| {case} | {moved / o * 1e3:.1f} | {moved / p * 1e3:.1f} | {p / o:.2f} |")
    assert int(ops.argmax(dx)) == int(np.argmax(x))
    assert np.array_equal(np.asarray(dx[dmask]), x[mask])
    assert np.array_equal(np.asarray(dx[dpicks]), x[picks])
    m = 512 if QUICK else 1024
    a = rng.standard_normal((m, m), dtype=np.float32)
    b = rng.standard_normal((m, m), dtype=np.float32)
    da, db = dlbridge.from_dlpack(a), dlbridge.from_dlpack(b)
    flops = 2 * m**3
    o, p = paired_ms(lambda: ops.matmul(da, db), lambda: a @ b, max(3, reps // 3))
    print(f"| matmul {m}³ float32 (GFLOP/s) | {flops / o / 1e6:.1f} | {flops / p / 1e6:.1f} | {p / o:.2f} |")


if __name__ == "__main__":
    print(f"dlbridge {dlbridge.__version__}; ratio = peer time / dlbridge time (above 1: dlbridge faster)")
    for dev in devices():
        {"cpu": bench_cpu, "cuda": bench_cuda}[dev]()
