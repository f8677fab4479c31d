"""Loading a safetensors checkpoint onto a GPU: dlbridge beside the loaders people use, in one run.

    python bench/bench_load.py [--dir DIR] [--layers 16] [--shards 4] [--runs 3] [--no-cold]

Generates (once) a bf16 checkpoint shaped like a transformer (hidden 4096, MLP 11008, vocabulary
32000; 16 layers make about 6.7 GB) in shards, then times each loader from opening the files until
every tensor is on cuda:0 and the device is synchronized: cold (page cache dropped first, which needs
root: `echo 3 > /proc/sys/vm/drop_caches`) and warm (the files read once before). Beside them: the
machine's pinned host-to-device bandwidth and the raw sequential read speed of the files. Prints
GB/s and dlbridge's ratio to each. Peers that are not installed are reported as such.

Two more modes, each loader in its own fresh process (peers in the same run), printing a table
with ratios, peak device memory above the parameters, pinned staging bytes and time to the first
tensor:

    python bench/bench_load.py --mode into [--model 8b] [--device cuda:0]
    python bench/bench_load.py --mode tp --world 2 [--model 8b]

`--mode into`: a synthetic Llama model built on PyTorch's `meta` device, from open until every
parameter is filled on the device: `dlbridge.load_into(model, files, device=)` against
`safetensors.torch.load_file` + `load_state_dict(assign=True)`, InstantTensor + `copy_` and
fastsafetensors + `copy_` (skipped with a message where not installed). `--mode tp`: one process
per rank in a `torch.distributed` group (NCCL on GPUs, gloo on the CPU), q/k/v/gate/up/embedding/
lm_head split on dim 0, o/down on dim 1, the rest replicated; time until the last rank holds its
slices: dlbridge `load_file(shard=, rank=, world_size=, group=)` against every rank loading the
whole checkpoint (safetensors, dlbridge) then `narrow`, `safe_open(...).get_slice` on the CPU then
`.to`, fastsafetensors `get_sharded` and InstantTensor with a process group. `--model 8b` is
Llama-3-8B's shapes (hidden 4096, MLP 14336, vocabulary 128256, 8 KV heads, 32 layers: about 16
GB bf16); `--model tiny` a few MB (runs on the CPU: `--device cpu`, the default where there is no
GPU). `--mode tp` also times the host's ceiling in the same run (each rank `preadv`s its 1/P of
the files' bytes into pinned memory on its share of the CPUs, then all copy it to their GPUs at
once) and prints the issue's ratios (against the faster of InstantTensor and fastsafetensors,
safetensors + narrow, the ceiling) and the final agreement's milliseconds. Diagnostic rows run
dlbridge with the previous rule (dim-1 splits and replicated tensors read by an owner and handed
out), plainly and with every pair of ranks connected for point-to-point transfers before the
timer (NCCL connects a pair on its first such transfer; the barrier before the timer connects
only the collectives). `--cold`: the page cache dropped before each load (root) instead of
warmed. Every row, the ceiling's included, starts its timer after the same barrier.

    python bench/bench_load.py --mode stream [--device cuda:0] [--layers 32] [--hidden 2048]

`--mode stream`: bench/bench_stream.py's model, forward pass and overlap efficiency (imported from
it) for the loader's streaming modes: whole tensors (`stream_file`) and into a model's parameters
(`stream_file(targets=)` against `load_into` then the forward pass).
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


def generate(directory: str, layers: int, shards: int, kv: int | None = None) -> list[str]:
    """The checkpoint's shards, written once: safetensors files whose bf16 values are random bytes
    (a 64 MiB block repeated; finite, as the high byte's exponent bits are never all set). The
    header is written here, the format's way (an 8-byte little-endian length, JSON padded with
    spaces to 8 bytes); `safetensors` itself reads these files in the benchmark."""
    import numpy as np

    os.makedirs(directory, exist_ok=True)
    kv = HIDDEN if kv is None else kv
    shape_tag = "" if (HIDDEN, MLP, VOCAB, kv) == (4096, 11008, 32000, 4096) else \
        f"-{HIDDEN}-{MLP}-{VOCAB}-{kv}"
    stamp = os.path.join(directory, f"stamp-{layers}-{shards}{shape_tag}.json")
    if os.path.exists(stamp):
        return json.load(open(stamp))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            rows = kv if name in ("k_proj", "v_proj") else HIDDEN
            shapes[p + f"self_attn.{name}.weight"] = (rows, HIDDEN)
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
        path = os.path.join(directory, f"model{shape_tag}-{layers}-{s + 1:05d}-of-{shards:05d}.safetensors"
                            if shape_tag else f"model-{s + 1:05d}-of-{shards:05d}.safetensors")
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
    ap.add_argument("--mode", choices=["load", "into", "tp", "stream"], default="load",
                    help="load (the default: one GPU), into (a meta model filled), tp (ranks), "
                    "stream (a forward pass under a streaming load)")
    ap.add_argument("--hidden", type=int, default=2048, help="--mode stream: the model's width")
    ap.add_argument("--iters", type=int, default=0,
                    help="--mode stream: matmul pairs per layer (0: as long as a layer's load)")
    ap.add_argument("--model", choices=list(MODELS), default=None,
                    help="the checkpoint's shapes (default: 7b for load, 8b for into and tp)")
    ap.add_argument("--world", type=int, default=2, help="ranks of --mode tp")
    ap.add_argument("--cold", action="store_true",
                    help="--mode tp: drop the page cache before each load (root) instead of warming it")
    ap.add_argument("--device", default=None, help="cuda:0 (default where there is a GPU) or cpu")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode == "stream":
        return stream_main(args)
    if args.mode != "load" or args.child:
        return modes_main(args)
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


# --- --mode into and --mode tp: each loader in a fresh process --------------------------------------

MODELS = {
    # hidden, MLP, vocabulary, KV rows, layers, shards
    "7b": (4096, 11008, 32000, 4096, 16, 4),
    "8b": (4096, 14336, 128256, 1024, 32, 4),
    "30gb": (4096, 14336, 128256, 1024, 64, 8),  # the 8b's shapes with 64 layers: 30.0 GB
    "tiny": (64, 160, 256, 16, 2, 2),
}

TP_PLAN = {
    "*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.v_proj.weight": 0,
    "*.gate_proj.weight": 0, "*.up_proj.weight": 0,
    "model.embed_tokens.weight": 0, "lm_head.weight": 0,
    "*.o_proj.weight": 1, "*.down_proj.weight": 1,
}


def model_files(args) -> list[str]:
    global HIDDEN, MLP, VOCAB
    name = args.model or ("7b" if args.mode == "load" else "8b")
    HIDDEN, MLP, VOCAB, kv, layers, shards = MODELS[name]
    if args.model is None and args.mode == "load":
        layers, shards = args.layers, args.shards
    return generate(args.dir, layers, shards, kv)


def meta_model(files: list[str]):
    """A module on PyTorch's `meta` device with one parameter per tensor of the checkpoint, under
    its name (a Llama's layout: nested modules, Parameters that require grad)."""
    ckpt = dlbridge._dlbridge._Checkpoint(files)
    with torch.device("meta"):
        root = torch.nn.Module()
        for name in ckpt.keys():
            _, shape, _, _ = ckpt.info(name)
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16)))
    return root


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def into_dlbridge(model, files, device, first):
    return dlbridge.load_into(model, files, device=device, progress=first)


def into_safetensors(model, files, device, first):
    from safetensors.torch import load_file
    for f in files:
        sd = load_file(f, device=device)
        first(1, 1)
        model.load_state_dict(sd, assign=True, strict=False)
        del sd


def _materialised(model, device):
    return model.to_empty(device=device)


def into_instanttensor(model, files, device, first):
    from instanttensor import BackendPolicy, safe_open
    model = _materialised(model, device)
    params = dict(model.named_parameters())
    index = int(device.split(":")[1]) if ":" in device else 0
    with safe_open(files, framework="pt", device=index, backend=BackendPolicy.BUFFERED) as f:
        for name, t in f.tensors():
            first(1, 1)
            with torch.no_grad():
                params[name].copy_(t)


def into_fastsafetensors(model, files, device, first):
    from fastsafetensors import fastsafe_open
    model = _materialised(model, device)
    params = dict(model.named_parameters())
    with fastsafe_open(filenames=files, device=device, nogds=True) as f:
        for name in f.keys():
            first(1, 1)
            with torch.no_grad():
                params[name].copy_(f.get_tensor(name))


INTO = {
    "dlbridge.load_into(meta model, device=)": into_dlbridge,
    "safetensors load_file + load_state_dict(assign=True)": into_safetensors,
    "InstantTensor (BUFFERED) + copy_": into_instanttensor,
    "fastsafetensors + copy_": into_fastsafetensors,
}


def _pinned_peak(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    try:
        return dlbridge.memory_stats("cuda_host:0")["peak_active_bytes"]
    except Exception:
        return None


def child_into(loader: str, files: list[str], device: str) -> dict:
    fn = INTO[loader]
    warm_up(files)
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)
        dlbridge.empty(1, device=device)
        torch.cuda.reset_peak_memory_stats(device)
        dlbridge.reset_peak_memory(device)
    dlbridge.reset_peak_memory("cpu")
    model = meta_model(files)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    base = torch.cuda.memory_allocated(device) if device.startswith("cuda") else 0
    first_at: list[float] = []
    start = time.perf_counter()

    def first(done, total):
        # The first bytes in place (dlbridge's progress), or a peer's first tensor.
        if done > 0 and not first_at:
            first_at.append(time.perf_counter() - start)

    fn(model, files, device, first)
    _sync(device)
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "bytes": params, "first": first_at[0] if first_at else None}
    if device.startswith("cuda"):
        torch_peak = torch.cuda.max_memory_allocated(device) - base
        ours = dlbridge.memory_stats(device)["peak_active_bytes"]
        out["extra"] = max(torch_peak - params, 0) + ours
        out["pinned"] = _pinned_peak(device)
    return out


def _tp_files_per_rank(files, rank, world):
    return files[rank::world]


def tp_dlbridge(files, device, rank, world, group):
    from dlbridge import _load
    out, _, read = _load.load_sharded(files, device, TP_PLAN, rank, world, group, None, None,
                                      None, None)
    return out[0], read


def tp_dlbridge_owners(files, device, rank, world, group):
    """The rule before ranks read their own dim-1 parts: inner-dimension splits and replicated
    tensors read whole by one owner and handed out by one batched exchange per step."""
    from dlbridge import _load
    saved = _load._MIN_RUN, _load._REPLICATED_READ
    _load._MIN_RUN, _load._REPLICATED_READ = 1 << 62, -1
    try:
        return tp_dlbridge(files, device, rank, world, group)
    finally:
        _load._MIN_RUN, _load._REPLICATED_READ = saved


def _rank_ranges(files, rank, world):
    """Rank `rank`'s 1/P of the files' bytes, one after another: (file, offset, length) runs."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    a, b = total * rank // world, total * (rank + 1) // world
    out, at = [], 0
    for f, n in zip(files, sizes):
        lo, hi = max(a, at), min(b, at + n)
        if lo < hi:
            out.append((f, lo - at, hi - lo))
        at += n
    return out


_CEILING: dict = {}


def tp_ceiling_setup(files, device, rank, world):
    """The ceiling row's memory, before the timer: the rank's 1/P in pinned host memory (and as
    much on its GPU, for the host-to-device copy timed after)."""
    n = sum(length for _, _, length in _rank_ranges(files, rank, world))
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    pinned[::4096] = 0  # touched, as a loader's staging is
    _CEILING.update(pinned=pinned, dev=torch.empty(n, dtype=torch.uint8, device=device))


def tp_ceiling(files, device, rank, world, group):
    """The host's ceiling: each rank reads its 1/P of the files with `os.preadv` on its share of
    the CPUs (16 MiB per read) into pinned memory."""
    from concurrent.futures import ThreadPoolExecutor
    view = memoryview(_CEILING["pinned"].numpy())
    jobs, at = [], 0
    fds = {}
    for f, offset, length in _rank_ranges(files, rank, world):
        fds[f] = os.open(f, os.O_RDONLY)
        for k in range(0, length, 16 << 20):
            n = min(16 << 20, length - k)
            jobs.append((fds[f], offset + k, at + k, n))
        at += length

    def read(job):
        fd, offset, dst, n = job
        done = 0
        while done < n:
            got = os.preadv(fd, [view[dst + done:dst + n]], offset + done)
            if got <= 0:
                raise OSError(f"short read at {offset + done}")
            done += got

    threads = max(1, (os.cpu_count() or 1) // world)
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"bytes": _CEILING["pinned"]}, at


def tp_ceiling_h2d(device) -> float:
    """After the timer, every rank at once: its pinned 1/P copied to its GPU (seconds)."""
    import torch.distributed as dist
    if not device.startswith("cuda"):
        return 0.0
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    _CEILING["dev"].copy_(_CEILING["pinned"], non_blocking=True)
    _sync(device)
    return time.perf_counter() - start


def _narrowed(sd, rank, world):
    from dlbridge.shard import resolve
    out = {}
    for name, t in sd.items():
        split = resolve(TP_PLAN, name, tuple(t.shape), world)
        if split is None:
            out[name] = t
        else:
            a, b = split.ranges[rank]
            out[name] = t.narrow(split.dim, a, b - a).contiguous()
    return out


def tp_safetensors(files, device, rank, world, group):
    from safetensors.torch import load_file
    out = {}
    for f in files:
        out.update(_narrowed(load_file(f, device=device), rank, world))
    return out, sum(os.path.getsize(f) for f in files)


def tp_dlbridge_whole(files, device, rank, world, group):
    sd = dlbridge.load_file(files, device, framework="pt", progress=False)
    return _narrowed(sd, rank, world), sum(os.path.getsize(f) for f in files)


def tp_get_slice(files, device, rank, world, group):
    from safetensors import safe_open
    from dlbridge.shard import resolve
    out, read = {}, 0
    for f in files:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                s = h.get_slice(name)
                shape = tuple(s.get_shape())
                split = resolve(TP_PLAN, name, shape, world)
                if split is None:
                    t = s[:]
                else:
                    a, b = split.ranges[rank]
                    t = s[(slice(None),) * split.dim + (slice(a, b),)]
                read += t.numel() * t.element_size()
                out[name] = t.to(device)
    return out, read


def tp_fastsafetensors(files, device, rank, world, group):
    import torch.distributed as dist
    from fastsafetensors import SafeTensorsFileLoader
    from dlbridge.shard import resolve
    loader = SafeTensorsFileLoader(dist.group.WORLD, torch.device(device), nogds=True)
    loader.add_filenames({r: files[r::world] for r in range(world)})
    fb = loader.copy_files_to_device()
    out = {}
    for name in fb.key_to_rank_lidx.keys():
        split = resolve(TP_PLAN, name, (1 << 62,) * 2, world)
        out[name] = (fb.get_sharded(name, dim=split.dim) if split is not None
                     else fb.get_tensor(name)).clone()
    fb.close()
    loader.close()
    return out, sum(os.path.getsize(f) for f in files[rank::world])


def tp_instanttensor(files, device, rank, world, group):
    import torch.distributed as dist
    from instanttensor import BackendPolicy, safe_open
    index = int(device.split(":")[1]) if ":" in device else 0
    out = {}
    with safe_open(files, framework="pt", device=index, backend=BackendPolicy.BUFFERED,
                   process_group=dist.group.WORLD) as f:
        out = _narrowed({k: v for k, v in f.tensors()}, rank, world)
        out = {k: v.clone() for k, v in out.items()}
    return out, None


TP_OURS = "dlbridge load_file(shard=, rank=, group=)"
TP_CEILING = "host ceiling: pread 1/P into pinned, per rank (+ H2D)"
TP = {
    TP_OURS: tp_dlbridge,
    TP_CEILING: tp_ceiling,
    "dlbridge, owner reads + hand-outs (diagnostic)": tp_dlbridge_owners,
    "dlbridge, owner reads + hand-outs, p2p connected first (diag.)": tp_dlbridge_owners,
    "safetensors load_file(device=rank) + narrow, every rank": tp_safetensors,
    "dlbridge load_file everything + narrow, every rank": tp_dlbridge_whole,
    "safetensors safe_open get_slice on the CPU, then .to": tp_get_slice,
    "fastsafetensors get_sharded (process group)": tp_fastsafetensors,
    "InstantTensor (BUFFERED, process_group) + narrow + clone": tp_instanttensor,
}


def child_tp(loader: str, files: list[str], rank: int, world: int, gpu: bool,
             cold: bool = False) -> dict | None:
    import datetime
    import torch.distributed as dist
    from dlbridge import _load
    device = f"cuda:{rank}" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(rank)
        torch.empty(1, device=device)
        dlbridge.empty(1, device=device)
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300),
                            **({"device_id": torch.device(device)} if gpu else {}))
    # The group's first collective (NCCL connects its ring on it): what a load's final
    # agreement costs where the group has run no collective before.
    start = time.perf_counter()
    one = torch.zeros(1, device=device)
    dist.all_reduce(one)
    _sync(device)
    first_collective = time.perf_counter() - start
    if loader == TP_CEILING:
        tp_ceiling_setup(files, device, rank, world)
    if rank == 0:
        drop_caches() if cold else warm_up(files)
    if "connected first" in loader and world > 1:
        # NCCL connects a pair for point-to-point on its first transfer (the barrier's
        # all-reduce does not): one byte each way, so that the row shows what the connection
        # costs the load.
        byte = torch.zeros(world, dtype=torch.uint8, device=device)
        ops = [dist.P2POp(op, byte[p:p + 1], p) for p in range(world) if p != rank
               for op in (dist.isend, dist.irecv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        _sync(device)
    dist.barrier()
    if gpu:
        dlbridge.reset_peak_memory("cuda_host:0")
    _load._last_agreement_seconds = None
    start = time.perf_counter()
    out, read = TP[loader](files, device, rank, world, dist.group.WORLD)
    _sync(device)
    seconds = time.perf_counter() - start
    dist.barrier()
    # The dlbridge rows: the final agreement's share of the load; the ceiling: its H2D copy.
    aux = (tp_ceiling_h2d(device) if loader == TP_CEILING else
           _load._last_agreement_seconds if _load._last_agreement_seconds is not None else -1.0)
    held = sum(t.numel() * t.element_size() for t in
               (torch.from_dlpack(v) if not isinstance(v, torch.Tensor) else v for v in out.values()))
    stats = torch.tensor([seconds, float(read if read is not None else -1), float(held), aux,
                          first_collective], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    pinned = _pinned_peak(device)
    dist.destroy_process_group()
    if rank:
        return None
    rows = [g.tolist() for g in gathered]
    return {"seconds": max(r[0] for r in rows), "read": [r[1] for r in rows],
            "held": [r[2] for r in rows], "pinned": pinned,
            "aux": max(r[3] for r in rows), "first_collective": max(r[4] for r in rows)}


def _run_child(argv: list[str], env: dict | None = None, timeout: float = 3600) -> dict:
    import subprocess
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True,
                          text=True, env=env, timeout=timeout)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (done.stderr or done.stdout).strip().splitlines()
    return {"error": tail[-1][:120] if tail else f"exit {done.returncode}"}


def _importable(loader: str) -> str | None:
    import importlib.util
    for word, module in (("InstantTensor", "instanttensor"), ("fastsafetensors", "fastsafetensors"),
                         ("safetensors", "safetensors")):
        if word in loader and importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def modes_main(args) -> int:
    files = model_files(args)
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if args.child:
        kind, loader = args.child[0], args.child[1]
        if kind == "into":
            result = child_into(loader, files, device)
        else:
            rank = int(os.environ["RANK"])
            result = child_tp(loader, files, rank, args.world, device.startswith("cuda"),
                              args.cold)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    size = total_bytes(files)
    print(f"checkpoint: {args.model or '8b'}-shaped, {len(files)} shards, {size / 1e9:.3f} GB bf16; "
          f"device {device}"
          + (f" ({torch.cuda.get_device_name(0)})" if device.startswith("cuda") else "")
          + f"; {os.cpu_count()} CPUs; warm page cache; each loader in a fresh process")
    base = ["--mode", args.mode, "--dir", args.dir, "--device", device, "--world", str(args.world)]
    if args.model:
        base += ["--model", args.model]
    if args.cold:
        base += ["--cold"]
        if args.mode != "tp" or not drop_caches():
            print("--cold: --mode tp only, as root (drop_caches)")
            return 1
    results: dict[str, dict] = {}
    table = INTO if args.mode == "into" else TP
    for loader in table:
        if args.only and not any(w in loader for w in args.only.split(",")):
            continue
        missing = _importable(loader)
        if missing:
            results[loader] = {"error": f"skipped: {missing}"}
            print(f"  {loader}: skipped ({missing})", flush=True)
            continue
        runs = []
        for _ in range(args.runs):
            if args.mode == "into":
                r = _run_child(base + ["--child", "into", loader])
            else:
                r = _run_tp(base + ["--child", "tp", loader], args.world)
            if "error" in r:
                runs = [r]
                break
            runs.append(r)
        r = runs[0] if "error" in runs[0] else min(runs, key=lambda x: x["seconds"])
        results[loader] = r
        shown = r.get("error") or "%.3f s" % r["seconds"]
        print(f"  {loader}: {shown}", flush=True)
    ours = results[next(iter(table))].get("seconds")
    print()
    if args.mode == "into":
        print(f"{'loader (into a meta model)':<56} {'s':>8} {'GB/s':>7} {'ours/peer':>9} "
              f"{'extra device MiB':>16} {'pinned MiB':>10} {'first ms':>9}")
    else:
        print(f"{'loader (TP=' + str(args.world) + ', until the last rank has its slices)':<56} "
              f"{'s':>8} {'GB/s':>7} {'ours/peer':>9} {'read/rank (of ckpt)':>20} {'pinned MiB':>10} "
              f"{'aux ms':>8}")
    for loader, r in results.items():
        if "error" in r:
            print(f"{loader:<56} {'-':>8}   {r['error']}")
            continue
        ratio = f"{r['seconds'] / ours:.2f}" if ours else "-"
        gbps = size / r["seconds"] / 1e9
        pinned = f"{r['pinned'] / 2**20:.0f}" if r.get("pinned") is not None else "-"
        if args.mode == "into":
            extra = f"{r['extra'] / 2**20:.0f}" if r.get("extra") is not None else "-"
            first = f"{r['first'] * 1e3:.1f}" if r.get("first") is not None else "-"
            print(f"{loader:<56} {r['seconds']:>8.3f} {gbps:>7.2f} {ratio:>9} {extra:>16} "
                  f"{pinned:>10} {first:>9}")
        else:
            reads = [x for x in r["read"] if x >= 0]
            share = "/".join(f"{x / size:.2f}" for x in reads) if reads else "-"
            aux = f"{r['aux'] * 1e3:.1f}" if r.get("aux", -1) >= 0 else "-"
            print(f"{loader:<56} {r['seconds']:>8.3f} {gbps:>7.2f} {ratio:>9} {share:>20} "
                  f"{pinned:>10} {aux:>8}")
    print("ours/peer: the peer's time over dlbridge's (above 1: dlbridge is faster)")
    if args.mode == "tp":
        tp_summary(results, size, args)
    return 0


def tp_summary(results: dict, size: int, args) -> None:
    """The issue's targets for --mode tp, from this run's rows."""
    def seconds(word):
        found = [r["seconds"] for k, r in results.items() if word in k and "seconds" in r]
        return min(found) if found else None
    ours = results.get(TP_OURS, {})
    if "seconds" not in ours:
        return
    t = ours["seconds"]
    print(f"\naux ms: dlbridge rows, the final agreement inside the load (an all_reduce, max over "
          f"ranks); the ceiling, its pinned H2D copy. The group's first collective (ring "
          f"connection, before the timer): {ours['first_collective'] * 1e3:.1f} ms")
    peers = [x for x in (seconds("InstantTensor"), seconds("fastsafetensors")) if x]
    if peers:
        print(f"target >= 1.5x the faster of InstantTensor/fastsafetensors: {min(peers) / t:.2f}x")
    narrow = seconds("safetensors load_file(device=rank) + narrow")
    if narrow:
        print(f"target >= 2x safetensors + narrow: {narrow / t:.2f}x")
    ceiling = results.get(TP_CEILING, {})
    if "seconds" in ceiling:
        h2d = max(ceiling.get("aux", 0.0), 0.0)
        limit = max(ceiling["seconds"], h2d)
        kind = "cold" if args.cold else "warm"
        print(f"host ceiling ({kind}): pread {size / ceiling['seconds'] / 1e9:.1f} GB/s, "
              f"P x pinned H2D {size / h2d / 1e9 if h2d else float('inf'):.1f} GB/s; dlbridge "
              f"{size / t / 1e9:.1f} GB/s = {limit / t:.2f} of the lower (target >= "
              f"{0.9 if args.cold else 0.8})")
    reads = [x for x in ours.get("read", []) if x >= 0]
    if reads:
        print(f"read per rank (of the checkpoint): {max(reads) / size:.3f} at most, 1/P = "
              f"{1 / args.world:.3f}")


def _run_tp(argv: list[str], world: int) -> dict:
    """One loader's ranks, each a fresh process; rank 0's report."""
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=3600))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    for out, err in outs:
        tail = (err or out).strip().splitlines()
        if tail:
            return {"error": tail[-1][:120]}
    return {"error": "no result"}


# --- --mode stream: a forward pass under a streaming load ------------------------------------------

def stream_main(args) -> int:
    """bench_stream.py's model, forward pass and overlap efficiency (imported from it), for the
    streaming modes of the loader: whole tensors (`stream_file`, as bench_stream.py runs it) and
    into a model on the `meta` device (`stream_file(targets=model)` against `load_into` then the
    forward pass). Each timing from the first byte read until the forward pass has ended; warm;
    medians of --runs."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_stream as bs

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    on_gpu = device != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    layers = args.layers if args.layers != 16 else 32
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "stream-model.safetensors")
    bs.generate(path, layers, args.hidden, dtype)
    order = bs.names(layers)
    shapes = {n: ((args.hidden, 4 * args.hidden) if n.endswith("up") else
                  (4 * args.hidden, args.hidden)) for n in order}
    if on_gpu:
        # As bench_stream.py: the forward pass on a stream of its own.
        torch.cuda.set_stream(torch.cuda.Stream(device))
    x0 = torch.randn(2048, args.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    x0 = x0.to(device)
    copy = not on_gpu  # CPU loads are views otherwise: nothing to overlap

    def forward(weights, iters):
        x = x0
        for i in range(layers):
            x = bs.layer(x, weights[f"model.layers.{i}.up"], weights[f"model.layers.{i}.down"],
                         iters)
        bs.sync(device)
        return x

    def load_whole():
        out = dlbridge.load_file(path, device, framework="pt", copy=copy or None, progress=False)
        bs.sync(device)
        return out

    def load_into_model():
        targets = {n: torch.empty(shapes[n], dtype=dtype, device=device) for n in order}
        dlbridge.load_into(targets, path)
        bs.sync(device)
        return targets

    def stream_whole(iters):
        compute = torch.cuda.current_stream() if on_gpu else None
        x = x0
        for group, ts, ready in dlbridge.stream_file(path, device, order=order, framework="pt",
                                                     copy=copy):
            if ready is not None:
                ready.wait(compute)
            x = bs.layer(x, ts[f"{group}.up"], ts[f"{group}.down"], iters)
        bs.sync(device)

    def stream_into(iters):
        targets = {n: torch.empty(shapes[n], dtype=dtype, device=device) for n in order}
        compute = torch.cuda.current_stream() if on_gpu else None
        x = x0
        for group, ts, ready in dlbridge.stream_file(path, device, order=order, targets=targets,
                                                     strict=True):
            if ready is not None:
                ready.wait(compute)
            x = bs.layer(x, ts[f"{group}.up"], ts[f"{group}.down"], iters)
        bs.sync(device)

    def timed(fn, *a):
        with open(path, "rb") as f:  # warm: in the page cache
            while f.read(64 << 20):
                pass
        start = time.perf_counter()
        out = fn(*a)
        elapsed = time.perf_counter() - start
        del out
        return elapsed

    # Calibration (warm), as bench_stream.py does it: a layer's compute about its load.
    resident = load_whole()
    per_layer = statistics.median(timed(load_whole) for _ in range(2)) / layers
    forward(resident, 1)
    per_pair = statistics.median(timed(forward, resident, 1) for _ in range(2)) / layers
    iters = args.iters or max(1, round(per_layer / per_pair))
    t_forward = statistics.median(timed(forward, resident, iters) for _ in range(args.runs))
    rows = []
    for name, load, stream in (("stream_file (whole tensors)", load_whole, stream_whole),
                               ("stream_file(targets=model) vs load_into", load_into_model,
                                stream_into)):
        t_load = statistics.median(timed(load) for _ in range(args.runs))
        t_total = statistics.median(timed(stream, iters) for _ in range(args.runs))
        overlap = (t_load + t_forward - t_total) / min(t_load, t_forward)
        rows.append((name, t_load, t_total, overlap))
    size = os.path.getsize(path)
    print(f"{layers} layers, {size / 1e9:.2f} GB of {dtype} on {device}; {iters} matmul pairs "
          f"per layer; warm; median of {args.runs}; overlap efficiency = (T_load + T_forward - "
          f"T_total) / min(T_load, T_forward), as bench/bench_stream.py computes it")
    print(f"| mode | T_load (s) | T_forward (s) | stream, T_total (s) | overlap efficiency |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, t_load, t_total, overlap in rows:
        print(f"| {name} | {t_load:.3f} | {t_forward:.3f} | {t_total:.3f} | {overlap:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
