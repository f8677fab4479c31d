"""CPU conversion benchmark: dlbridge beside NumPy and PyTorch, in one process and one run.

    python bench/bench_cpu.py [--quick] [--json out.json]

Every case is timed in interleaved rounds (each round times every case once), and the median of
the rounds' per-call means is reported, so drift in machine speed hits all cases alike. Sizes:
1 KiB and 1 GiB float32; a conversion is a metadata exchange, so the two must agree within noise.
"""

import argparse
import json
import platform
import statistics
import sys
import timeit

import numpy as np
import torch

import dlbridge


def cases(n):
    x = np.ones(n, dtype=np.float32)
    t = torch.ones(n, dtype=torch.float32)
    a = dlbridge.zeros(n, dtype="float32")
    return {
        "dlbridge.from_dlpack(numpy)": lambda: dlbridge.from_dlpack(x),
        "dlbridge.from_dlpack(torch)": lambda: dlbridge.from_dlpack(t),
        "numpy.from_dlpack(dlbridge)": lambda: np.from_dlpack(a),
        "torch.from_dlpack(dlbridge)": lambda: torch.from_dlpack(a),
        "peer: numpy.from_dlpack(torch)": lambda: np.from_dlpack(t),
        "peer: torch.from_dlpack(numpy)": lambda: torch.from_dlpack(x),
        "peer: numpy.from_dlpack(numpy)": lambda: np.from_dlpack(x),
        "dlbridge_array.__dlpack__()": lambda: a.__dlpack__(max_version=(1, 3)),
        "peer: numpy_array.__dlpack__()": lambda: x.__dlpack__(max_version=(1, 3)),
        "peer: torch_tensor.__dlpack__()": lambda: t.__dlpack__(max_version=(1, 3)),
    }


def measure(fns, number, rounds):
    samples = {name: [] for name in fns}
    for fn in fns.values():  # warm up
        timeit.timeit(fn, number=number)
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(timeit.timeit(fn, number=number) / number * 1e6)
    return samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    number, rounds = (2_000, 5) if args.quick else (20_000, 15)
    sizes = {"1 KiB": 256, "1 GiB": 1 << 28}
    # Both sizes in the same interleaved rounds, so that drift in machine speed cannot pass for a
    # size effect.
    fns = {}
    for label, n in sizes.items():
        for name, fn in cases(n).items():
            fns[(label, name)] = fn
    samples = measure(fns, number, rounds)
    raw = {label: {} for label in sizes}
    for (label, name), v in samples.items():
        raw[label][name] = v
    results = {label: {name: statistics.median(v) for name, v in by_name.items()} for label, by_name in raw.items()}
    small, large = results["1 KiB"], results["1 GiB"]
    print(f"# dlbridge CPU conversions: {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, NumPy {np.__version__}, PyTorch {torch.__version__}, "
          f"dlbridge {dlbridge.__version__}")
    print(f"median per call over {rounds} interleaved rounds of {number} calls\n")
    print("| conversion | 1 KiB (µs) | 1 GiB (µs) |")
    print("| --- | ---: | ---: |")
    for name in small:
        print(f"| `{name}` | {small[name]:.3f} | {large[name]:.3f} |")

    ref = small["peer: numpy.from_dlpack(torch)"]
    print("\n| target | dlbridge | peer | ratio | met |")
    print("| --- | ---: | ---: | ---: | --- |")
    rows = []
    for src in ("numpy", "torch"):
        ours = small[f"dlbridge.from_dlpack({src})"]
        rows.append((f"import from {src} ≤ numpy.from_dlpack(torch)", ours, ref, ours <= ref))
    # The producer-overhead targets compare two calls whose difference is near the timer noise:
    # use the median of per-round paired differences (both timed in the same round).
    for consumer, base in (("numpy", "peer: numpy.from_dlpack(numpy)"), ("torch", "peer: torch.from_dlpack(numpy)")):
        ours_samples = raw["1 KiB"][f"{consumer}.from_dlpack(dlbridge)"]
        peer_samples = raw["1 KiB"][base]
        diff = statistics.median(o - p for o, p in zip(ours_samples, peer_samples))
        ours, peer = small[f"{consumer}.from_dlpack(dlbridge)"], small[base]
        rows.append((f"{consumer}.from_dlpack(dlbridge) − {consumer}.from_dlpack(numpy) ≤ 0.150 µs "
                     f"(paired median: {diff * 1000:+.0f} ns)", ours, peer, diff <= 0.150))
    for name, ours, peer, ok in rows:
        print(f"| {name} | {ours:.3f} | {peer:.3f} | {ours / peer:.2f} | {'yes' if ok else 'NO'} |")
    ours = [k for k in small if k.startswith(("dlbridge", "numpy", "torch"))]
    worst = max(ours, key=lambda k: abs(large[k] - small[k]) / small[k])
    print(f"\nlargest 1 GiB vs 1 KiB difference among dlbridge conversions: "
          f"{(large[worst] - small[worst]) / small[worst] * 100:+.0f}% ({worst})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
