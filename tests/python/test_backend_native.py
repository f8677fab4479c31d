"""``dlbridge.Backend`` over the native ``dlbridge::compute::Backend``; the one table of dtype
names; ``asarray(x, dtype=)`` converting with ``astype``'s on-device cast.

CUDA and Metal cases skip with the reason where the device is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge
from dlbridge import _dlbridge


def test_backend_subclasses_the_native_backend(device):
    be = dlbridge.Backend(device)
    assert isinstance(be, _dlbridge._Backend)
    assert str(be.device) == device and be.device_id == int(device.partition(":")[2] or 0)
    assert repr(be) == f"dlbridge.Backend({device!r})"
    assert be.is_available and be.device_count >= 1
    a = be.copy_to_device([1.5, 2.5])
    assert str(a.device) == device
    back = be.copy_to_host(a)
    assert isinstance(back, np.ndarray) and back.tolist() == [1.5, 2.5]
    assert be.allocate_zeros(3, None).tolist() == [0.0] * 3  # None: the float32 default
    info = be.get_memory_info()
    assert info["active_bytes"] >= a.nbytes
    assert ("free_bytes" in info) == device.startswith("cuda")
    be.clear_cache()
    be.synchronize()


def test_missing_devices_raise_backend_unavailable():
    with pytest.raises(dlbridge.BackendUnavailableError, match="cuda:99|CUDA"):
        dlbridge.Backend("cuda:99")
    with pytest.raises(dlbridge.BackendUnavailableError, match="Metal"):
        dlbridge.Backend("metal:99")
    with pytest.raises(TypeError):
        dlbridge.Backend(3.5)


def test_launch_dimensions_are_checked_for_every_kernel():
    be = dlbridge.Backend("cpu")
    fn = lambda: None  # noqa: E731
    with pytest.raises(ValueError, match=r"grid \(0,\) must be positive in every dimension"):
        be.execute_kernel(fn, 0, 1)
    with pytest.raises(ValueError, match=r"block \(4, -1\) must be positive"):
        be.execute_kernel(fn, 1, (4, -1))
    with pytest.raises(ValueError, match="32 bits"):
        be.execute_kernel(fn, 1 << 32, 1)
    for bad in ((1, 2, 3, 4), (), (1.0,), "ab"):
        with pytest.raises(TypeError, match="grid must be an int or a tuple of 1 to 3 ints"):
            be.execute_kernel(fn, bad, 1)
    with pytest.raises(TypeError):
        be.execute_kernel(fn, 1.5, 1)
    with pytest.raises(TypeError, match="a compiled Kernel or a Python callable, not int"):
        be.execute_kernel(7, 1, 1)
    assert be.execute_kernel(fn, (1, True), 1).success


def test_source_kernels_are_refused_on_the_cpu():
    be = dlbridge.Backend("cpu")
    with pytest.raises(TypeError, match="source code compiles on CUDA and Metal"):
        be.compile_kernel("__global__ void f() {}")
    with pytest.raises(TypeError, match="source text or a Python callable, not int"):
        be.compile_kernel(3)


def test_entry_points_are_found_in_the_source(device):
    if device == "cpu":
        pytest.skip("source kernels compile on CUDA and Metal only")
    be = dlbridge.Backend(device)
    with pytest.raises(ValueError, match=r"defines 0 kernels \(none\)"):
        be.compile_kernel("int x;")
    two = "__global__ void f(float* x) {}\n__global__ __launch_bounds__(64) void g(float* x) {}"
    with pytest.raises(ValueError, match=r"defines 2 kernels \(f, g\)"):
        be.compile_kernel(two)


def test_dtype_attributes_come_from_the_one_table():
    # The extension's __all__ is its one list of element types (bool aside), re-exported whole.
    names = list(_dlbridge.__all__)
    assert len(names) == len(set(names)) and "float32" in names and "bool" not in names
    for name in names + ["bool"]:
        dtype = getattr(dlbridge, name)
        assert isinstance(dtype, dlbridge.DType) and dtype.name == name
    assert [n for n in dlbridge.__all__ if isinstance(getattr(dlbridge, n), dlbridge.DType)] == names


@pytest.mark.parametrize(
    "src, dst",
    [("float32", "int32"), ("int64", "float16"), ("float64", "bool"), ("uint8", "float32"),
     ("complex64", "float32"), ("float32", "bfloat16")],
)
def test_asarray_dtype_converts_like_astype(device, src, dst):
    if device.startswith("metal") and "float64" in (src, dst):
        pytest.skip("Metal GPUs have no float64")
    x = dlbridge.asarray(np.array([-2.7, 0.0, 1.5, 3.2, 200.9]).astype(src), device=device)
    got = dlbridge.asarray(x, dtype=dst)
    want = x.astype(dst)
    assert str(got.dtype) == dst and str(got.device) == device
    assert got.data_ptr != x.data_ptr
    assert got.to("cpu").astype("float64").tolist() == want.to("cpu").astype("float64").tolist()
    with pytest.raises(BufferError, match=f"converting {src} to {dst} needs a copy"):
        dlbridge.asarray(x, dtype=dst, copy=False)
