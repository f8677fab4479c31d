"""Streaming a model's load under its first forward pass: dlbridge.stream_file against load-then-run.

    python bench/bench_stream.py [--device cuda:0] [--layers 32] [--hidden 2048] [--dir DIR]
                                 [--runs 3] [--no-cold] [--iters N]

Writes (once) a synthetic model of `--layers` layers, each two matrices (`hidden x 4 hidden` and
`4 hidden x hidden`, bf16 on a GPU, float32 on the CPU), with `dlbridge.save_file` in layer order.
Its forward pass runs each layer as a loop of `--iters` matmul pairs on one activation; by
default `--iters` is chosen so that a layer's compute lasts about as long as its load (measured:
the warm load's time per layer against one matmul pair's).

Three timings, each from the first byte read until the forward pass has ended (device synced):
- T_load: `dlbridge.load_file(path, device)` alone;
- T_forward: the forward pass with every weight already on the device;
- T_total: `dlbridge.stream_file(path, device, order=layer order)`: each layer's group handed out
  as soon as it is loaded, PyTorch's stream waiting for the group's ready event (not the host)
  before computing it while the next groups load.
Overlap efficiency = (T_load + T_forward - T_total) / min(T_load, T_forward): 1 when the shorter
of the two hides entirely under the longer, 0 when streaming gains nothing. Load-then-run
(T_load + T_forward, measured as one) is printed beside it. Warm (the file read once before) and
cold (page cache dropped first; needs root); medians of `--runs`.

On the CPU (`--device cpu`, where tensors are views of the mapped file and ready events are None)
the stream copies (`copy=True`) so that a load costs something; `--layers 4 --hidden 128 --runs 1`
is a quick check that runs anywhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import dlbridge
from bench_load import drop_caches  # the page cache dropped (root only)


def names(layers: int) -> list[str]:
    return [f"model.layers.{i}.{w}" for i in range(layers) for w in ("up", "down")]


def generate(path: str, layers: int, hidden: int, dtype: torch.dtype) -> None:
    stamp = f"{path}.{layers}-{hidden}-{dtype}".replace("torch.", "")
    if os.path.exists(stamp):
        return
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name in names(layers):
        shape = (hidden, 4 * hidden) if name.endswith("up") else (4 * hidden, hidden)
        tensors[name] = (torch.randn(shape, generator=gen) / hidden**0.5).to(dtype)
    dlbridge.save_file(tensors, path)
    open(stamp, "w").close()


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def layer(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, iters: int) -> torch.Tensor:
    for _ in range(iters):
        x = torch.relu(x @ up) @ down
        x = x / (x.abs().amax() + 1)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".stream-bench"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=0, help="matmul pairs per layer (0: calibrated)")
    parser.add_argument("--no-cold", action="store_true")
    args = parser.parse_args()

    device = args.device
    on_gpu = device != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "model.safetensors")
    generate(path, args.layers, args.hidden, dtype)
    order = names(args.layers)
    nbytes = os.path.getsize(path)
    copy = not on_gpu  # CPU loads are views otherwise: nothing to overlap
    if on_gpu:
        # The forward pass computes on a stream of its own, as a consumer that overlaps a load
        # does: a load's reads start after the work queued on the legacy default stream (PyTorch's
        # default), whose pool memory they may be writing.
        torch.cuda.set_stream(torch.cuda.Stream(device))
    x0 = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)

    def load_all() -> dict[str, torch.Tensor]:
        out = dlbridge.load_file(path, device, framework="pt", copy=copy or None, progress=False)
        sync(device)
        return out

    def forward(weights: dict[str, torch.Tensor], iters: int) -> torch.Tensor:
        x = x0
        for i in range(args.layers):
            x = layer(x, weights[f"model.layers.{i}.up"], weights[f"model.layers.{i}.down"], iters)
        sync(device)
        return x

    # Calibration (warm): a layer's load time against one matmul pair's.
    load_all()
    start = time.perf_counter()
    weights = load_all()
    per_layer_load = (time.perf_counter() - start) / args.layers
    forward(weights, 1)
    start = time.perf_counter()
    forward(weights, 1)
    per_pair = (time.perf_counter() - start) / args.layers
    iters = args.iters or max(1, round(per_layer_load / per_pair))
    del weights

    def t_load() -> float:
        start = time.perf_counter()
        w = load_all()
        elapsed = time.perf_counter() - start
        del w
        return elapsed

    resident = load_all()

    def t_forward() -> float:
        start = time.perf_counter()
        forward(resident, iters)
        return time.perf_counter() - start

    def t_load_then_run() -> float:
        start = time.perf_counter()
        w = load_all()
        forward(w, iters)
        elapsed = time.perf_counter() - start
        del w
        return elapsed

    def t_stream() -> float:
        start = time.perf_counter()
        x = x0
        compute = torch.cuda.current_stream() if on_gpu else None
        stream = dlbridge.stream_file(path, device, order=order, framework="pt", copy=copy)
        for i, (group, ts, ready) in enumerate(stream):
            if ready is not None:
                ready.wait(compute)  # the GPU waits for the layer's bytes, not the host
            x = layer(x, ts[f"{group}.up"], ts[f"{group}.down"], iters)
        sync(device)
        return time.perf_counter() - start

    rows = []
    modes = [("warm", False)] + ([] if args.no_cold else [("cold", True)])
    dropped = True
    for mode, cold in modes:
        results: dict[str, list[float]] = {"load": [], "forward": [], "load then run": [], "stream": []}
        for _ in range(args.runs):
            for name, fn in (("load", t_load), ("forward", t_forward), ("load then run", t_load_then_run),
                             ("stream", t_stream)):
                if cold and name != "forward":
                    dropped = drop_caches() and dropped
                elif not cold:
                    with open(path, "rb") as f:  # warm: in the page cache
                        while f.read(64 << 20):
                            pass
                results[name].append(fn())
        med = {k: statistics.median(v) for k, v in results.items()}
        overlap = (med["load"] + med["forward"] - med["stream"]) / min(med["load"], med["forward"])
        rows.append((mode, med, overlap, results))

    print(
        f"\n{args.layers} layers, {nbytes / 1e9:.2f} GB of {dtype} on {device}; {iters} matmul pairs of "
        f"[{args.batch}, {args.hidden}] per layer (a layer's warm load {per_layer_load * 1e3:.1f} ms, one pair "
        f"{per_pair * 1e3:.2f} ms); median of {args.runs}; {sys.platform}, {os.cpu_count()} CPUs"
    )
    if not args.no_cold and not dropped:
        print("cold rows: the page cache could NOT be dropped (not root): they are warm")
    print("\n| page cache | T_load (s) | T_forward (s) | load then run (s) | stream, T_total (s) | overlap efficiency |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, med, overlap, _ in rows:
        print(f"| {mode} | {med['load']:.3f} | {med['forward']:.3f} | {med['load then run']:.3f} | "
              f"{med['stream']:.3f} | {overlap:.2f} |")


if __name__ == "__main__":
    main()
