"""NumPy <-> dlbridge, both directions: zero-copy proven by pointers and by writes."""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge
from conftest import FLAG_READ_ONLY, capsule_info, ptr_of, random_values

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]

# A value of each kind that differs from everything random_values produces.
MARK = {"b": True, "i": 77, "u": 77, "f": 99.5, "c": 3 - 4j}


def mark_for(dtype) -> object:
    return MARK[np.dtype(dtype).kind]


# NumPy views of a (4, 6) base, and the matching dlbridge views.
VIEWS = {
    "full": lambda x: x,
    "slice": lambda x: x[1:, 2:],
    "strided": lambda x: x[::2, 1::3],
    "transposed": lambda x: x.T,
    "negative": lambda x: x[::-1, ::-2],
    "row": lambda x: x[2],
    "newaxis": lambda x: x[None, 1:3, None, ::2],
    "0d": lambda x: x[3, 5, ...],  # a 0-d view (not a NumPy scalar copy)
    "zero-size": lambda x: x[2:2],
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_to_dlbridge_every_dtype(dtype, values):
    n = values((4, 6), dtype)
    a = dlbridge.from_dlpack(n)
    assert a.dtype == dtype and a.dtype == n.dtype
    assert a.data_ptr == ptr_of(n)
    assert a.tolist() == n.tolist()
    m = mark_for(dtype)
    a[1, 2] = m
    assert n[1, 2] == m
    n[3, 0] = m
    assert a[3, 0].item() == m


@pytest.mark.parametrize("dtype", DTYPES)
def test_dlbridge_to_numpy_every_dtype(dtype, values):
    src = values((4, 6), dtype)
    a = dlbridge.asarray(src.tolist(), dtype=dtype)
    assert not a.is_foreign
    n = np.from_dlpack(a)
    assert n.dtype == np.dtype(dtype)
    assert ptr_of(n) == a.data_ptr
    assert n.tolist() == src.tolist()
    assert n.flags.writeable
    m = mark_for(dtype)
    n[0, 1] = m
    assert a[0, 1].item() == m
    a[2, 2] = m
    assert n[2, 2] == m


@pytest.mark.parametrize("view", list(VIEWS))
def test_numpy_views_to_dlbridge(view, values):
    base = values((4, 6), np.float32)
    nv = VIEWS[view](base)
    a = dlbridge.from_dlpack(nv)
    assert a.shape == nv.shape
    assert a.tolist() == nv.tolist()
    if nv.size:
        assert a.data_ptr == ptr_of(nv)
        assert a.strides == tuple(s // 4 for s in nv.strides)
        a[(0,) * a.ndim] = 1234.0
        assert nv[(0,) * nv.ndim] == 1234.0
        assert np.count_nonzero(base == 1234.0) == 1


@pytest.mark.parametrize("view", list(VIEWS))
def test_dlbridge_views_to_numpy(view, values):
    src = values((4, 6), np.float64)
    a = dlbridge.asarray(src.tolist(), dtype="float64")
    av = VIEWS[view](a)
    nv = np.from_dlpack(av)
    ref = VIEWS[view](src)
    assert nv.shape == np.shape(ref)
    assert nv.tolist() == np.asarray(ref).tolist()
    if av.size:
        assert ptr_of(nv) == av.data_ptr
        assert nv.strides == tuple(s * 8 for s in av.strides)
        nv[(0,) * nv.ndim] = -1234.0
        assert av[(0,) * av.ndim].item() == -1234.0
        assert sum(row.count(-1234.0) for row in a.tolist()) == 1


def test_byte_offset_views_export_first_element(values):
    src = values((10,), np.int32)
    a = dlbridge.asarray(src.tolist(), dtype="int32")
    v = a[3:]
    assert v.byte_offset == 3 * 4
    assert v.data_ptr == a.data_ptr + 12
    n = np.from_dlpack(v)
    assert ptr_of(n) == a.data_ptr + 12
    assert n.tolist() == src[3:].tolist()
    w = a.reshape(2, 5)[1:, ::-1]
    assert w.byte_offset == 9 * 4
    m = np.from_dlpack(w)
    assert m.tolist() == src.reshape(2, 5)[1:, ::-1].tolist()
    m[0, 0] = 555
    assert a[9].item() == 555


@pytest.mark.parametrize("shape", [(3,), (4, 1), (1, 3), (2, 1, 3)])
def test_broadcast_views_both_ways(shape, values):
    src = values(shape, np.int64)
    target = (5,) + tuple(max(s, 3) for s in shape) if len(shape) < 3 else (4, 2, 5, 3)
    target = np.broadcast_shapes(shape, target)
    # dlbridge -> NumPy: stride 0 survives, memory shared.
    a = dlbridge.asarray(src.tolist(), dtype="int64")
    b = a.broadcast_to(target)
    n = np.from_dlpack(b)
    assert n.tolist() == np.broadcast_to(src, target).tolist()
    assert 0 in n.strides
    assert ptr_of(n) == a.data_ptr
    a[(0,) * a.ndim] = 1000
    assert n[(0,) * n.ndim] == 1000
    # NumPy -> dlbridge: np.broadcast_to views are read-only.
    nb = np.broadcast_to(src, target)
    d = dlbridge.from_dlpack(nb)
    assert 0 in d.strides
    assert d.readonly
    assert d.data_ptr == ptr_of(src)
    assert d.tolist() == nb.tolist()
    with pytest.raises(BufferError):
        d[...] = 0


def test_random_shapes_and_views_round_trip(rng):
    for _ in range(40):
        ndim = int(rng.integers(1, 5))
        shape = tuple(int(s) for s in rng.integers(1, 6, size=ndim))
        n = random_values(rng, shape, rng.choice(["int16", "float32", "complex64", "uint8"]))
        key = tuple(slice(None, None, int(rng.choice([-2, -1, 1, 2]))) for _ in shape)
        nv = n[key]
        a = dlbridge.from_dlpack(nv)
        assert a.data_ptr == ptr_of(nv)
        back = np.from_dlpack(a)
        assert ptr_of(back) == ptr_of(nv)
        assert back.strides == nv.strides
        assert back.tolist() == nv.tolist()


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 0, 2)])
def test_0d_and_zero_size(shape):
    n = np.full(shape, 2.5, dtype=np.float32)
    a = dlbridge.from_dlpack(n)
    assert a.shape == shape and a.size == n.size
    assert a.tolist() == n.tolist()
    back = np.from_dlpack(a)
    assert back.shape == shape and back.dtype == np.float32
    d = dlbridge.full(shape, 1.5)
    m = np.from_dlpack(d)
    assert m.shape == shape and m.tolist() == np.full(shape, 1.5, np.float32).tolist()
    if not shape:
        assert ptr_of(m) == d.data_ptr
        assert ptr_of(n) == a.data_ptr


# ---------------------------------------------------------------------------------------------
# copy and read-only.


@pytest.mark.parametrize("copy", [None, False, True])
def test_copy_keyword_both_directions(copy, values):
    n = values((3, 4), np.float32)
    a = dlbridge.from_dlpack(n, copy=copy)
    assert a.tolist() == n.tolist()
    assert (a.data_ptr == ptr_of(n)) is (copy is not True)
    n2 = np.from_dlpack(a, copy=copy)
    assert n2.tolist() == n.tolist()
    assert (ptr_of(n2) == a.data_ptr) is (copy is not True)
    a[0, 0] = 321.0
    assert bool(n2[0, 0] == 321.0) == (copy is not True)


def test_numpy_readonly_becomes_dlbridge_readonly():
    n = np.arange(6, dtype=np.float32).reshape(2, 3)
    n.flags.writeable = False
    a = dlbridge.from_dlpack(n)
    assert a.readonly
    assert a.data_ptr == ptr_of(n)
    with pytest.raises(BufferError):
        a[0, 0] = 1.0
    with pytest.raises(BufferError):
        a[:, 1] = [5.0, 6.0]
    with pytest.raises(BufferError):
        a.T[...] = 0.0
    assert n.tolist() == [[0, 1, 2], [3, 4, 5]]
    # Back to NumPy: versioned capsule flagged READ_ONLY, so NumPy makes it non-writeable.
    assert capsule_info(a.__dlpack__(max_version=(1, 0)))["flags"] & FLAG_READ_ONLY
    back = np.from_dlpack(a)
    assert not back.flags.writeable
    assert ptr_of(back) == ptr_of(n)
    # np.asarray goes through __array__ -> np.from_dlpack, read-only too.
    assert not np.asarray(a).flags.writeable
    # A copy is writable.
    c = dlbridge.from_dlpack(n, copy=True)
    assert not c.readonly
    c[0, 0] = 9.0


def test_numpy_treats_legacy_capsules_as_readonly():
    a = dlbridge.arange(4, dtype="float32")

    class LegacyOnly:
        def __dlpack__(self, **kwargs):
            return a.__dlpack__()  # legacy capsule whatever is asked

        def __dlpack_device__(self):
            return (1, 0)

    n = np.from_dlpack(LegacyOnly())
    assert ptr_of(n) == a.data_ptr
    assert not n.flags.writeable


def test_numpy_exports_versioned_1_0():
    info = capsule_info(np.arange(3).__dlpack__(max_version=(1, 3)))
    assert info["name"] == "dltensor_versioned" and info["version"] == (1, 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_numpy_cannot_import_extended_floats(dtype):
    a = dlbridge.zeros(3, dtype)
    with pytest.raises((RuntimeError, BufferError, TypeError)):
        np.from_dlpack(a)


def test_numpy_unsupported_dtypes_are_refused():
    for arr in (np.array(["2020-01-01"], "M8[D]"), np.array(["a"]), np.array([1], dtype=object)):
        with pytest.raises(BufferError):
            dlbridge.from_dlpack(arr)


# ---------------------------------------------------------------------------------------------
# __array__.


def test_array_protocol_is_zero_copy():
    a = dlbridge.arange(6, dtype="int32").reshape(2, 3)[:, ::-1]
    n = np.asarray(a)
    assert ptr_of(n) == a.data_ptr
    assert n.tolist() == [[2, 1, 0], [5, 4, 3]]
    n[0, 0] = 50
    assert a[0, 0].item() == 50
    c = np.array(a, copy=True)
    assert ptr_of(c) != a.data_ptr and c.tolist() == n.tolist()
    f = np.asarray(a, dtype=np.float64)
    assert f.dtype == np.float64 and f.tolist() == [[50.0, 1.0, 0.0], [5.0, 4.0, 3.0]]
    assert ptr_of(np.array(a, copy=False)) == a.data_ptr
    # NumPy ufuncs accept dlbridge arrays through __array__.
    assert np.add(a, 1).tolist() == [[51, 2, 1], [6, 5, 4]]


def test_numpy_scalar_and_0d_interplay():
    s = dlbridge.from_dlpack(np.array(7, dtype=np.int16))
    assert s.shape == () and s.item() == 7 and int(s) == 7
    assert np.from_dlpack(dlbridge.full((), 3, "uint8")).item() == 3


def test_array_protocol_with_the_same_dtype_does_not_copy():
    a = dlbridge.arange(6, dtype="float32")
    n = np.asarray(a, dtype=np.float32)
    assert ptr_of(n) == a.data_ptr
    assert ptr_of(a.__array__(dtype=np.float32)) == a.data_ptr
    assert ptr_of(np.array(a, dtype=np.float32, copy=False)) == a.data_ptr


def test_array_protocol_copy_false_refuses_a_conversion():
    """NumPy 2's __array__ contract: copy=False with a dtype that needs a copy raises ValueError."""
    a = dlbridge.arange(6, dtype="float32")
    with pytest.raises(ValueError):
        np.array(a, dtype=np.float64, copy=False)
    with pytest.raises(ValueError):
        a.__array__(dtype=np.float64, copy=False)
