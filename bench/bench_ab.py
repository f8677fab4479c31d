"""Two builds of dlbridge side by side: conversion, copy, pool, loader and IPC figures, each build in
fresh processes, alternated (A B A B ...), in one run.

    python bench/bench_ab.py --a DIR_A --b DIR_B [--rounds 5] [--device cuda:0] [--gb 2]

``DIR_A``/``DIR_B`` are directories a wheel was installed into (``pip install --no-deps --target
DIR``): each round runs this file's probe once per build in a new interpreter with that directory
first on ``PYTHONPATH``, so both builds see the same machine state in turn. Prints, per figure,
the median of the rounds for each build and B's ratio to A (above 1: B is faster), beside the
spread of the rounds (max/min of A's figures: what "within noise" means in this run).

Figures (CPU always; CUDA where ``--device`` names a CUDA device and PyTorch sees one):

* conversion: per-call µs of ``torch.from_dlpack(a)``, ``numpy.from_dlpack(a)``,
  ``dlbridge.from_dlpack(t)`` of a 1-element array (a metadata exchange);
* copy: GB/s of 256 MiB host → device, device → host and device → device copies
  (``a.to(device)``, ``dst[...] = src``), synchronized;
* pool: per-call µs of ``dlbridge.empty`` + ``del`` of 1 MiB (cache hits after a warm-up), and
  the ms a new 256 MiB block of pinned memory takes (the pool has none that size yet);
* loader: GB/s of ``dlbridge.load_file`` of a ``--gb`` checkpoint in 4 shards onto the device,
  warm page cache: the process's first load, and a second one;
* IPC: per-round-trip µs of a 4 KiB array through ``dlbridge.multiprocessing``'s ``Queue`` to a
  spawned consumer that reads one element and answers with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def _consumer(q_in, q_out) -> None:
    import dlbridge.multiprocessing  # noqa: F401  (registers the reducers)

    while True:
        x = q_in.get()
        if x is None:
            return
        q_out.put(float(x[0]))


def _ipc_us(dlbridge, device: str, reps: int = 200) -> float:
    import dlbridge.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consumer, args=(q_in, q_out))
    p.start()
    try:
        x = dlbridge.full((1024,), 1.0, "float32", device=device)
        for _ in range(10):
            q_in.put(x)
            assert q_out.get(timeout=120) == 1.0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            q_in.put(x)
            assert q_out.get(timeout=120) == 1.0
            times.append((time.perf_counter_ns() - t0) / 1000)
        return statistics.median(times)
    finally:
        q_in.put(None)
        p.join(60)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn, sync, reps: int = 5) -> float:
    fn()
    sync()
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def probe(device: str, files: list[str], pin: int | None = None) -> dict[str, float]:
    """The figures of the dlbridge on ``sys.path``, in this process; the per-call figures on CPU
    ``pin`` alone where given (after the loader, which uses every core)."""
    out: dict[str, float] = {}
    # The loader first: the process's first load is what users see.
    import dlbridge
    import numpy as np
    import torch
    from bench_cuda import per_call_us

    def _per_call_us(fn) -> float:
        if pin is None:
            return per_call_us(fn, calls=20000, rounds=9)
        every = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {pin})
        try:
            return per_call_us(fn, calls=20000, rounds=9)
        finally:
            os.sched_setaffinity(0, every)

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    if cuda and files:
        torch.cuda.init()
        dlbridge.synchronize(device)  # the device's context, as a user's script has it by now
        total = sum(os.path.getsize(f) for f in files)
        for label in ("loader, first load (GB/s)", "loader, again (GB/s)"):
            t0 = time.perf_counter()
            got = dlbridge.load_file(files, device=device)
            dlbridge.synchronize(device)
            out[label] = _gbps(total, time.perf_counter() - t0)
            del got

    a = dlbridge.asarray(np.ones(1, dtype=np.float32))
    t = torch.ones(1)
    out["torch.from_dlpack(a) CPU (us)"] = _per_call_us(lambda: torch.from_dlpack(a))
    out["numpy.from_dlpack(a) CPU (us)"] = _per_call_us(lambda: np.from_dlpack(a))
    out["dlbridge.from_dlpack(torch) CPU (us)"] = _per_call_us(lambda: dlbridge.from_dlpack(t))
    out["empty 1 MiB + del, CPU (us)"] = _per_call_us(
        lambda: dlbridge.empty((1 << 20,), "uint8"))
    out["IPC round trip 4 KiB, CPU (us)"] = _ipc_us(dlbridge, "cpu")
    if not cuda:
        return out

    ad = dlbridge.full((1,), 1.0, "float32", device=device)
    td = torch.ones(1, device=device)
    out["torch.from_dlpack(a) CUDA (us)"] = _per_call_us(lambda: torch.from_dlpack(ad))
    out["dlbridge.from_dlpack(torch) CUDA (us)"] = _per_call_us(lambda: dlbridge.from_dlpack(td))
    out["empty 1 MiB + del, CUDA (us)"] = _per_call_us(
        lambda: dlbridge.empty((1 << 20,), "uint8", device=device))
    n = 256 << 20
    host = dlbridge.asarray(np.ones(n, dtype=np.uint8))
    t0 = time.perf_counter()
    pinned = dlbridge.empty((n,), "uint8", device=device.replace("cuda", "cuda_host"))
    out["pinned 256 MiB, a new block (ms)"] = (time.perf_counter() - t0) * 1e3
    pinned[...] = host
    dev = dlbridge.empty((n,), "uint8", device=device)
    dev2 = dlbridge.empty((n,), "uint8", device=device)
    back = dlbridge.empty((n,), "uint8", device=device.replace("cuda", "cuda_host"))

    def sync() -> None:
        dlbridge.synchronize(device)

    def assign(dst, src):
        def run() -> None:
            dst[...] = src
        return run

    out["copy pageable H2D 256 MiB (GB/s)"] = _gbps(n, _timed(lambda: host.to(device), sync))
    out["copy pinned H2D 256 MiB (GB/s)"] = _gbps(n, _timed(assign(dev, pinned), sync))
    out["copy D2H pinned 256 MiB (GB/s)"] = _gbps(n, _timed(assign(back, dev), sync))
    out["copy D2D 256 MiB (GB/s)"] = _gbps(n, _timed(assign(dev2, dev), sync))
    out["IPC round trip 4 KiB, CUDA (us)"] = _ipc_us(dlbridge, device)
    return out


def make_checkpoint(directory: str, gb: float) -> list[str]:
    """``gb`` GB of float16 in 4 shards of 8 tensors each (written once, with the safetensors
    package)."""
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    per_tensor = int(gb * 1e9 / 32) // 2
    rows = per_tensor // 4096
    files = []
    rng = np.random.default_rng(0)
    for s in range(4):
        path = os.path.join(directory, f"ab-{gb}-{s}.safetensors")
        files.append(path)
        if os.path.exists(path):
            continue
        tensors = {f"s{s}.t{i}": rng.standard_normal((rows, 4096), dtype=np.float32)
                   .astype(np.float16) for i in range(8)}
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)
    for f in files:  # warm: the page cache holds the files
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="directory with build A installed")
    ap.add_argument("--b", required=True, help="directory with build B installed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size for the loader figures")
    ap.add_argument("--dir", default="/tmp/dlbridge-bench-ab")
    ap.add_argument("--pin", type=int, help="run the per-call figures on this CPU alone (less "
                    "scatter from the scheduler and the cores' clocks)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe is not None:
        files = json.loads(args.probe)
        print(json.dumps(probe(args.device, files, args.pin)))
        return
    files = make_checkpoint(args.dir, args.gb) if args.device.startswith("cuda") else []
    got: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            root = args.a if side == "A" else args.b
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
            res = subprocess.run(
                [sys.executable, HERE, "--a", args.a, "--b", args.b, "--device", args.device,
                 "--probe", json.dumps(files)] + ([] if args.pin is None else ["--pin", str(args.pin)]),
                env=env, capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                sys.exit(f"build {side} failed:\n{res.stderr[-4000:]}")
            got[side].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {side} done", file=sys.stderr, flush=True)
    names = list(got["A"][0])
    pinned = "" if args.pin is None else f"; per-call figures on CPU {args.pin} alone"
    print(f"A = {args.a}\nB = {args.b}\n{args.rounds} rounds each, alternated; medians{pinned}\n")
    print("| figure | A | B | B vs A (>1: B faster) | A's spread (max/min) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in names:
        a = [g[name] for g in got["A"]]
        b = [g[name] for g in got["B"] if name in g]
        ma, mb = statistics.median(a), statistics.median(b)
        faster = mb / ma if name.endswith("(GB/s)") else ma / mb  # times: less is faster
        spread = max(a) / min(a)
        print(f"| {name} | {ma:.3f} | {mb:.3f} | {faster:.2f} | {spread:.2f} |")


if __name__ == "__main__":
    main()
