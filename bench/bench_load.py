"""Loading a safetensors checkpoint onto a GPU: dlbridge beside the loaders people use, in one run.

    python bench/bench_load.py [--dir DIR] [--layers 16] [--shards 4] [--runs 3] [--no-cold]

Generates (once) a bf16 checkpoint shaped like a transformer (hidden 4096, MLP 11008, vocabulary
32000; 16 layers make about 6.7 GB) in shards, then times each loader from opening the files until
every tensor is on cuda:0 and the device is synchronized: cold (page cache dropped first, which needs
root: `echo 3 > /proc/sys/vm/drop_caches`) and warm (the files read once before). Beside them: the
machine's pinned host-to-device bandwidth and the raw sequential read speed of the files. Prints
GB/s and dlbridge's ratio to each. Peers that are not installed are reported as such.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

import dlbridge

HIDDEN, MLP, VOCAB = 4096, 11008, 32000


def generate(directory: str, layers: int, shards: int) -> list[str]:
    """The checkpoint's shards, written once: safetensors files whose bf16 values are random bytes
    (a 64 MiB block repeated; finite, as the high byte's exponent bits are never all set). The
    header is written here, the format's way (an 8-byte little-endian length, JSON padded with
    spaces to 8 bytes); `safetensors` itself reads these files in the benchmark."""
    import numpy as np

    os.makedirs(directory, exist_ok=True)
    stamp = os.path.join(directory, f"stamp-{layers}-{shards}.json")
    if os.path.exists(stamp):
        return json.load(open(stamp))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
        shapes[p + "mlp.gate_proj.weight"] = (MLP, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (MLP, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, MLP)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    names = list(shapes)
    per = -(-len(names) // shards)
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    block[1::2] &= 0x3F
    block = block.tobytes()
    files = []
    for s in range(shards):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for n in names[s * per:(s + 1) * per]:
            nbytes = 2 * int(np.prod(shapes[n]))
            header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path = os.path.join(directory, f"model-{s + 1:05d}-of-{shards:05d}.safetensors")
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            left = offset
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
        files.append(path)
    json.dump(files, open(stamp, "w"))
    return files


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm_up(files: list[str]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(bytearray(64 << 20)):
                pass


def raw_read(files: list[str]) -> None:
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass


def total_bytes(files: list[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


# --- loaders: each returns a dict name -> tensor (anything) with every tensor on cuda:0 -------------

def load_dlbridge(files, **kw):
    out = dlbridge.load_file(files, "cuda:0", progress=False, **kw)
    dlbridge.synchronize("cuda:0")
    return out


def with_env(env: dict[str, str], fn, *args, **kw):
    """`fn(*args, **kw)` with the environment variables `env` set for the call."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args, **kw)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def load_dlbridge_registered(files, **kw):
    """dlbridge copying from the files' registered pages alone (opt-in)."""
    return with_env({"DLBRIDGE_LOAD_REGISTER": "1"}, load_dlbridge, files, **kw)


def load_st_cuda(files):
    from safetensors.torch import load_file
    out = {}
    for f in files:
        out.update(load_file(f, device="cuda:0"))
    return out


def load_st_cpu_then_to(files):
    from safetensors.torch import load_file
    out = {}
    for f in files:
        out.update({k: v.to("cuda:0") for k, v in load_file(f).items()})
    return out


def load_fastsafetensors(files):
    from fastsafetensors import fastsafe_open
    with fastsafe_open(filenames=files, device="cuda:0", nogds=True) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load_instanttensor(files, buffered=False):
    from instanttensor import safe_open
    kw = {}
    if buffered:
        from instanttensor import BackendPolicy
        kw["backend"] = BackendPolicy.BUFFERED
    with safe_open(files, framework="pt", device=0, **kw) as f:
        return dict(f.tensors())


def load_runai(files):
    from runai_model_streamer import SafetensorsStreamer
    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files)
        for name, tensor in streamer.get_tensors():
            out[name] = tensor.to("cuda:0")
    return out


def time_once(fn, files, cold: bool) -> float:
    gc.collect()
    torch.cuda.empty_cache()
    dlbridge.empty_cache("cuda:0")
    if cold:
        drop_caches()
    else:
        warm_up(files)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(files)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del out
    return seconds


def pinned_h2d_gbps() -> float:
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return n / statistics.median(times) / 1e9


def sweep(files: list[str], size: int) -> None:
    print("\nsweep (warm, dlbridge: reader threads x chunk size; GB/s, median of 2):")
    chunks = (2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20)
    print("threads " + "".join(f"{c >> 20:>7} MiB" for c in chunks))
    for threads in (2, 4, 6, 8, 12, 16):
        row = []
        for chunk in chunks:
            t = statistics.median(time_once(lambda f: load_dlbridge(f, threads=threads, chunk_bytes=chunk),
                                            files, False) for _ in range(2))
            row.append(size / t / 1e9)
        print(f"{threads:>7} " + "".join(f"{r:>11.2f}" for r in row), flush=True)
    sweep_registered(files, size)


def sweep_registered(files: list[str], size: int) -> None:
    print("\nsweep (warm, dlbridge registered pages: threads x window size (16 chunks); GB/s, median of 2):")
    windows = (64 << 20, 128 << 20, 256 << 20)
    print("threads " + "".join(f"{c >> 20:>7} MiB" for c in windows))
    for threads in (1, 2, 4, 8):
        row = []
        for window in windows:
            t = statistics.median(time_once(lambda f: load_dlbridge_registered(f, threads=threads, chunk_bytes=window // 16),
                                            files, False) for _ in range(2))
            row.append(size / t / 1e9)
        print(f"{threads:>7} " + "".join(f"{r:>11.2f}" for r in row), flush=True)


def sweep_cold(files: list[str], size: int) -> None:
    print("\nsweep (cold, dlbridge direct reads: threads x chunk size; GB/s, one run each):")
    chunks = (4 << 20, 16 << 20, 64 << 20)
    print("threads " + "".join(f"{c >> 20:>7} MiB" for c in chunks))
    for threads in (8, 16, 32):
        row = []
        for chunk in chunks:
            t = time_once(lambda f: load_dlbridge(f, threads=threads, chunk_bytes=chunk), files, True)
            row.append(size / t / 1e9)
        print(f"{threads:>7} " + "".join(f"{x:>11.2f}" for x in row), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/dlbridge-bench-load")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="warm runs per loader (median)")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep dlbridge's threads and chunk size (warm)")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep (no peers, no cold runs)")
    ap.add_argument("--sweep-registered", action="store_true", help="only the registered-pages sweep")
    ap.add_argument("--sweep-cold", action="store_true", help="only the cold sweep of direct reads")
    ap.add_argument("--only", default="", help="run only the loaders whose names contain one of these "
                    "comma-separated words (e.g. 'dlbridge,BUFFERED')")
    args = ap.parse_args()
    t0 = time.perf_counter()
    files = generate(args.dir, args.layers, args.shards)
    size = total_bytes(files)
    n_tensors = len(dlbridge._dlbridge._Checkpoint(files).keys())
    print(f"checkpoint: {len(files)} shards, {n_tensors} tensors, {size / 1e9:.2f} GB bf16 "
          f"(ready in {time.perf_counter() - t0:.1f} s); GPU {torch.cuda.get_device_name(0)}; "
          f"{os.cpu_count()} CPUs")
    can_drop = not args.no_cold and drop_caches()
    if not can_drop:
        print("cold runs: skipped (cannot drop the page cache: needs root)")

    loaders = [
        ("dlbridge.load_file(files, 'cuda:0')", load_dlbridge),
        ("dlbridge, registered pages (DLBRIDGE_LOAD_REGISTER=1)", load_dlbridge_registered),
        ("dlbridge, an allocation per tensor (allocation='per-tensor')",
         lambda f: load_dlbridge(f, allocation="per-tensor")),
        ("safetensors.torch.load_file(f, device='cuda:0')", load_st_cuda),
        ("safetensors to CPU, then .to('cuda:0')", load_st_cpu_then_to),
        ("fastsafetensors fastsafe_open(nogds=True)", load_fastsafetensors),
        ("InstantTensor safe_open (default backend)", load_instanttensor),
        ("InstantTensor safe_open (BackendPolicy.BUFFERED)", lambda f: load_instanttensor(f, True)),
        ("Run:ai Model Streamer SafetensorsStreamer", load_runai),
    ]
    if args.only:
        words = args.only.split(",")
        loaders = [(n, f) for n, f in loaders if any(w in n for w in words)]
    results: dict[str, tuple[float | None, float | None, str]] = {}
    if args.sweep_registered or args.sweep_cold:
        if args.sweep_registered:
            sweep_registered(files, size)
        if args.sweep_cold and can_drop:
            sweep_cold(files, size)
        return 0
    if args.sweep_only:
        loaders = []
    for name, fn in loaders:
        try:
            warm = statistics.median(time_once(fn, files, False) for _ in range(args.runs))
            cold = time_once(fn, files, True) if can_drop else None
            results[name] = (size / cold / 1e9 if cold else None, size / warm / 1e9, "")
        except Exception as e:  # a peer that is missing or fails is reported, not fatal
            results[name] = (None, None, f"{type(e).__name__}: {str(e)[:90]}")
        cold_gbps, warm_gbps, err = results[name]
        print(f"  {name}: cold {cold_gbps or 0:.2f} GB/s, warm {warm_gbps or 0:.2f} GB/s {err}", flush=True)

    if args.sweep_only:
        sweep(files, size)
        return 0
    raw_warm = []
    for _ in range(2):
        warm_up(files)
        s = time.perf_counter(); raw_read(files); raw_warm.append(time.perf_counter() - s)
    raw_cold = None
    if can_drop:
        drop_caches(); s = time.perf_counter(); raw_read(files); raw_cold = time.perf_counter() - s
    h2d = pinned_h2d_gbps()

    # Peak pinned memory and time to the first tensor (warm).
    warm_up(files)
    dlbridge.reset_peak_memory("cuda_host:0")
    load_dlbridge(files)
    peak_pinned = dlbridge.memory_stats("cuda_host:0")["peak_active_bytes"]
    first = sorted(dlbridge._dlbridge._Checkpoint(files).keys())[0]
    s = time.perf_counter(); load_dlbridge(files, keys=[first]); first_s = time.perf_counter() - s

    ours_cold, ours_warm, _ = results[loaders[0][0]]
    print()
    print(f"{'loader':<72} {'cold GB/s':>10} {'warm GB/s':>10} {'dlbridge/peer cold':>19} {'warm':>7}")
    for name, (cold, warm, err) in results.items():
        if err:
            print(f"{name:<72} {'-':>10} {'-':>10}   not run: {err}")
            continue
        rc = f"{ours_cold / cold:.2f}" if cold and ours_cold else "-"
        rw = f"{ours_warm / warm:.2f}" if warm and ours_warm else "-"
        print(f"{name:<72} {cold or 0:>10.2f} {warm:>10.2f} {rc:>19} {rw:>7}")
    print(f"{'raw sequential read of the files (1 thread)':<72} "
          f"{(size / raw_cold / 1e9) if raw_cold else 0:>10.2f} {size / min(raw_warm) / 1e9:>10.2f}")
    print(f"{'pinned host->device (1 GiB, torch)':<72} {'':>10} {h2d:>10.2f}")
    if ours_warm:
        print(f"dlbridge warm / pinned H2D: {ours_warm / h2d:.2f}")
    if ours_cold and raw_cold:
        print(f"dlbridge cold / raw read: {ours_cold / (size / raw_cold / 1e9):.2f}")
    print(f"dlbridge peak pinned staging memory: {peak_pinned / 2**20:.0f} MiB; "
          f"time to the first tensor ({first}, warm): {first_s * 1e3:.1f} ms")

    if args.sweep:
        sweep(files, size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
