"""Loading safetensors files onto the CPU: `dlbridge.load_file` (read-only views of the mapped file)
beside `safetensors.numpy.load_file` and `safetensors.torch.load_file`, in one run, per tensor and
per file, for many small tensors and for a few large ones (page cache warm).

    python bench/bench_load_cpu.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import load_file as st_numpy_load
from safetensors.numpy import save_file as st_numpy_save

import dlbridge


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
        del out
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.mkdtemp(prefix="dlbridge-bench-cpu-"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = {
        "1000 small tensors (1 KiB)": {f"t{i}": rng.standard_normal(256).astype(np.float32) for i in range(1000)},
        "8 large tensors (32 MiB)": {f"w{i}": rng.standard_normal(8 << 20).astype(np.float32) for i in range(8)},
    }
    try:
        import torch  # noqa: F401
        from safetensors.torch import load_file as st_torch_load
    except ImportError:
        st_torch_load = None
    print(f"{'case':<28} {'loader':<34} {'ms/file':>9} {'µs/tensor':>10} {'dlbridge/peer':>14}")
    for case, tensors in cases.items():
        path = os.path.join(args.dir, f"{len(tensors)}.safetensors")
        st_numpy_save(tensors, path)
        n = len(tensors)
        ours = median_time(lambda: dlbridge.load_file(path, progress=False), 15)
        peers = [("safetensors.numpy.load_file", lambda: st_numpy_load(path))]
        if st_torch_load is not None:
            peers.append(("safetensors.torch.load_file", lambda: st_torch_load(path)))
        print(f"{case:<28} {'dlbridge.load_file (views)':<34} {ours * 1e3:>9.3f} {ours / n * 1e6:>10.2f} {'':>14}")
        for name, fn in peers:
            t = median_time(fn, 15)
            print(f"{case:<28} {name:<34} {t * 1e3:>9.3f} {t / n * 1e6:>10.2f} {ours / t:>14.2f}")
        loaded = dlbridge.load_file(path, progress=False)
        first = next(iter(tensors))
        view = np.from_dlpack(loaded[first])
        zero_copy = view.ctypes.data == loaded[first].data_ptr and loaded[first].is_foreign
        print(f"{'':<28} zero-copy into NumPy: {zero_copy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
