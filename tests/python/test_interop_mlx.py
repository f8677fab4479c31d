"""MLX (CPU) <-> dlbridge, as MLX really behaves.

* MLX -> dlbridge is zero-copy: MLX exports legacy capsules over its own buffer, often with a
  nonzero ``byte_offset`` (slices) and negative strides; dlbridge shares that memory.
* dlbridge -> MLX copies: ``mx.array(x)`` and ``mx.from_dlpack(x)`` always copy CPU inputs, and
  ``copy=False`` raises MLX's ValueError.

MLX's pointer is read through ``np.from_dlpack(mlx_array)`` (zero-copy, offset included).
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (scripts/env.sh installs it)")

import dlbridge
from conftest import capsule_info, collect, ptr_of, random_values

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64"]


def mx_dtype(name):
    return mx.bool_ if name == "bool" else getattr(mx, name)


def mlx_values(rng, shape, name):
    host = random_values(rng, shape, "float32" if name == "bfloat16" else name)
    m = mx.array(host).astype(mx_dtype(name))
    mx.eval(m)
    return m


def mlx_ptr(m) -> int:
    """MLX's first-element address (bfloat16 is not NumPy-importable: view the bits)."""
    if m.dtype == mx.bfloat16:
        m = m.view(mx.uint16)
        mx.eval(m)
    return ptr_of(m)


def as_list(x):
    if isinstance(x, dlbridge.Array):
        return x.astype("float32").tolist() if x.dtype == "bfloat16" else x.tolist()
    if x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return x.tolist()


def mark_for(name):
    return {"bool": True, "complex64": 3 - 4j}.get(
        name, 12.0 if name.startswith(("float", "bfloat")) else 77)


@pytest.mark.parametrize("name", DTYPES)
def test_mlx_to_dlbridge_is_zero_copy(name, rng):
    m = mlx_values(rng, (4, 6), name)
    a = dlbridge.from_dlpack(m)
    assert a.dtype == name
    assert a.data_ptr == mlx_ptr(m)
    assert as_list(a) == as_list(m)
    # The memory is shared: a write through dlbridge is what MLX reads next.
    mark = mark_for(name)
    a[1, 2] = mark
    assert as_list(m)[1][2] == mark


@pytest.mark.parametrize("name", DTYPES)
def test_dlbridge_to_mlx_copies(name, rng):
    src = random_values(rng, (4, 6), "float32" if name == "bfloat16" else name)
    a = dlbridge.from_dlpack(src).astype(name)
    if name == "bfloat16":
        # mx.array() special-cases bfloat16 inputs by calling x.view(uint16), a PyTorch method.
        with pytest.raises(AttributeError):
            mx.array(a)
        made = (mx.from_dlpack(a), mx.from_dlpack(a, copy=True))
    else:
        made = (mx.from_dlpack(a), mx.array(a), mx.from_dlpack(a, copy=True))
    for m in made:
        mx.eval(m)
        assert as_list(m) == as_list(a)
        if name != "float64":  # MLX keeps float64 inputs as float32 here
            assert m.dtype == mx_dtype(name)
        assert mlx_ptr(m) != a.data_ptr
    # The copy is independent.
    m = mx.from_dlpack(a)
    mx.eval(m)
    before = as_list(m)
    a[0, 0] = mark_for(name)
    assert as_list(m) == before


def test_mlx_refuses_copy_false():
    a = dlbridge.arange(6, dtype="float32")
    with pytest.raises(ValueError, match="without a copy"):
        mx.from_dlpack(a, copy=False)


@pytest.mark.parametrize("view", ["slice", "strided", "negative", "row", "tail"])
def test_mlx_exports_with_byte_offset_are_imported_correctly(view):
    m = mx.arange(48, dtype=mx.float32).reshape(6, 8)
    mx.eval(m)
    v = {"slice": m[1:, 2:], "strided": m[::2, 1::3], "negative": m[::-1, ::-2], "row": m[4],
         "tail": mx.arange(6)[2:]}[view]
    mx.eval(v)
    info = capsule_info(v.__dlpack__())
    assert info["name"] == "dltensor"
    if view != "row":
        assert info["byte_offset"] > 0, "MLX keeps view offsets in byte_offset"
    a = dlbridge.from_dlpack(v)
    assert a.shape == tuple(v.shape)
    assert a.tolist() == v.tolist()
    assert a.data_ptr == info["data"] + info["byte_offset"]
    assert a.data_ptr == ptr_of(v)
    if view == "negative":
        assert any(s < 0 for s in a.strides)
    # Views of it, and re-exports to NumPy, address the same elements.
    assert np.from_dlpack(a).tolist() == v.tolist()
    assert ptr_of(np.from_dlpack(a)) == ptr_of(v)
    idx = (0,) * a.ndim
    a[idx] = -7
    assert np.asarray(v.tolist())[idx] == -7


def test_mlx_transposed_and_broadcast_exports():
    m = mx.arange(12, dtype=mx.int32).reshape(3, 4)
    t = m.T
    b = mx.broadcast_to(mx.arange(4, dtype=mx.int32), (3, 4))
    mx.eval(t, b)
    at = dlbridge.from_dlpack(t)
    assert at.strides == (1, 4) and at.tolist() == t.tolist()
    assert at.data_ptr == ptr_of(m)
    ab = dlbridge.from_dlpack(b)
    assert ab.strides == (0, 1) and ab.tolist() == b.tolist()


@pytest.mark.parametrize("view", ["slice", "strided", "transposed", "broadcast", "byte-offset"])
def test_dlbridge_views_into_mlx(view):
    a = dlbridge.arange(24, dtype="float32").reshape(4, 6)
    v = {"slice": a[1:, 2:], "strided": a[::2, 1::3], "transposed": a.T,
         "broadcast": dlbridge.arange(6, dtype="float32").broadcast_to((3, 6)),
         "byte-offset": a.reshape(-1)[5:]}[view]
    m = mx.from_dlpack(v)
    mx.eval(m)
    assert tuple(m.shape) == v.shape
    assert m.tolist() == v.tolist()
    assert ptr_of(m) != v.data_ptr


def test_negative_strides_into_mlx_raise_mlxs_error():
    a = dlbridge.arange(12, dtype="float32").reshape(3, 4)
    with pytest.raises(ValueError, match="negative strides"):
        mx.from_dlpack(a[:, ::-1])
    m = mx.from_dlpack(a[:, ::-1].copy())
    assert m.tolist() == a[:, ::-1].tolist()


def test_0d_and_zero_size():
    s = mx.array(5.5)
    mx.eval(s)
    a = dlbridge.from_dlpack(s)  # MLX exports 0-d with NULL strides
    assert a.shape == () and a.item() == 5.5
    assert a.data_ptr == ptr_of(s)
    z = mx.zeros((0, 3))
    mx.eval(z)
    az = dlbridge.from_dlpack(z)
    assert az.shape == (0, 3) and az.tolist() == []
    m0 = mx.from_dlpack(dlbridge.full((), 2.0))
    assert m0.shape == () and m0.item() == 2.0
    mz = mx.from_dlpack(dlbridge.zeros((3, 0)))
    assert tuple(mz.shape) == (3, 0)


@pytest.mark.parametrize("copy", [None, False, True])
def test_dlbridge_import_copy_keyword(copy):
    m = mx.arange(8, dtype=mx.float32)
    mx.eval(m)
    a = dlbridge.from_dlpack(m, copy=copy)
    assert a.tolist() == list(range(8))
    assert (a.data_ptr == ptr_of(m)) == (copy is not True)
    a[0] = 50.0
    assert (m.tolist()[0] == 50.0) == (copy is not True)


def test_mlx_imports_are_as_writable_as_mlx_hands_them_out():
    """MLX is not immutable by contract as JAX is: its own buffer protocol export is writable, and
    its documentation shows a write through a NumPy view reaching the array. An import keeps
    that (JAX arrays, in contrast, import read-only: test_interop_jax.py)."""
    m = mx.arange(3, dtype=mx.float32)
    mx.eval(m)
    assert not memoryview(m).readonly
    a = dlbridge.from_dlpack(m)
    assert not a.readonly and a.data_ptr == ptr_of(m)


def test_readonly_dlbridge_array_into_mlx():
    n = np.arange(3, dtype=np.float32)
    n.flags.writeable = False
    a = dlbridge.from_dlpack(n)
    assert a.readonly
    with pytest.raises(BufferError):
        a[0] = 1.0
    m = mx.array(a)  # a copy, so read-only memory is never shared
    assert m.tolist() == [0.0, 1.0, 2.0]


def test_mlx_source_kept_alive_by_dlbridge():
    m = mx.arange(1000, dtype=mx.float32)[10:]
    mx.eval(m)
    a = dlbridge.from_dlpack(m)[::100]
    del m
    collect()
    _ = [mx.ones((1000,)) * 3 for _ in range(20)]
    mx.eval(*_)
    assert a.tolist() == [float(i) for i in range(10, 1000, 100)]
