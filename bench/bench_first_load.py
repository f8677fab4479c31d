"""The first load of a process: each loader in a fresh process, as a user's script runs it.

    python bench/bench_first_load.py [--dir DIR] [--layers 16] [--shards 4] [--runs 3] [--no-cold]
                                     [--attribute]

A process loads its model once, so the figure users see is a load in a fresh process: Python,
PyTorch and the loader imported, CUDA initialised (as a script has done before it loads), then one
load timed from the call until every tensor is on cuda:0 and the device is synchronized. Each
loader runs `--runs` times, every run in a process of its own, warm (the files read once before)
and cold (the page cache dropped first; needs root). Beside them, in the same run: pinned
host-to-device bandwidth (1 GiB, torch) and, cold, a raw multi-threaded `O_DIRECT` read of the same
files into page-aligned host memory. dlbridge's process also loads a second time after dropping
the first result ("again"), the steady state beside the first load.

`--attribute` adds dlbridge runs whose process first allocates (and frees) the load's device
memory, its pinned staging memory, or both, before the timed load: what a first load spends on
memory the pools hold after it.

The checkpoint is `bench/bench_load.py`'s (bf16, transformer-shaped; 16 layers are 6.7 GB).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# --- loaders, each run in its own process: files -> every tensor on cuda:0 ----------------------

def load_dlbridge(files):
    import dlbridge
    kw = json.loads(os.environ.get("BENCH_DLBRIDGE_KW", "{}"))  # --dlbridge-kw, for sweeps
    out = dlbridge.load_file(files, "cuda:0", progress=False, **kw)
    dlbridge.synchronize("cuda:0")
    return out


def load_instanttensor(files, buffered=True):
    from instanttensor import safe_open
    kw = {}
    if buffered:
        from instanttensor import BackendPolicy
        kw["backend"] = BackendPolicy.BUFFERED
    with safe_open(files, framework="pt", device=0, **kw) as f:
        return dict(f.tensors())


def load_safetensors(files):
    from safetensors.torch import load_file
    out = {}
    for f in files:
        out.update(load_file(f, device="cuda:0"))
    return out


def load_fastsafetensors(files):
    from fastsafetensors import fastsafe_open
    with fastsafe_open(filenames=files, device="cuda:0", nogds=True) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


LOADERS = {
    "dlbridge.load_file": load_dlbridge,
    "instanttensor (buffered)": lambda files: load_instanttensor(files, True),
    "instanttensor (default)": lambda files: load_instanttensor(files, False),
    "fastsafetensors (nogds)": load_fastsafetensors,
    "safetensors load_file(device=cuda:0)": load_safetensors,
}


def prewarm(files, what: str) -> None:
    """Allocates and frees, through dlbridge's pools, the device memory a load of `files` takes
    (`device`), the pinned staging memory its readers take (`pinned`), or both."""
    import dlbridge
    size = sum(os.path.getsize(f) for f in files)
    if what in ("device", "both"):
        # One allocation per file, as the load makes them.
        held = [dlbridge.empty((os.path.getsize(f),), dtype="uint8", device="cuda:0") for f in files]
        del held
    if what in ("pinned", "both"):
        threads = os.cpu_count() or 8
        chunk = 4 << 20
        held = [dlbridge.empty((chunk + 8192,), dtype="uint8", device="cuda_host:0")
                for _ in range(2 * max(threads, 1))]
        del held
    dlbridge.synchronize("cuda:0")
    del size


def child(loader: str, files: list[str], again: bool, warm: str) -> None:
    t0 = time.perf_counter()
    import torch
    if loader.startswith("dlbridge"):
        import dlbridge  # noqa: F401
    imported = time.perf_counter() - t0
    torch.cuda.init()
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    if loader.startswith("dlbridge"):
        import dlbridge
        dlbridge.synchronize("cuda:0")  # dlbridge's own CUDA context, as any first call makes it
        if warm:
            prewarm(files, warm)
    fn = LOADERS[loader]
    start = time.perf_counter()
    out = fn(files)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    result = {"first": first, "import": imported}
    if again:
        del out
        import gc
        gc.collect()
        start = time.perf_counter()
        out = fn(files)
        torch.cuda.synchronize()
        result["again"] = time.perf_counter() - start
    print(json.dumps(result), flush=True)


def child_pinned_h2d() -> None:
    import torch
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dev.copy_(host, non_blocking=True)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    print(json.dumps({"gbps": n / statistics.median(times) / 1e9}), flush=True)


def child_raw_read(files: list[str], threads: int, chunk: int) -> None:
    """Every file read with `O_DIRECT` by `threads` threads taking `chunk`-byte pieces in turn."""
    pieces = []
    for f in files:
        size = os.path.getsize(f)
        pieces += [(f, off, min(chunk, size - off)) for off in range(0, size, chunk)]
    lock = threading.Lock()
    state = {"next": 0}

    def work() -> None:
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT asks
        fds: dict[str, int] = {}
        try:
            while True:
                with lock:
                    i = state["next"]
                    state["next"] += 1
                if i >= len(pieces):
                    return
                f, off, n = pieces[i]
                if f not in fds:
                    fds[f] = os.open(f, os.O_RDONLY | os.O_DIRECT)
                view = memoryview(buf)[:(n + 4095) // 4096 * 4096]
                os.preadv(fds[f], [view], off)
        finally:
            for fd in fds.values():
                os.close(fd)

    start = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


# --- the parent: fresh processes, medians, the table ---------------------------------------------
# (The loaders' processes import neither bench_load.py nor dlbridge unless they load with it.)

def run_child(args: list[str], timeout: float = 300) -> dict | None:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True,
                          text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"    failed ({proc.returncode}): {tail[:160]}", flush=True)
        return None
    return json.loads(lines[-1])


def installed(loader: str) -> bool:
    module = {"dlbridge": "dlbridge", "instanttensor": "instanttensor",
              "fastsafetensors": "fastsafetensors", "safetensors": "safetensors"}[loader.split()[0].split(".")[0]]
    from importlib.util import find_spec
    return find_spec(module) is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/dlbridge-bench-load")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per loader and mode (median)")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--attribute", action="store_true", help="dlbridge with its pools warmed first")
    ap.add_argument("--only", default="", help="loaders whose names contain one of these (comma-separated)")
    ap.add_argument("--dlbridge-kw", default="{}",
                    help="JSON keyword arguments for dlbridge.load_file, e.g. '{\"chunk_bytes\": 2097152}'")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    ap.add_argument("--again", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prewarm", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        files = json.loads(args.files) if args.files else []
        if args.child == "pinned-h2d":
            child_pinned_h2d()
        elif args.child == "raw-read":
            child_raw_read(files, threads=min(32, 2 * (os.cpu_count() or 8)), chunk=16 << 20)
        else:
            child(args.child, files, args.again, args.prewarm)
        return 0

    os.environ["BENCH_DLBRIDGE_KW"] = args.dlbridge_kw
    sys.path.insert(0, HERE)
    from bench_load import drop_caches, generate, warm_up  # bench_load.py's checkpoint and cache control
    files = generate(args.dir, args.layers, args.shards)
    size = sum(os.path.getsize(f) for f in files)
    print(f"checkpoint: {len(files)} files, {size / 1e9:.2f} GB; each load in a fresh process, "
          f"median of {args.runs}", flush=True)
    cold_ok = not args.no_cold and drop_caches()
    if not args.no_cold and not cold_ok:
        print("(cold runs skipped: dropping the page cache needs root)")
    modes = ["warm"] + (["cold"] if cold_ok else [])

    h2d = run_child(["--child", "pinned-h2d"])
    h2d_gbps = h2d["gbps"] if h2d else float("nan")
    raw_gbps = float("nan")
    if cold_ok:
        drop_caches()
        raw = run_child(["--child", "raw-read", "--files", json.dumps(files)])
        raw_gbps = size / raw["seconds"] / 1e9 if raw else float("nan")

    rows = [(name, name, "") for name in LOADERS]
    if args.attribute:
        rows += [(f"dlbridge, {w} memory allocated first", "dlbridge.load_file", w)
                 for w in ("device", "pinned", "both")]
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    results: dict[tuple[str, str], dict] = {}
    for label, loader, warm in rows:
        if only and not any(o in label for o in only):
            continue
        if not installed(loader):
            print(f"{label}: not installed", flush=True)
            continue
        for mode in modes:
            firsts, agains = [], []
            for _ in range(args.runs):
                if mode == "cold":
                    drop_caches()
                else:
                    warm_up(files)
                extra = ["--again"] if loader.startswith("dlbridge") and not warm else []
                r = run_child(["--child", loader, "--files", json.dumps(files), "--prewarm", warm, *extra])
                if r:
                    firsts.append(r["first"])
                    if "again" in r:
                        agains.append(r["again"])
            if firsts:
                results[(label, mode)] = {
                    "first": size / statistics.median(firsts) / 1e9,
                    "again": size / statistics.median(agains) / 1e9 if agains else None,
                }
                a = results[(label, mode)]["again"]
                print(f"  {label} [{mode}]: first {results[(label, mode)]['first']:.2f} GB/s"
                      + (f", again {a:.2f}" if a else ""), flush=True)

    print(f"\npinned host-to-device (torch, 1 GiB): {h2d_gbps:.2f} GB/s"
          + (f"; raw O_DIRECT read of the files, cold: {raw_gbps:.2f} GB/s" if cold_ok else ""))
    for mode in modes:
        peers = [v["first"] for (label, m), v in results.items()
                 if m == mode and not label.startswith("dlbridge")]
        best_peer = max(peers) if peers else float("nan")
        ceiling, ceiling_name = (h2d_gbps, "pinned H2D") if mode == "warm" else (raw_gbps, "raw read")
        print(f"\n{mode}: first load in a fresh process, GB/s (ratio to the fastest peer; to {ceiling_name})")
        print(f"| loader | first load | vs fastest peer | of {ceiling_name} | again, same process |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for (label, m), v in results.items():
            if m != mode:
                continue
            again = f"{v['again']:.2f}" if v["again"] else "–"
            print(f"| {label} | {v['first']:.2f} | {v['first'] / best_peer:.2f}× | "
                  f"{v['first'] / ceiling:.2f} | {again} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
