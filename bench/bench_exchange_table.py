"""The DLPack 1.3 C exchange table measured on its own: per-tensor cost of export and of export +
import through a type's `__dlpack_c_exchange_api__`, with no Python call in between (a C loop,
bench/native/exchange_table.c, compiled here with the system's C compiler), for dlbridge's table
beside PyTorch's in the same run, CPU and (where present) CUDA tensors.

    python bench/bench_exchange_table.py
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile

import dlbridge

HERE = os.path.dirname(os.path.abspath(__file__))


def build() -> ctypes.PyDLL:
    out = os.path.join(tempfile.mkdtemp(), "exchange_table.so")
    cc = os.environ.get("CC", "cc")
    include = sysconfig.get_paths()["include"]
    subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{include}",
                    os.path.join(HERE, "native", "exchange_table.c"), "-o", out], check=True)
    lib = ctypes.PyDLL(out)
    lib.bench.restype = ctypes.c_double
    lib.bench.argtypes = [ctypes.py_object, ctypes.py_object, ctypes.c_long, ctypes.c_int]
    return lib


def per_tensor(lib: ctypes.PyDLL, obj, mode: int, n: int = 200_000, repeats: int = 7) -> float:
    capsule = type(obj).__dlpack_c_exchange_api__
    lib.bench(obj, capsule, 1000, mode)  # warm-up
    return statistics.median(lib.bench(obj, capsule, n, mode) for _ in range(repeats))


def main() -> int:
    import torch

    lib = build()
    rows = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dlbridge.cuda.is_available() else [])
    for device in devices:
        t = torch.arange(256, dtype=torch.float32, device=device).reshape(16, 16)
        a = dlbridge.from_dlpack(t)
        for mode, what in ((0, "export + deleter"), (1, "export + import (to_py_object)")):
            ours = per_tensor(lib, a, mode)
            theirs = per_tensor(lib, t, mode)
            rows.append((device, what, ours, theirs))
    print(f"{'device':<6} {'per tensor':<32} {'dlbridge ns':>12} {'torch ns':>10} {'ratio':>7}")
    for device, what, ours, theirs in rows:
        print(f"{device:<6} {what:<32} {ours:>12.1f} {theirs:>10.1f} {ours / theirs:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
