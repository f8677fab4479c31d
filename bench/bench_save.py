"""Saving tensors durably: dlbridge beside the savers people use and the disk's own ceiling, in one run.

    python bench/bench_save.py [--gb 1.0] [--tensors 64] [--device cpu|cuda:0] [--dir DIR]
                               [--runs 3] [--shard-size 256MB] [--threads 4] [--only NAMES]

Builds about `--gb` GB of tensors (float32 on the CPU, bf16 on a GPU) and times each saver from the
call until the file is durable (its `fsync` has returned; dlbridge's `save_file` syncs the file and,
after the rename, its folder before it returns): the page cache is dropped before each save when
root (`echo 3 > /proc/sys/vm/drop_caches`, as bench/bench_load.py does). Rows:

- raw: the same number of bytes written by `--threads` threads with `O_DIRECT` (16 MiB positioned
  writes of page-aligned memory) to a file in the same folder, then `fsync`: the ceiling;
- `safetensors.torch.save_file`, then `fsync` of the file;
- `torch.save`, then `fsync` of the file;
- `t.cpu()` for every tensor, then `safetensors.torch.save_file` and `fsync` (GPU runs only);
- `dlbridge.save_file` (one file);
- `dlbridge.save_file(..., wait=False)` then `handle.wait()`: the asynchronous save, timed until
  durable, and until `handle.wait_copied()` returned (the device memory may be reused): that
  time is given as GB/s in its own column, beside the pinned device-to-host bandwidth measured
  in the same run (every tensor copied with `non_blocking=True` into pinned PyTorch tensors
  allocated beforehand, then synchronised; on the CPU, copies into host tensors allocated
  beforehand). The first asynchronous save is timed apart, its staging pool emptied before
  (`dlbridge.empty_cache`): it pins its staging (the file's size) while it copies; a job that
  saves every N steps finds the staging in dlbridge's pool from the second save on (the
  repeated save, the rounds' row);
- `dlbridge.save_file(..., max_shard_size=)` (shards written in parallel, with their index).

The savers run in turn, in a rotating order, `--runs` rounds; the table gives each one's median
GB/s and its ratio to raw and to safetensors. Peers that are not installed are reported as such.
`--only dlbridge,safetensors` keeps the savers whose names contain one of the words (and raw).
`--gb 0.05 --runs 1` is a quick check that runs anywhere.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from typing import Callable

import torch

import dlbridge
from bench_load import drop_caches  # the page cache dropped (root only)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_tensors(gb: float, count: int, device: str) -> dict[str, torch.Tensor]:
    """`count` tensors of about `gb` GB in all, of varied row counts, random values."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    per = int(gb * 1e9) // count // torch.tensor([], dtype=dtype).element_size()
    cols = 4096
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(count):
        rows = max(1, per // cols + (i % 5 - 2) * 7)
        out[f"model.layers.{i}.weight"] = torch.randn(rows, cols, generator=gen).to(dtype).to(device)
    return out


def raw_write(path: str, nbytes: int, threads: int) -> None:
    """`nbytes` written with `O_DIRECT` by `threads` threads in 16 MiB positioned writes, then
    synced (the last partial piece rounded up to the page, then the file truncated to size)."""
    chunk = 16 << 20
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o644)
    pieces = list(range(0, nbytes, chunk))
    lock = threading.Lock()

    def work() -> None:
        buf = mmap.mmap(-1, chunk)
        buf.write(os.urandom(4096) * (chunk // 4096))
        while True:
            with lock:
                if not pieces:
                    return
                offset = pieces.pop()
            length = min(chunk, nbytes - offset)
            length = -(-length // 4096) * 4096
            view = memoryview(buf)[:length]
            done = 0
            while done < length:
                done += os.pwrite(fd, view[done:], offset + done)

    try:
        workers = [threading.Thread(target=work) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        os.ftruncate(fd, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".save-bench"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shard-size", default="256MB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--only", default="", help="comma-separated words: keep the savers named with one")
    args = parser.parse_args()

    tensors = make_tensors(args.gb, args.tensors, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    os.makedirs(args.dir, exist_ok=True)
    out = lambda name: os.path.join(args.dir, name)  # noqa: E731
    dropped = drop_caches()

    savers: dict[str, Callable[[], None]] = {}
    savers["raw O_DIRECT write"] = lambda: raw_write(out("raw.bin"), nbytes, args.threads)
    try:
        import safetensors.torch as st

        def st_save() -> None:
            st.save_file(tensors, out("st.safetensors"))
            fsync_path(out("st.safetensors"))

        savers["safetensors.torch.save_file"] = st_save
    except ImportError:
        print("safetensors is not installed: its row is left out")

    def torch_save() -> None:
        torch.save(tensors, out("torch.pt"))
        fsync_path(out("torch.pt"))

    savers["torch.save"] = torch_save
    if args.device != "cpu" and "safetensors.torch.save_file" in savers:
        def cpu_then_st() -> None:
            host = {k: v.cpu() for k, v in tensors.items()}
            st.save_file(host, out("st-cpu.safetensors"))
            fsync_path(out("st-cpu.safetensors"))

        savers["t.cpu() then safetensors.torch.save_file"] = cpu_then_st
    savers["dlbridge.save_file"] = lambda: dlbridge.save_file(tensors, out("dlb.safetensors"))
    copied: list[float] = []

    def dlb_async() -> None:
        start = time.perf_counter()
        handle = dlbridge.save_file(tensors, out("dlb-async.safetensors"), wait=False)
        handle.wait_copied()
        copied.append(time.perf_counter() - start)
        handle.wait()

    savers["dlbridge.save_file(wait=False)"] = dlb_async
    sharded = "max_shard_size" in (dlbridge.save_file.__doc__ or "")
    if sharded:
        savers[f"dlbridge sharded ({args.shard_size})"] = lambda: dlbridge.save_file(
            tensors, out("dlb-sharded"), max_shard_size=args.shard_size
        )
    else:
        print("this dlbridge has no max_shard_size: the sharded row is left out")

    # The device-to-host ceiling for "device memory back": into memory allocated beforehand.
    # (Touched once, so that no page is first faulted in while timed.)
    pinned = {k: torch.zeros(v.shape, dtype=v.dtype, pin_memory=args.device != "cpu") for k, v in tensors.items()}
    d2h: list[float] = []
    for _ in range(max(3, args.runs)):
        if args.device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for k, v in tensors.items():
            pinned[k].copy_(v, non_blocking=True)
        if args.device != "cpu":
            torch.cuda.synchronize()
        d2h.append(time.perf_counter() - start)
    del pinned
    # The first asynchronous save, timed apart: its staging is pinned while it copies (the pool
    # emptied first); from the second save on the staging comes from dlbridge's pool.
    # (dlbridge's own start on the device, a small save, is not counted.)
    pool = "cuda_host:0" if args.device != "cpu" else "cpu"
    dlbridge.save_file({"warm-up": next(iter(tensors.values()))[:1]}, out("warm-up.safetensors"))
    dlbridge.empty_cache(pool)
    drop_caches()
    start = time.perf_counter()
    dlb_async()
    first = (copied.pop(), time.perf_counter() - start)
    if args.only:
        words = [w for w in args.only.split(",") if w]
        savers = {k: v for k, v in savers.items() if k == "raw O_DIRECT write" or any(w in k for w in words)}

    times: dict[str, list[float]] = {name: [] for name in savers}
    names = list(savers)
    for r in range(args.runs):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            for leftover in os.listdir(args.dir):
                p = out(leftover)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            drop_caches()
            if args.device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            savers[name]()
            times[name].append(time.perf_counter() - start)
    shutil.rmtree(args.dir, ignore_errors=True)

    gbs = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    raw = gbs["raw O_DIRECT write"]
    ref = gbs.get("safetensors.torch.save_file")
    print(
        f"\n{nbytes / 1e9:.2f} GB of {next(iter(tensors.values())).dtype} in {len(tensors)} tensors "
        f"from {args.device}, durable (fsync); page cache {'dropped' if dropped else 'NOT dropped (not root)'}"
        f" before each; median of {args.runs} rounds; {sys.platform}, {os.cpu_count()} CPUs"
    )
    print("\n| saver | GB/s | of raw | of safetensors | runs (s) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, value in gbs.items():
        of_st = f"{value / ref:.2f}" if ref else "n/a"
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"| {name} | {value:.2f} | {value / raw:.2f} | {of_st} | {runs} |")
    d2h_gbs = nbytes / statistics.median(d2h) / 1e9
    back_gbs = nbytes / statistics.median(copied) / 1e9 if copied else 0.0
    kind = "pinned device-to-host" if args.device != "cpu" else "host-to-host"
    print(f"\n| memory back to the caller | GB/s | of {kind} copies | runs (s) |")
    print("| --- | ---: | ---: | --- |")
    print(f"| {kind} copies (PyTorch, into memory allocated beforehand) | {d2h_gbs:.2f} | 1.00 | "
          + ", ".join(f"{t:.3f}" for t in d2h) + " |")
    first_gbs = nbytes / first[0] / 1e9
    print(f"| dlbridge.save_file(wait=False), first save (pins its staging): wait_copied() | {first_gbs:.2f} | "
          f"{first_gbs / d2h_gbs:.2f} | {first[0]:.3f} (durable after {first[1]:.2f}) |")
    if copied:
        print(f"| dlbridge.save_file(wait=False), repeated save: wait_copied() | {back_gbs:.2f} | "
              f"{back_gbs / d2h_gbs:.2f} | " + ", ".join(f"{t:.3f}" for t in copied) + " |")
    try:
        cached = f"{dlbridge.memory_stats(pool)['cached_bytes'] / 2**20:.0f} MiB"
    except Exception as e:  # noqa: BLE001 (a figure of the report, not the benchmark)
        cached = f"unknown ({e})"
    print(f"\nThe asynchronous save's staging stays in dlbridge's {pool} pool for the next save: {cached} "
          "cached after the runs (dlbridge.empty_cache releases it).")


if __name__ == "__main__":
    main()
