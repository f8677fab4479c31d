"""Per-call cost of passing a small array into a Rust (or C++) function that returns a scalar.

    dlbridge_pyo3_ext.torch_floor(x)
                                 PyTorch's own share of any correct consumer's call, no dlbridge
                                 code: its exchange table's describe call, requires_grad, is_neg()
    dlbridge_pyo3_ext.first(x)   examples/pyo3-ext: ArrayArg + .expect().ndim(1).c_contiguous()
                                 .read::<f32>() + as_slice, for NumPy, PyTorch, JAX and MLX inputs
    pyo3_bench_numpy.first(x)    examples/pyo3-bench-numpy: rust-numpy's PyReadonlyArray1<f32>
    nanobind first(x)            nb::ndarray<const float, nb::ndim<1>, nb::c_contig,
                                 nb::device::cpu>, built here with g++ when nanobind is importable
                                 (skipped with the reason otherwise)

Targets: NumPy input no slower than rust-numpy; PyTorch input within 1.5x of NumPy input.
Run: python bench/bench_pyo3.py  (with the two example wheels installed).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import timeit

import numpy as np

NANOBIND_SRC = r"""
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
namespace nb = nanobind;
using Vec = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
NB_MODULE(nb_first, m) {
    m.def("first", [](Vec x) { return x.shape(0) ? x.data()[0] : 0.0f; });
}
"""


def build_nanobind():
    """(module, None) or (None, reason)."""
    try:
        import nanobind
    except ImportError:
        return None, "nanobind is not importable (pip install --target DIR nanobind; PYTHONPATH=DIR)"
    root = os.path.dirname(nanobind.__file__)
    out = os.path.join(tempfile.gettempdir(), "dlbridge-bench-nanobind")
    os.makedirs(out, exist_ok=True)
    so = os.path.join(out, "nb_first" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not os.path.exists(so):
        src = os.path.join(out, "nb_first.cpp")
        with open(src, "w") as f:
            f.write(NANOBIND_SRC)
        cmd = [
            os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
            "-I", os.path.join(root, "include"), "-I", os.path.join(root, "ext", "robin_map", "include"),
            "-I", sysconfig.get_paths()["include"], os.path.join(root, "src", "nb_combined.cpp"), src,
            "-o", so,
        ]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=240)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building the nanobind extension failed or took too long: {e}"
    sys.path.insert(0, out)
    return importlib.import_module("nb_first"), None


def per_call_ns(fn, x, number=200_000, repeat=7):
    fn(x)
    best = min(timeit.repeat(lambda: fn(x), number=number, repeat=repeat))
    return best / number * 1e9


def main():
    import dlbridge_pyo3_ext as ext

    rows = []
    x_np = np.arange(16, dtype=np.float32)
    rows.append(("PyO3 floor: fn(&Bound<PyAny>) -> f32, no array", per_call_ns(ext.noop, x_np)))
    numpy_ns = per_call_ns(ext.first, x_np)
    rows.append(("dlbridge-pyo3 ArrayArg, NumPy input", numpy_ns))
    try:
        import pyo3_bench_numpy

        rows.append(("rust-numpy PyReadonlyArray1<f32>, NumPy input", per_call_ns(pyo3_bench_numpy.first, x_np)))
    except ImportError as e:
        print(f"rust-numpy: skipped ({e})")
    nb, reason = build_nanobind()
    if nb is not None:
        rows.append(("nanobind nb::ndarray, NumPy input", per_call_ns(nb.first, x_np)))
    else:
        print(f"nanobind: skipped ({reason})")
    import torch

    x_t = torch.arange(16, dtype=torch.float32)
    torch_ns = per_call_ns(ext.first, x_t)
    rows.append(("dlbridge-pyo3 ArrayArg, PyTorch input", torch_ns))
    torch_floor_ns = per_call_ns(ext.torch_floor, x_t)
    rows.append(("PyTorch's own share (table describe + 2 states)", torch_floor_ns))
    if nb is not None:
        rows.append(("nanobind nb::ndarray, PyTorch input", per_call_ns(nb.first, x_t)))
    try:
        import jax.numpy as jnp

        import jax

        # On the host: the row times a host argument (on a GPU machine JAX's default is the GPU).
        x_j = jax.device_put(jnp.arange(16, dtype=jnp.float32), jax.devices("cpu")[0])
        rows.append(("dlbridge-pyo3 ArrayArg, JAX input", per_call_ns(ext.first, x_j, number=20_000)))
        if nb is not None:
            rows.append(("nanobind nb::ndarray, JAX input", per_call_ns(nb.first, x_j, number=20_000)))
    except ImportError as e:
        print(f"JAX: skipped ({e})")
    try:
        import mlx.core as mx

        x_m = mx.arange(16, dtype=mx.float32)
        rows.append(("dlbridge-pyo3 ArrayArg, MLX input", per_call_ns(ext.first, x_m, number=50_000)))
    except ImportError as e:
        print(f"MLX: skipped ({e})")
    baseline = dict(rows).get("rust-numpy PyReadonlyArray1<f32>, NumPy input", numpy_ns)
    print(f"{'call (16 float32, returns a scalar)':<50} {'ns/call':>9} {'/ rust-numpy':>13} {'/ dlbridge NumPy':>17}")
    floor = rows[0][1]
    print(f"{'':<50} {'':>9} {'':>13} {'':>17} {'above floor':>12}")
    for name, ns in rows:
        print(f"{name:<50} {ns:>9.0f} {ns / baseline:>12.2f}x {ns / numpy_ns:>16.2f}x {ns - floor:>9.0f} ns")
    print(f"targets: NumPy input <= rust-numpy: {'met' if numpy_ns <= baseline * 1.0 else 'NOT met'}; "
          f"PyTorch input <= 1.5x NumPy input: {'met' if torch_ns <= 1.5 * numpy_ns else 'NOT met'} "
          f"(PyTorch's own share alone is {torch_floor_ns / numpy_ns:.2f}x the NumPy input call)")


if __name__ == "__main__":
    main()
