"""Allocation benchmark: dlbridge's caching pool beside NumPy and PyTorch, in one process and one
run.

    python bench/bench_pool.py [--quick] [--devices cpu,cuda,metal] [--json out.json]

Each case is one allocate + free of an uninitialised uint8 array of 4 KiB, 1 MiB or 256 MiB:

* ``dlbridge cached``: ``dlbridge.empty(n, dlbridge.uint8)`` (with ``device=`` off the CPU) +
  ``del`` after a warm-up, so every call is a cache hit;
* ``dlbridge uncached``: the same + ``dlbridge.empty_cache()``, so every call
  allocates from the driver and (in ``empty_cache``) frees to it again;
* peers: ``numpy.empty(n, uint8)`` + ``del``; ``torch.empty(n, dtype=torch.uint8)`` + ``del``
  (on CUDA and Metal: PyTorch's own caching allocator, cached and after
  ``torch.cuda.empty_cache()`` / ``torch.mps.empty_cache()``; on Metal dlbridge's arrays are in the
  device's default storage mode, shared on Apple silicon).

Cases are timed in interleaved rounds (each round times every case once, in a new seeded order).
A time is the median of the rounds' per-call means; a ratio is the median of the rounds' ratios,
whose two cases ran in the same round (a slow phase of a shared machine divides out). Nothing
touches the memory, so page faults of fresh memory (which reuse avoids) are not in these figures.

A device column appears for every device in ``--devices`` whose backend dlbridge has; CUDA and
Metal are skipped, with a note, where they are not available.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import timeit

import numpy as np
import torch

import dlbridge

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "256 MiB": 256 << 20}


def cuda_available() -> tuple[bool, str]:
    if not hasattr(dlbridge, "cuda"):
        return False, "this build of dlbridge has no dlbridge.cuda"
    if not torch.cuda.is_available():
        return False, "PyTorch sees no CUDA device"
    return True, ""


def metal_available() -> tuple[bool, str]:
    if not dlbridge.metal.is_available():
        return False, dlbridge.metal.unavailable_reason()
    if not torch.backends.mps.is_available():
        return False, "PyTorch sees no MPS device"
    return True, ""


def cases(device: str, n: int) -> dict:
    # Each library is called as its users would: with its own dtype object, and on the CPU in the
    # same form as NumPy (the default device, no keywords).
    if device == "cpu":
        def dl_cached():
            a = dlbridge.empty(n, dlbridge.uint8)
            del a

        def dl_uncached():
            a = dlbridge.empty(n, dlbridge.uint8)
            del a
            dlbridge.empty_cache(device)
    else:
        def dl_cached():
            a = dlbridge.empty(n, dlbridge.uint8, device=device)
            del a

        def dl_uncached():
            a = dlbridge.empty(n, dlbridge.uint8, device=device)
            del a
            dlbridge.empty_cache(device)

    out = {"dlbridge cached": dl_cached, "dlbridge uncached": dl_uncached}
    if device == "cpu":
        def numpy_empty():
            a = np.empty(n, np.uint8)
            del a

        def torch_empty():
            a = torch.empty(n, dtype=torch.uint8)
            del a

        out["numpy.empty"] = numpy_empty
        out["torch.empty"] = torch_empty
    else:
        on_metal = device.startswith("metal")
        torch_device = "mps" if on_metal else device
        torch_empty_cache = torch.mps.empty_cache if on_metal else torch.cuda.empty_cache

        def torch_cached():
            a = torch.empty(n, dtype=torch.uint8, device=torch_device)
            del a

        def torch_uncached():
            a = torch.empty(n, dtype=torch.uint8, device=torch_device)
            del a
            torch_empty_cache()

        out["torch.empty cached"] = torch_cached
        out["torch.empty uncached"] = torch_uncached
    return out


def measure(fns: dict, numbers: dict, rounds: int, verbose: bool = False) -> dict:
    for key, fn in fns.items():  # warm-up: fills the caches the cached cases rely on
        timeit.timeit(fn, number=max(numbers[key] // 10, 5))
    samples = {key: [] for key in fns}
    # Each round times the cases in a new (seeded) order. A fixed order put one case right after
    # the same neighbours every round, and on the H100 machine the first CUDA case after the CPU
    # cases (whichever library's it was) ran 5-10x slower in every round but the first.
    order = random.Random(20261121)
    keys = list(fns)
    for _ in range(rounds):
        order.shuffle(keys)
        for key in keys:
            fn = fns[key]
            samples[key].append(timeit.timeit(fn, number=numbers[key]) / numbers[key] * 1e6)
    if verbose:
        for key, v in samples.items():
            print(" / ".join(key), " ".join(f"{x:.3f}" for x in v), file=sys.stderr)
    return samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    ap.add_argument("--devices", default="cpu,cuda,metal", help="comma-separated: cpu, cuda, metal")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--verbose", action="store_true", help="print every round's figure (stderr)")
    args = ap.parse_args()
    number, rounds = (500, 5) if args.quick else (20_000, 11)

    devices, notes = [], []
    for device in args.devices.split(","):
        device = device.strip()
        available = {"cuda": cuda_available, "metal": metal_available}.get(device)
        if available is not None:
            ok, why = available()
            if not ok:
                notes.append(f"{device}: skipped ({why})")
                continue
        devices.append(device)

    fns, numbers = {}, {}
    for device in devices:
        for label, n in SIZES.items():
            for name, fn in cases(device, n).items():
                key = (device, label, name)
                fns[key] = fn
                # Driver round trips of 256 MiB cost tens of microseconds: fewer calls.
                numbers[key] = number // 10 if "uncached" in name and n >= 1 << 20 else number
    saved_limit = dlbridge.memory_stats()["cache_limit"]
    dlbridge.set_cache_limit(None)  # 256 MiB blocks stay cached whatever the default limit
    try:
        samples = measure(fns, numbers, rounds, args.verbose)
    finally:
        dlbridge.set_cache_limit(saved_limit)
    results = {key: statistics.median(v) for key, v in samples.items()}

    def ratio(a, b):
        # The median of the rounds' ratios: both cases of a ratio ran in the same round, seconds
        # apart, so a slow phase of the machine (common on shared VMs) divides out.
        return statistics.median(x / y for x, y in zip(samples[a], samples[b]))

    print(f"# dlbridge allocation: {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, NumPy {np.__version__}, PyTorch {torch.__version__}, "
          f"dlbridge {dlbridge.__version__}")
    print(f"median per allocate + free (µs) over {rounds} interleaved rounds; ratios are the "
          f"median of the rounds' ratios\n")
    for note in notes:
        print(f"- {note}")
    if notes:
        print()
    names = list(dict.fromkeys(name for (_, _, name) in fns))
    header = " | ".join(f"{d}: {label}" for d in devices for label in SIZES)
    print(f"| case | {header} |")
    print("| --- |" + " ---: |" * (len(devices) * len(SIZES)))
    for name in names:
        row = []
        for d in devices:
            for label in SIZES:
                v = results.get((d, label, name))
                row.append("" if v is None else f"{v:.3f}")
        print(f"| {name} | " + " | ".join(row) + " |")

    print("\n| ratio | " + header + " |")
    print("| --- |" + " ---: |" * (len(devices) * len(SIZES)))
    gpu_peers = ["torch.empty cached", "torch.empty uncached"]
    peers = {"cpu": ["numpy.empty", "torch.empty"], "cuda": gpu_peers, "metal": gpu_peers}
    for ours in ["dlbridge cached", "dlbridge uncached"]:
        for peer in sorted({p for d in devices for p in peers.get(d.split(":")[0], [])}):
            row = []
            for d in devices:
                for label in SIZES:
                    a, b = (d, label, ours), (d, label, peer)
                    row.append(f"{ratio(a, b):.2f}" if a in samples and b in samples else "")
            print(f"| {ours} / {peer} | " + " | ".join(row) + " |")

    stats = dlbridge.memory_stats()
    print(f"\ncpu pool after the run: {stats['cache_hits']} hits, {stats['cache_misses']} misses, "
          f"{stats['driver_allocations']} driver allocations, {stats['driver_frees']} driver frees")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({" / ".join(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
