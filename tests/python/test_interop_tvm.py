"""TVM-FFI <-> dlbridge: zero-copy both ways.

``tvm_ffi.Tensor`` has no element access of its own, so its side is read and written through a
NumPy view of it (``np.from_dlpack(tvm_tensor)``, itself zero-copy) or through dlbridge.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (scripts/env.sh installs it)")
tvm_ffi = pytest.importorskip("tvm_ffi", reason="TVM-FFI is not installed (scripts/env.sh installs it)")

import dlbridge
from conftest import capsule_info, collect, make_capsule, ptr_of, random_values

STANDARD = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float16", "float32", "float64"]
EXTENDED = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
            "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu"]


def dl_values(rng, shape, name) -> dlbridge.Array:
    if name == "float8_e8m0fnu":
        return dlbridge.from_dlpack(2.0 ** rng.integers(-4, 5, size=shape)).astype(name)
    if name in EXTENDED:
        return dlbridge.from_dlpack(random_values(rng, shape, np.float32)).astype(name)
    return dlbridge.from_dlpack(random_values(rng, shape, name)).copy()


def values_of(a: dlbridge.Array):
    return a.astype("float32").tolist() if a.dtype in EXTENDED else a.tolist()


def mark_for(name):
    if name == "bool":
        return True
    if name == "float8_e8m0fnu":
        return 64.0
    return 12.0 if "float" in name else 77


@pytest.mark.parametrize("name", STANDARD + EXTENDED)
def test_dlbridge_to_tvm_and_back(name, rng):
    a = dl_values(rng, (4, 6), name)
    t = tvm_ffi.from_dlpack(a)
    assert str(t.dtype) == name
    assert tuple(t.shape) == (4, 6)
    assert t.data_ptr() == a.data_ptr
    b = dlbridge.from_dlpack(t)
    assert b.dtype == name
    assert b.data_ptr == a.data_ptr
    assert values_of(b) == values_of(a)
    # A write through dlbridge is in TVM's tensor (read back through a fresh import).
    a[1, 2] = mark_for(name)
    assert values_of(dlbridge.from_dlpack(t))[1][2] == mark_for(name)


@pytest.mark.parametrize("name", STANDARD)
def test_tvm_to_dlbridge_with_writes_both_ways(name, rng):
    host = random_values(rng, (3, 5), name)
    t = tvm_ffi.from_dlpack(host)
    assert t.data_ptr() == ptr_of(host)
    a = dlbridge.from_dlpack(t)
    assert a.data_ptr == t.data_ptr()
    assert a.tolist() == host.tolist()
    mark = mark_for(name)
    a[2, 4] = mark
    assert np.from_dlpack(t)[2, 4] == mark
    np.from_dlpack(t)[0, 0] = mark
    assert a[0, 0].item() == mark


@pytest.mark.parametrize("name", ["complex64", "complex128"])
def test_complex_passes_through_tvm(name):
    """TVM-FFI holds complex tensors (and shares them) but cannot name their dtype."""
    a = dlbridge.asarray([1 + 2j, -3j, 4.5], dtype=name)
    t = tvm_ffi.from_dlpack(a)
    assert t.data_ptr() == a.data_ptr
    with pytest.raises(ValueError, match="type_code"):
        t.dtype
    b = dlbridge.from_dlpack(t)
    assert b.dtype == name and b.data_ptr == a.data_ptr
    assert b.tolist() == [1 + 2j, -3j, 4.5 + 0j]


def test_tvm_exports_both_capsule_kinds():
    t = tvm_ffi.from_dlpack(dlbridge.arange(4))
    assert capsule_info(t.__dlpack__())["name"] == "dltensor"
    info = capsule_info(t.__dlpack__(max_version=(1, 3)))
    assert info["name"] == "dltensor_versioned" and info["version"] == (1, 3)


VIEWS = {
    "slice": lambda x: x[1:, 2:],
    "strided": lambda x: x[::2, 1::3],
    "transposed": lambda x: x.T,
    "negative": lambda x: x[::-1, ::-2],
    "row": lambda x: x[2],
    "newaxis": lambda x: x[None, :, None],
    "broadcast": lambda x: x[1].broadcast_to((3, 6)),
    "0d": lambda x: x[3, 5],
    "zero-size": lambda x: x[2:2],
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_dlbridge_views_through_tvm(view):
    a = dlbridge.arange(24, dtype="float32").reshape(4, 6)
    v = VIEWS[view](a)
    t = tvm_ffi.from_dlpack(v)
    assert tuple(t.shape) == v.shape
    assert tuple(t.strides) == v.strides
    b = dlbridge.from_dlpack(t)
    assert b.shape == v.shape and b.strides == v.strides
    assert b.tolist() == v.tolist()
    if v.size:
        assert t.data_ptr() == v.data_ptr
        assert b.data_ptr == v.data_ptr
        n = np.from_dlpack(t)
        n[(0,) * n.ndim] = -1.0
        assert v[(0,) * v.ndim].item() == -1.0


def test_dlbridge_byte_offset_view_to_tvm():
    a = dlbridge.arange(10, dtype="int64")
    v = a[3:]
    assert v.byte_offset == 24
    t = tvm_ffi.from_dlpack(v)
    assert t.data_ptr() == a.data_ptr + 24
    info = capsule_info(t.__dlpack__(max_version=(1, 3)))
    assert info["data"] + info["byte_offset"] == a.data_ptr + 24
    assert dlbridge.from_dlpack(t).tolist() == list(range(3, 10))


def test_tvm_reexport_keeps_nonzero_byte_offset():
    """TVM keeps a producer's byte_offset on re-export; dlbridge must honour it."""
    m = mx.arange(10, dtype=mx.int32)[3:]
    mx.eval(m)
    t = tvm_ffi.from_dlpack(m)
    info = capsule_info(t.__dlpack__(max_version=(1, 3)))
    assert info["byte_offset"] == 12
    assert t.data_ptr() == ptr_of(m)
    a = dlbridge.from_dlpack(t)
    assert a.tolist() == list(range(3, 10))
    assert a.data_ptr == ptr_of(m)
    assert a[::-2].tolist() == [9, 7, 5, 3]


@pytest.mark.parametrize("strided", [False, True])
def test_hand_made_byte_offset_capsule_through_tvm(strided):
    base = np.arange(40, dtype=np.float32).reshape(5, 8)
    view = base[2:, 1::3] if strided else base[2:, 3:]
    offset = ptr_of(view) - ptr_of(base)
    hand = make_capsule(view, byte_offset=offset)
    t = tvm_ffi.from_dlpack(hand.capsule)
    assert t.data_ptr() == ptr_of(view)
    assert capsule_info(t.__dlpack__(max_version=(1, 3)))["byte_offset"] == offset
    a = dlbridge.from_dlpack(t)
    assert a.tolist() == view.tolist()
    assert a.data_ptr == ptr_of(view)
    a[0, 0] = -3.0
    assert view[0, 0] == -3.0
    del a, t
    collect()
    assert hand.deleted == 1


def test_tvm_alignment_and_contiguity_requirements():
    a = dlbridge.arange(64, dtype="float32")
    assert tvm_ffi.from_dlpack(a, require_alignment=64).data_ptr() == a.data_ptr
    assert tvm_ffi.from_dlpack(a[16:], require_alignment=64).data_ptr() == a.data_ptr + 64
    with pytest.raises((RuntimeError, ValueError), match="align"):
        tvm_ffi.from_dlpack(a[1:], require_alignment=64)
    with pytest.raises((RuntimeError, ValueError), match="contiguous"):
        tvm_ffi.from_dlpack(a[::2], require_contiguous=True)


def test_0d_and_zero_size():
    s = dlbridge.full((), 4.5, "float64")
    t = tvm_ffi.from_dlpack(s)
    assert tuple(t.shape) == () and t.data_ptr() == s.data_ptr
    assert dlbridge.from_dlpack(t).item() == 4.5
    z = dlbridge.zeros((0, 3))
    tz = tvm_ffi.from_dlpack(z)
    assert tuple(tz.shape) == (0, 3)
    assert dlbridge.from_dlpack(tz).shape == (0, 3)
    tn = tvm_ffi.from_dlpack(np.zeros((2, 0), np.int8))
    assert dlbridge.from_dlpack(tn).shape == (2, 0)


@pytest.mark.parametrize("copy", [None, False, True])
def test_dlbridge_import_copy_keyword(copy):
    host = np.arange(6, dtype=np.float32)
    t = tvm_ffi.from_dlpack(host)
    if copy:
        # TVM refuses producer-side copies ("copy not yet supported"); a consumer may pass that
        # refusal on (NumPy and PyTorch do) or copy itself, but never share.
        try:
            a = dlbridge.from_dlpack(t, copy=True)
        except BufferError:
            return
        assert a.data_ptr != t.data_ptr()
        return
    a = dlbridge.from_dlpack(t, copy=copy)
    assert a.data_ptr == t.data_ptr()
    a[0] = 10.0
    assert host[0] == 10.0


def test_readonly_dlbridge_array_to_tvm():
    n = np.arange(4, dtype=np.float32)
    n.flags.writeable = False
    a = dlbridge.from_dlpack(n)
    assert a.readonly
    t = tvm_ffi.from_dlpack(a)  # versioned capsule flagged READ_ONLY; TVM shares the memory
    assert t.data_ptr() == ptr_of(n)
    with pytest.raises(BufferError):
        a[0] = 1.0


def test_tvm_tensor_keeps_dlbridge_memory_alive():
    a = dlbridge.arange(100, dtype="float64")
    t = tvm_ffi.from_dlpack(a[10:20])
    ptr = a.data_ptr + 80
    del a
    collect()
    _ = [np.ones(100) for _ in range(20)]
    assert t.data_ptr() == ptr
    assert dlbridge.from_dlpack(t).tolist() == [float(i) for i in range(10, 20)]


def test_sub_byte_dtypes_to_tvm():
    """dlbridge stores sub-byte elements padded, one per byte. The legacy capsule that
    `tvm_ffi.from_dlpack(array)` asks for cannot say so (it would be read as packed), so dlbridge
    refuses it with BufferError; the versioned capsule says IS_SUBBYTE_TYPE_PADDED, which
    TVM-FFI 0.1 refuses in turn ("Subbyte type padded is not yet supported"). Either way no
    misread data crosses."""
    for name in ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"):
        a = dlbridge.asarray([0.5, 1.0, -2.0, 3.0], dtype=name)
        with pytest.raises(BufferError, match="padded"):
            tvm_ffi.from_dlpack(a)
        with pytest.raises(RuntimeError, match="padded"):
            tvm_ffi.from_dlpack(a.__dlpack__(max_version=(1, 3)))


def test_ml_dtypes_names_agree():
    for name in EXTENDED:
        t = tvm_ffi.from_dlpack(dlbridge.zeros(2, name))
        assert dlbridge.DType(str(t.dtype)) == name
        assert dlbridge.DType(np.dtype(getattr(ml_dtypes, name))) == name
