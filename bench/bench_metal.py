"""Metal conversion benchmark: dlbridge's zero-copy DLPack exchange with PyTorch MPS and MLX,
beside the copy path each replaces, in one process and one run.

    python bench/bench_metal.py [--quick] [--json out.json]

Reproduces the table of the MLX Metal DLPack pull request (ml-explore/mlx#3531): float32 and
float16, 1024x1024 to 4096x4096. Each timed call starts after the producer has synchronized and
ends after the result is synchronized (``torch.mps.synchronize()``, ``mx.eval``,
``dlbridge.synchronize("metal")``), so a copy cannot hide behind asynchronous execution. Cases are
timed in interleaved rounds and the median of the rounds is reported; "GiB/s" is the tensor's
size over the time, which for a zero-copy conversion measures overhead, not bandwidth.

Skips (exit status 0, with the reason) off a Mac with MPS, or when dlbridge has no Metal backend.
"""

import argparse
import json
import platform
import statistics
import sys
import time


def skip(reason):
    print(f"skipped: {reason}")
    sys.exit(0)


if sys.platform != "darwin":
    skip("Metal exists only on macOS")
try:
    import torch
except ImportError:
    skip("PyTorch is not installed")
if not torch.backends.mps.is_available():
    skip("PyTorch reports no MPS device")

import numpy as np  # noqa: E402

import dlbridge  # noqa: E402

if "metal" not in dlbridge.build_info()["backends"]:
    skip("dlbridge was built without its Metal backend")

try:
    import mlx.core as mx
except ImportError:
    mx = None

SHAPES = [(1024, 1024), (2048, 2048), (4096, 4096)]
DTYPES = {"float32": (torch.float32, "float32"), "float16": (torch.float16, "float16")}


def sync_all():
    torch.mps.synchronize()
    dlbridge.synchronize("metal")


def mlx_shares_metal():
    if mx is None:
        return False
    m = mx.zeros((4,), dtype=mx.float32)
    mx.eval(m)
    return m.__dlpack_device__()[0] == 8


def mps_storage():
    """How dlbridge finds PyTorch's MPS tensors: "private" ones it must copy on the GPU."""
    t = torch.ones(4, device="mps")
    torch.mps.synchronize()
    try:
        return dlbridge.from_dlpack(t, copy=False).storage
    except BufferError:
        return "private"


def cases(shape, dtype_name):
    """``{conversion: (zero_copy_fn, copy_path_fn)}``; each fn returns what must be synchronized."""
    tdtype, ddtype = DTYPES[dtype_name]
    t = torch.ones(shape, dtype=tdtype, device="mps")
    a = dlbridge.full(shape, 1.0, dtype=ddtype, device="metal")
    sync_all()
    out = {
        "MPS → dlbridge": (
            lambda: dlbridge.from_dlpack(t),
            lambda: dlbridge.from_dlpack(t.cpu()).to("metal"),
        ),
        "dlbridge → MPS": (
            lambda: torch.from_dlpack(a),
            lambda: torch.from_dlpack(a.to("cpu")).to("mps"),
        ),
    }
    if mlx_shares_metal():
        mdtype = getattr(mx, dtype_name)
        m = mx.ones(shape, dtype=mdtype)
        mx.eval(m)
        out["MLX → dlbridge"] = (
            lambda: dlbridge.from_dlpack(m),
            lambda: dlbridge.asarray(np.array(m)).to("metal"),
        )
        out["dlbridge → MLX"] = (
            lambda: mx.from_dlpack(a),
            lambda: mx.array(np.from_dlpack(a.to("cpu"))),
        )
    return out


def finish(result):
    """Waits for whatever produced `result` (every framework: a result may be lazy)."""
    if mx is not None and type(result).__module__.startswith("mlx"):
        mx.eval(result)
    sync_all()


def timed(fn, number):
    total = 0.0
    for _ in range(number):
        sync_all()
        start = time.perf_counter()
        finish(fn())
        total += time.perf_counter() - start
    return total / number * 1e3  # ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    number, rounds, warmup = (5, 3, 2) if args.quick else (10, 5, 5)
    fns = {}
    sizes = {}
    for dtype_name in DTYPES:
        for shape in SHAPES:
            for conversion, (zero, copy) in cases(shape, dtype_name).items():
                key = (conversion, dtype_name, shape)
                fns[key + ("zero-copy",)] = zero
                fns[key + ("copy path",)] = copy
                sizes[key] = shape[0] * shape[1] * DTYPES[dtype_name][0].itemsize
    for fn in fns.values():
        for _ in range(warmup):
            finish(fn())
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(timed(fn, number))
    median = {k: statistics.median(v) for k, v in samples.items()}

    chip = platform.processor() or platform.machine()
    versions = f"PyTorch {torch.__version__}, dlbridge {dlbridge.__version__}"
    if mx is not None:
        import mlx

        versions += f", MLX {getattr(mlx, '__version__', '?')}"
    print(f"# dlbridge Metal conversions: {chip}, macOS {platform.mac_ver()[0]}, {versions}")
    print(f"median over {rounds} interleaved rounds of {number} synchronized calls\n")
    storage = mps_storage()
    print(f"PyTorch MPS tensors arrive in {storage} storage"
          + (": `MPS → dlbridge` is a GPU copy, not zero-copy\n" if storage == "private" else "\n"))
    if not mlx_shares_metal():
        print("(MLX rows left out: this MLX does not export kDLMetal arrays)\n")
    print("| conversion | dtype | shape | zero-copy (ms) | copy path (ms) | copy path (GiB/s) | "
          "speed-up |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    rows = {}
    for key, nbytes in sizes.items():
        conversion, dtype_name, shape = key
        zero, copy = median[key + ("zero-copy",)], median[key + ("copy path",)]
        gib_s = nbytes / (copy / 1e3) / 2**30
        print(f"| {conversion} | {dtype_name} | {shape[0]}x{shape[1]} | {zero:.4f} | {copy:.4f} | "
              f"{gib_s:.1f} | {copy / zero:.0f}x |")
        rows[f"{conversion} {dtype_name} {shape[0]}x{shape[1]}"] = {
            "zero_copy_ms": zero, "copy_path_ms": copy}
    zero_times = [median[k + ("zero-copy",)] for k in sizes]
    print(f"\nzero-copy spread across sizes: {min(zero_times):.4f}..{max(zero_times):.4f} ms "
          "(a conversion must not grow with the tensor)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
