"""dlbridge.Array and the creation functions, with NumPy as the reference for views."""

from __future__ import annotations

import array as pyarray
import itertools
import math
import subprocess
import sys

import numpy as np
import pytest

import dlbridge
from conftest import ptr_of, random_values

ALL_DTYPE_NAMES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn",
    "float4_e2m1fn",
]
NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]


def np_view(a: dlbridge.Array) -> np.ndarray:
    return np.from_dlpack(a)


# ---------------------------------------------------------------------------------------------
# Properties.


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_properties_match_numpy(dtype, values):
    n = values((3, 4, 5), dtype)
    a = dlbridge.from_dlpack(n)
    assert a.shape == n.shape
    assert a.strides == tuple(s // n.itemsize for s in n.strides)
    assert a.dtype == dtype
    assert a.dtype == n.dtype
    assert a.ndim == 3
    assert a.size == 60
    assert a.itemsize == n.itemsize
    assert a.nbytes == n.nbytes
    assert a.device == "cpu"
    assert a.__dlpack_device__() == (1, 0)
    assert a.byte_offset == 0
    assert a.is_contiguous
    assert a.is_foreign
    assert not a.readonly
    assert a.data_ptr == ptr_of(n)
    assert len(a) == 3
    assert a.tolist() == n.tolist()


def test_native_array_properties():
    a = dlbridge.arange(24, dtype="float64").reshape(2, 3, 4)
    assert not a.is_foreign
    assert not a.readonly
    assert a.strides == (12, 4, 1)
    assert a.nbytes == 24 * 8
    assert a.data_ptr % 64 == 0, "dlbridge allocations are 64-byte aligned"
    v = a[1:, :, 2:]
    assert v.byte_offset == (12 + 2) * 8
    assert v.data_ptr == a.data_ptr + v.byte_offset
    assert not v.is_contiguous
    assert a.T.shape == (4, 3, 2) and a.T.strides == (1, 4, 12)
    assert not a.T.is_contiguous


def test_itemsize_and_nbytes_of_every_dtype():
    sizes = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1,
             "uint16": 2, "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4,
             "float64": 8, "complex64": 8, "complex128": 16}
    for name, size in sizes.items():
        a = dlbridge.zeros((3, 2), name)
        assert a.itemsize == size, name
        assert a.nbytes == 6 * size, name
        assert getattr(dlbridge, name).itemsize == size
    for name in ALL_DTYPE_NAMES:
        if name.startswith("float8"):
            assert getattr(dlbridge, name).itemsize == 1
            assert getattr(dlbridge, name).bits == 8


# ---------------------------------------------------------------------------------------------
# Indexing against NumPy.


def _random_key(rng, shape):
    """A random basic index for ``shape``: ints, slices (any step), at most one ``...``, ``None``."""
    key = []
    axis = 0
    used_ellipsis = False
    ndim = len(shape)
    while axis < ndim:
        r = rng.random()
        if r < 0.12:
            key.append(None)
            continue
        if r < 0.22 and not used_ellipsis:
            used_ellipsis = True
            # The ellipsis swallows a random number of axes.
            skip = int(rng.integers(0, ndim - axis + 1))
            key.append(Ellipsis)
            axis += skip
            continue
        n = shape[axis]
        if r < 0.45 and n > 0:
            key.append(int(rng.integers(-n, n)))
        else:
            def bound():
                return None if rng.random() < 0.3 else int(rng.integers(-n - 2, n + 3))
            step = None if rng.random() < 0.25 else int(rng.choice([-3, -2, -1, 1, 2, 3]))
            key.append(slice(bound(), bound(), step))
        axis += 1
    if rng.random() < 0.15:
        key.append(None)
    return tuple(key)


@pytest.mark.parametrize("zero_extent", [False, True], ids=["nonempty", "with-zero-extent"])
def test_random_views_match_numpy(rng, zero_extent):
    checked = 0
    for _ in range(400):
        ndim = int(rng.integers(0, 5))
        low = 0 if zero_extent else 1
        shape = tuple(int(s) for s in rng.integers(low, 5, size=ndim))
        if zero_extent and 0 not in shape:
            continue
        n = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
        a = dlbridge.from_dlpack(n)
        b = dlbridge.asarray(n.tolist(), dtype="int32") if n.size else dlbridge.zeros(shape, "int32")
        key = _random_key(rng, shape)
        ref = n[key]
        for src in (a, b):
            got = src[key]
            assert isinstance(got, dlbridge.Array)
            assert got.shape == np.shape(ref), (shape, key)
            if src is a:
                assert got.tolist() == np.asarray(ref).tolist(), (shape, key)
                if isinstance(ref, np.ndarray) and ref.size:  # (not a NumPy scalar copy)
                    assert got.data_ptr == ptr_of(ref), (shape, key)
            back = np.from_dlpack(got)
            assert back.shape == np.shape(ref)
        checked += 1
    assert checked > 50


def test_views_share_memory_with_base():
    a = dlbridge.zeros((4, 5), "int64")
    v = a[1:3, ::-2]
    v[...] = 7
    assert a.tolist() == np.where(
        (np.arange(4)[:, None] >= 1) & (np.arange(4)[:, None] < 3) & (np.arange(5)[None] % 2 == 0),
        7, 0).tolist()


def test_integer_index_returns_0d_array():
    a = dlbridge.arange(6).reshape(2, 3)
    s = a[1, 2]
    assert isinstance(s, dlbridge.Array)
    assert s.shape == () and s.ndim == 0 and s.size == 1
    assert s.item() == 5
    assert s.data_ptr == a.data_ptr + 5 * 8
    assert a[-1, -3].item() == 3
    assert a[1].shape == (3,)


@pytest.mark.parametrize("key", [
    (Ellipsis,), (Ellipsis, 0), (0, Ellipsis), (None, Ellipsis, None), (Ellipsis, None),
    (slice(None), None, 1), (None,), (), (slice(None, None, -1), Ellipsis, slice(1, None, 2)),
])
def test_ellipsis_and_newaxis(key):
    n = np.arange(60, dtype=np.float64).reshape(3, 4, 5)
    a = dlbridge.asarray(n.tolist(), dtype="float64")
    assert a[key].shape == n[key].shape
    assert a[key].tolist() == n[key].tolist()


@pytest.mark.parametrize("key", [3, -4, (0, 4), (0, -5), (3, 0), (-4, 0), (Ellipsis, 4)])
def test_out_of_range_index_raises_index_error(key):
    a = dlbridge.zeros((3, 4))
    with pytest.raises(IndexError):
        a[key]
    with pytest.raises(IndexError):
        a[key] = 1.0


# (Integer lists and arrays are valid: tests/python/test_numpy_habits.py.)
@pytest.mark.parametrize("key", [(0, 0, 0), (Ellipsis, Ellipsis), 1.5, "a", [0.5], {"a": 1}])
def test_invalid_index_raises_index_error(key):
    a = dlbridge.zeros((3, 4))
    with pytest.raises(IndexError):
        a[key]


def test_zero_step_slice_is_a_value_error():
    with pytest.raises(ValueError):
        dlbridge.zeros(5)[::0]


def test_index_of_0d_array():
    s = dlbridge.full((), 3.0)
    assert s[()].item() == 3.0
    assert s[...].shape == ()
    assert s[None].shape == (1,)
    with pytest.raises(IndexError):
        s[0]


def test_numpy_integer_and_index_objects_as_indices():
    a = dlbridge.arange(10)
    assert a[np.int64(3)].item() == 3
    assert a[np.uint8(2):np.int32(5)].tolist() == [2, 3, 4]
    assert a[dlbridge.full((), 7)].item() == 7


def test_slices_past_the_ends_are_clamped():
    a = dlbridge.arange(5)
    assert a[-100:100].tolist() == [0, 1, 2, 3, 4]
    assert a[100:].shape == (0,)
    assert a[::-100].tolist() == [4]
    assert a[3:1].shape == (0,)


# ---------------------------------------------------------------------------------------------
# reshape / permute / T / broadcast_to.


@pytest.mark.parametrize("shape,new", [
    ((2, 3, 4), (24,)), ((2, 3, 4), (4, -1)), ((2, 3, 4), (6, 4)), ((2, 3, 4), (2, 1, 3, 1, 4)),
    ((24,), (2, 3, 4)), ((1,), ()), ((), (1, 1)), ((0, 3), (3, 0)), ((0, 3), (-1, 5)),
])
def test_reshape_contiguous(shape, new):
    n = np.arange(math.prod(shape), dtype=np.int16).reshape(shape)
    a = dlbridge.from_dlpack(n)
    r = a.reshape(*new) if new else a.reshape(())
    ref = n.reshape(new)
    assert r.shape == ref.shape
    assert r.tolist() == ref.tolist()
    if n.size:
        assert r.data_ptr == a.data_ptr  # a view
    # tuple and list spellings
    assert a.reshape(tuple(new)).shape == ref.shape
    assert a.reshape(list(new)).shape == ref.shape


def test_reshape_of_strided_views():
    a = dlbridge.arange(24).reshape(2, 3, 4)
    v = a[:, :, ::2]  # (2, 3, 2) strides (12, 4, 2): merging the first two axes works
    r = v.reshape(6, 2)
    assert r.tolist() == np.arange(24).reshape(2, 3, 4)[:, :, ::2].reshape(6, 2).tolist()
    assert r.data_ptr == v.data_ptr
    with pytest.raises(ValueError):
        a.T.reshape(24)
    with pytest.raises(ValueError):
        a[:, ::2].reshape(-1)


@pytest.mark.parametrize("bad", [(5, 5), (-1, -1), (-2, 12), (25,)])
def test_reshape_errors(bad):
    with pytest.raises(ValueError):
        dlbridge.arange(24).reshape(*bad)


def test_permute_and_transpose(values):
    n = values((2, 3, 4), np.float32)
    a = dlbridge.from_dlpack(n)
    for axes in itertools.permutations(range(3)):
        p = a.permute(*axes)
        ref = n.transpose(axes)
        assert p.shape == ref.shape
        assert p.tolist() == ref.tolist()
        assert p.data_ptr == a.data_ptr
        assert p.strides == tuple(s // 4 for s in ref.strides)
    assert a.T.tolist() == n.T.tolist()
    assert a.T.T.strides == a.strides
    assert dlbridge.full((), 1.0).T.shape == ()
    with pytest.raises(ValueError):
        a.permute(0, 0, 1)
    with pytest.raises(ValueError):
        a.permute(0, 1)
    with pytest.raises((ValueError, IndexError)):
        a.permute(0, 1, 3)


@pytest.mark.parametrize("src,target", [
    ((3,), (4, 3)), ((3, 1), (3, 5)), ((1,), (2, 2, 2)), ((), (3,)), ((2, 1, 3), (4, 2, 5, 3)),
    ((3,), (3,)), ((3,), (0, 3)),
])
def test_broadcast_to(src, target):
    n = np.arange(math.prod(src), dtype=np.float64).reshape(src)
    a = dlbridge.from_dlpack(n)
    b = a.broadcast_to(target)
    ref = np.broadcast_to(n, target)
    assert b.shape == ref.shape
    assert b.tolist() == ref.tolist()
    if ref.size:
        assert b.strides == tuple(s // 8 for s in ref.strides)
        assert b.data_ptr == a.data_ptr


@pytest.mark.parametrize("src,target", [((3,), (4,)), ((2, 3), (3,)), ((3,), (2, 4))])
def test_broadcast_to_errors(src, target):
    with pytest.raises(ValueError):
        dlbridge.zeros(src).broadcast_to(target)


# ---------------------------------------------------------------------------------------------
# __setitem__.


def test_setitem_scalar_fill_through_views():
    n = np.zeros((4, 5), dtype=np.float32)
    a = dlbridge.from_dlpack(n)
    a[1] = 2.5
    a[:, ::-2] = -1
    a[..., 1] = 3
    a[0, 0] = True
    ref = np.zeros((4, 5), dtype=np.float32)
    ref[1] = 2.5
    ref[:, ::-2] = -1
    ref[..., 1] = 3
    ref[0, 0] = True
    assert n.tolist() == ref.tolist()


def test_setitem_from_sequences_with_broadcasting():
    a = dlbridge.zeros((3, 4), "int32")
    a[:, 2] = [1, 2, 3]
    a[2, ::-1] = (0, 1, 2, 3)
    ref = np.zeros((3, 4), np.int32)
    ref[:, 2] = [1, 2, 3]
    ref[2, ::-1] = (0, 1, 2, 3)
    assert a.tolist() == ref.tolist()
    a[...] = [[9], [8], [7]]
    assert a.tolist() == [[9] * 4, [8] * 4, [7] * 4]
    a[1:] = [5, 6, 7, 8]
    assert a.tolist() == [[9] * 4, [5, 6, 7, 8], [5, 6, 7, 8]]


@pytest.mark.parametrize("source", ["dlbridge", "numpy", "dlbridge-int64", "dlbridge-0d"])
def test_setitem_from_arrays(source):
    """Assigning an array (any DLPack/array object) copies it in, with broadcasting and casting."""
    a = dlbridge.zeros((2, 4), "int32")
    value = {
        "dlbridge": lambda: dlbridge.arange(4, dtype="int32"),
        "numpy": lambda: np.arange(4, dtype=np.int32),
        "dlbridge-int64": lambda: dlbridge.arange(4),
        "dlbridge-0d": lambda: dlbridge.full((), 3, "int32"),
    }[source]()
    a[...] = value
    expected = np.broadcast_to(np.asarray(value.tolist(), dtype=np.int32), (2, 4)).tolist()
    assert a.tolist() == expected


def test_setitem_from_overlapping_view_behaves_like_numpy():
    a = dlbridge.arange(6, dtype="float32")
    a[1:4] = a[0:3]
    n = np.arange(6, dtype=np.float32)
    n[1:4] = n[0:3]
    assert a.tolist() == n.tolist()
    b = dlbridge.arange(6, dtype="float32")
    b[::-1] = b
    assert b.tolist() == [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]


def test_setitem_errors():
    a = dlbridge.zeros((3, 4), "int32")
    with pytest.raises(ValueError):
        a[0] = [1, 2, 3]  # does not broadcast
    with pytest.raises(TypeError):
        a[0] = 1.5  # no silent truncation of Python floats into ints
    with pytest.raises(TypeError):
        a[0] = "x"
    with pytest.raises((OverflowError, ValueError)):
        a[0] = 2**40
    with pytest.raises(IndexError):
        a[5] = 1
    assert a.tolist() == [[0] * 4] * 3


def test_setitem_on_broadcast_view_writes_the_shared_element():
    base = dlbridge.zeros(3, "int64")
    b = base.broadcast_to((4, 3))
    b[2, 1] = 9
    assert base.tolist() == [0, 9, 0]


# ---------------------------------------------------------------------------------------------
# tolist / item / scalar conversions.


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_tolist_matches_numpy(dtype, values):
    n = values((2, 3), dtype)
    a = dlbridge.from_dlpack(n)
    assert a.tolist() == n.tolist()
    assert a[:, ::-1].tolist() == n[:, ::-1].tolist()
    assert a.T.tolist() == n.T.tolist()
    assert a[1, 2].tolist() == n[1, 2].item()
    assert a[1, 2].item() == n[1, 2].item()
    assert type(a[0, 0].item()) is type(n[0, 0].item())


def test_scalar_conversions():
    f = dlbridge.full((), 2.75)
    assert float(f) == 2.75 and int(f) == 2 and bool(f) is True and complex(f) == 2.75
    i = dlbridge.full((1, 1), -7)
    assert int(i) == -7 and float(i) == -7.0 and i.__index__() == -7
    assert [10, 20, 30][dlbridge.full((), 1)] == 20
    c = dlbridge.asarray([1 + 2j])
    assert complex(c) == 1 + 2j
    assert bool(dlbridge.full((), 0.0)) is False
    assert bool(dlbridge.full((), True)) is True
    u = dlbridge.full((), 2**64 - 1, "uint64")
    assert int(u) == 2**64 - 1 and u.item() == 2**64 - 1
    with pytest.raises(TypeError):
        f.__index__()  # floats are not indices
    with pytest.raises(TypeError):
        dlbridge.full((), True).__index__()
    with pytest.raises(TypeError):
        float(dlbridge.zeros(2))
    with pytest.raises(TypeError):
        dlbridge.zeros(2).item()
    with pytest.raises(TypeError):
        bool(dlbridge.zeros(0))


def test_len_and_iter():
    a = dlbridge.arange(6).reshape(3, 2)
    assert len(a) == 3
    rows = list(a)
    assert all(isinstance(r, dlbridge.Array) for r in rows)
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4, 5]]
    assert rows[1].data_ptr == a.data_ptr + 2 * 8
    assert list(dlbridge.zeros((0, 2))) == []
    with pytest.raises(TypeError):
        len(dlbridge.full((), 1))
    with pytest.raises(TypeError):
        iter(dlbridge.full((), 1))


@pytest.mark.parametrize("name,vals", [
    ("bfloat16", [0.5, -2.0, 3.0, 1.0e5]),
    ("float16", [0.5, -2.0, 65504.0]),
    ("float8_e4m3fn", [0.5, -2.0, 448.0]),
    ("float8_e5m2", [0.5, -2.0, 57344.0]),
    ("float8_e4m3fnuz", [0.5, -2.0, 240.0]),
    ("float8_e5m2fnuz", [0.5, -2.0]),
    ("float8_e8m0fnu", [0.5, 2.0, 1024.0]),
    ("float4_e2m1fn", [0.5, -2.0, 6.0]),
])
def test_minifloat_roundtrip_through_python(name, vals):
    import ml_dtypes

    a = dlbridge.asarray(vals, dtype=name)
    assert a.dtype == name
    target = np.float16 if name == "float16" else getattr(ml_dtypes, name)
    expected = np.asarray(vals, dtype=np.float64).astype(target).astype(np.float64)
    assert a.tolist() == expected.tolist()
    assert a.astype("float32").tolist() == expected.tolist()


# ---------------------------------------------------------------------------------------------
# astype / copy / to.


@pytest.mark.parametrize("src,dst", [
    ("int64", "float32"), ("float64", "float16"), ("float32", "int32"), ("bool", "int8"),
    ("int32", "bool"), ("float32", "complex64"), ("float64", "bfloat16"), ("uint8", "int64"),
])
def test_astype_matches_numpy(src, dst, values):
    n = values((3, 4), src)
    a = dlbridge.from_dlpack(n)[:, ::-1]
    c = a.astype(dst)
    assert c.dtype == dst
    assert c.is_contiguous and not c.is_foreign
    assert c.data_ptr != a.data_ptr
    if dst == "bfloat16":
        import ml_dtypes
        ref = n[:, ::-1].astype(ml_dtypes.bfloat16).astype(np.float64)
        assert c.tolist() == ref.tolist()
    else:
        assert c.tolist() == n[:, ::-1].astype(dst).tolist()
    assert a.astype(np.dtype(dst)).dtype == dst


def test_copy_and_to():
    n = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = dlbridge.from_dlpack(n)[::-1, 1:]
    c = a.copy()
    assert c.is_contiguous and c.data_ptr != a.data_ptr and c.tolist() == a.tolist()
    c[0, 0] = 100
    assert n.max() == 11
    same = a.to("cpu")
    assert same.data_ptr == a.data_ptr
    fresh = a.to("cpu", copy=True)
    assert fresh.data_ptr != a.data_ptr and fresh.tolist() == a.tolist()
    assert a.to(dlbridge.Device("cpu")).data_ptr == a.data_ptr
    assert a.to((1, 0)).data_ptr == a.data_ptr


# ---------------------------------------------------------------------------------------------
# Creation functions.


@pytest.mark.parametrize("shape", [(), 0, 5, (2, 3), [4, 1, 2], (0, 3)])
def test_zeros_empty_full(shape):
    expected_shape = (shape,) if isinstance(shape, int) else tuple(shape)
    z = dlbridge.zeros(shape)
    assert z.shape == expected_shape and z.dtype == "float32"
    assert z.tolist() == np.zeros(expected_shape, np.float32).tolist()
    e = dlbridge.empty(shape, "int16")
    assert e.shape == expected_shape and e.dtype == "int16" and e.is_contiguous
    f = dlbridge.full(shape, 7)
    assert f.dtype == "int64" and f.tolist() == np.full(expected_shape, 7).tolist()


def test_full_dtype_inference_and_errors():
    assert dlbridge.full(2, 1.5).dtype == "float32"
    assert dlbridge.full(2, True).dtype == "bool"
    assert dlbridge.full(2, 1 + 1j).dtype == "complex64"
    assert dlbridge.full(2, 3, "float64").tolist() == [3.0, 3.0]
    assert dlbridge.full(2, 0.5, dlbridge.bfloat16).tolist() == [0.5, 0.5]
    with pytest.raises(TypeError):
        dlbridge.full(2, "a")
    with pytest.raises((OverflowError, ValueError)):
        dlbridge.full(2, 300, "uint8")
    with pytest.raises((OverflowError, ValueError)):
        dlbridge.full(2, -1, "uint32")


def test_creation_errors():
    with pytest.raises(ValueError):
        dlbridge.zeros(-1)
    with pytest.raises(ValueError):
        dlbridge.empty((2, -3))
    with pytest.raises(TypeError):
        dlbridge.zeros(("a",))
    with pytest.raises(TypeError):
        dlbridge.zeros(2.5)
    with pytest.raises(TypeError):
        dlbridge.zeros(3, "notadtype")
    # 256 TiB: representable, but beyond the 128 TiB a 47-bit user address space holds, so no
    # overcommit policy lets it through.
    with pytest.raises(MemoryError):
        dlbridge.empty((2**45,), "float64")
    with pytest.raises(MemoryError):
        dlbridge.zeros((2**45,), "float64")
    with pytest.raises(ValueError):
        dlbridge.empty((2**40, 2**20), "float64")  # 8 EiB: the size itself overflows


@pytest.mark.parametrize("dtype", ALL_DTYPE_NAMES)
def test_zeros_of_every_dtype(dtype):
    z = dlbridge.zeros((2, 3), dtype)
    assert z.dtype == dtype
    assert z.dtype == getattr(dlbridge, dtype)
    assert z.shape == (2, 3)
    if dtype != "float8_e8m0fnu":  # e8m0 has no zero
        assert all(v == 0 for row in z.tolist() for v in row)


@pytest.mark.parametrize("args,kwargs,expected", [
    ((5,), {}, np.arange(5)),
    ((2, 7), {}, np.arange(2, 7)),
    ((7, 2, -2), {}, np.arange(7, 2, -2)),
    ((10, 2), {}, np.arange(10, 2)),
    ((0.5, 2), {}, np.arange(0.5, 2, dtype=np.float32)),
    ((0, 1, 0.25), {}, np.arange(0, 1, 0.25, dtype=np.float32)),
    ((4,), {"dtype": "float64"}, np.arange(4, dtype=np.float64)),
    ((-3, 3), {"dtype": "int8"}, np.arange(-3, 3, dtype=np.int8)),
])
def test_arange(args, kwargs, expected):
    a = dlbridge.arange(*args, **kwargs)
    assert a.dtype == expected.dtype
    assert a.shape == expected.shape
    assert a.tolist() == expected.tolist()


def test_arange_errors():
    with pytest.raises(ValueError):
        dlbridge.arange(0, 5, 0)
    with pytest.raises(ValueError):
        dlbridge.arange(0.0, float("inf"))


@pytest.mark.parametrize("obj,dtype,shape", [
    ([[1, 2], [3, 4]], "int64", (2, 2)),
    ([1.5, 2], "float32", (2,)),
    ([1, 2.5, True], "float32", (3,)),
    ([True, False], "bool", (2,)),
    ([1j, 2], "complex64", (2,)),
    (((1, 2), (3, 4), (5, 6)), "int64", (3, 2)),
    (5, "int64", ()),
    (2.5, "float32", ()),
    ([], "float32", (0,)),
    ([[], []], "float32", (2, 0)),
    ([[[1]], [[2]]], "int64", (2, 1, 1)),
    ([np.float64(1.5), np.int32(2)], "float32", (2,)),
])
def test_asarray_nested_sequences(obj, dtype, shape):
    a = dlbridge.asarray(obj)
    assert a.dtype == dtype
    assert a.shape == shape
    ref = np.asarray(obj, dtype=dtype)
    assert a.tolist() == ref.tolist()
    assert not a.is_foreign


def test_asarray_nested_with_dtype():
    a = dlbridge.asarray([[1, 2], [3, 4]], dtype="float64")
    assert a.dtype == "float64" and a.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert dlbridge.asarray([1, 2], dtype=np.int8).dtype == "int8"
    with pytest.raises(BufferError):
        dlbridge.asarray([1, 2], copy=False)


@pytest.mark.parametrize("ragged", [[[1, 2], [3]], [[1], [2, 3]], [1, [2]], [[1], 2], [[[1, 2]], [[3]]]])
def test_asarray_ragged_is_value_error(ragged):
    with pytest.raises(ValueError):
        dlbridge.asarray(ragged)


@pytest.mark.parametrize("bad", ["abc", ["a"], [[1], ["b"]], {1: 2}, None, [object()], [None]])
def test_asarray_non_numeric_is_type_error(bad):
    with pytest.raises(TypeError):
        dlbridge.asarray(bad)


def test_asarray_of_arrays_is_zero_copy():
    n = np.arange(6.0)
    assert dlbridge.asarray(n).data_ptr == ptr_of(n)
    assert dlbridge.asarray(n, copy=False).data_ptr == ptr_of(n)
    assert dlbridge.asarray(n, copy=True).data_ptr != ptr_of(n)
    c = dlbridge.asarray(n, dtype="float32")
    assert c.dtype == "float32" and c.tolist() == n.tolist()
    with pytest.raises(BufferError):
        dlbridge.asarray(n, dtype="float32", copy=False)
    a = dlbridge.arange(3)
    assert dlbridge.asarray(a).data_ptr == a.data_ptr
    assert dlbridge.asarray(a, copy=True).data_ptr != a.data_ptr
    assert dlbridge.from_dlpack(a).data_ptr == a.data_ptr


# ---------------------------------------------------------------------------------------------
# Buffer protocol.


def test_bytearray_is_shared_and_writable():
    ba = bytearray(8)
    a = dlbridge.asarray(ba)
    assert a.dtype == "uint8" and a.shape == (8,)
    assert not a.readonly
    a[2] = 7
    a[5:] = 255
    assert ba == bytearray([0, 0, 7, 0, 0, 255, 255, 255])
    ba[0] = 42
    assert a[0].item() == 42


def test_bytes_are_read_only():
    b = b"abcd"
    a = dlbridge.asarray(b)
    assert a.readonly
    assert a.tolist() == [97, 98, 99, 100]
    with pytest.raises(BufferError):
        a[0] = 1
    with pytest.raises(BufferError):
        a[...] = [1, 2, 3, 4]
    assert b == b"abcd"
    # A read-only view exports only through versioned DLPack, flagged read-only.
    with pytest.raises(BufferError):
        a.__dlpack__()
    n = np.from_dlpack(a)
    assert not n.flags.writeable
    assert dlbridge.asarray(memoryview(b"xy")).readonly


def test_memoryview_of_strided_numpy_array():
    base = np.arange(30, dtype=np.float32).reshape(5, 6)
    view = base[::2, ::-3]
    a = dlbridge.asarray(memoryview(view))
    assert a.shape == view.shape
    assert a.strides == tuple(s // 4 for s in view.strides)
    assert a.tolist() == view.tolist()
    assert a.data_ptr == ptr_of(view)
    a[0, 0] = -1
    assert base[0, 5] == -1


@pytest.mark.parametrize("typecode,dtype", [("b", "int8"), ("h", "int16"), ("i", "int32"),
                                            ("q", "int64"), ("B", "uint8"), ("f", "float32"),
                                            ("d", "float64")])
def test_array_module_buffers(typecode, dtype):
    arr = pyarray.array(typecode, [1, 2, 3])
    a = dlbridge.asarray(arr)
    assert a.dtype == dtype
    assert a.tolist() == [1, 2, 3]
    a[1] = 9
    assert arr[1] == 9


def test_buffer_keeps_exporter_alive():
    ba = bytearray(b"\x01\x02\x03")
    a = dlbridge.asarray(ba)
    with pytest.raises(BufferError):
        ba.extend(b"x")  # a live export pins the bytearray's size
    del a
    import gc
    gc.collect()
    ba.extend(b"x")  # released
    assert len(ba) == 4


def test_buffer_with_non_native_byte_order_is_rejected():
    be = np.arange(3, dtype=">i4")
    with pytest.raises(BufferError):
        dlbridge.asarray(memoryview(be))


# ---------------------------------------------------------------------------------------------
# DType and Device.


def test_dtype_equality_and_hash():
    assert dlbridge.float32 == "float32"
    assert dlbridge.float32 != "float64"
    assert hash(dlbridge.float32) == hash("float32")
    assert {dlbridge.float32: 1}["float32"] == 1
    assert {"bfloat16": 1}[dlbridge.bfloat16] == 1
    assert dlbridge.DType("float32") == dlbridge.float32
    assert dlbridge.DType(np.float16) == dlbridge.float16
    assert dlbridge.DType(np.dtype("complex128")) == "complex128"
    assert dlbridge.float32 == np.float32
    assert dlbridge.float32 == np.dtype("float32")
    assert dlbridge.int64 == np.int64
    assert dlbridge.bool == np.bool_
    assert dlbridge.bool == "bool"
    assert dlbridge.float32 != 5
    assert not (dlbridge.float32 == object())
    assert len({dlbridge.float32, dlbridge.DType("float32"), dlbridge.float64}) == 2
    with pytest.raises(TypeError):
        dlbridge.float32 < dlbridge.float64


def test_dtype_against_torch_and_ml_dtypes():
    import ml_dtypes
    import torch

    assert dlbridge.float32 == torch.float32
    assert dlbridge.bfloat16 == torch.bfloat16
    assert dlbridge.float8_e4m3fn == torch.float8_e4m3fn
    assert dlbridge.float32 != torch.float64
    assert dlbridge.bfloat16 == ml_dtypes.bfloat16
    assert dlbridge.DType(np.dtype(ml_dtypes.float8_e5m2)) == "float8_e5m2"
    assert dlbridge.DType(torch.complex64) == "complex64"


@pytest.mark.parametrize("name,code,bits", [
    ("int8", 0, 8), ("uint16", 1, 16), ("float32", 2, 32), ("bfloat16", 4, 16),
    ("complex128", 5, 128), ("bool", 6, 8), ("float8_e4m3fn", 10, 8), ("float8_e5m2", 12, 8),
    ("float4_e2m1fn", 17, 4),
])
def test_dtype_fields(name, code, bits):
    d = getattr(dlbridge, name)
    assert d.name == name and str(d) == name and repr(d) == f"dlbridge.{name}"
    assert d.code == code and d.bits == bits and d.lanes == 1
    assert dlbridge.DType(name) == d


@pytest.mark.parametrize("bad", ["nope", "float31", 3, None, object()])
def test_dtype_errors(bad):
    with pytest.raises(TypeError):
        dlbridge.DType(bad)


def test_device_objects():
    d = dlbridge.zeros(1).device
    assert d == "cpu" and str(d) == "cpu" and repr(d) == "dlbridge.Device('cpu')"
    assert d == dlbridge.Device("cpu") == dlbridge.Device((1, 0))
    assert d.type == "cpu" and d.index == 0
    assert d.__dlpack_device__() == (1, 0)
    assert hash(d) == hash("cpu")
    assert d != "cuda:0"
    with pytest.raises(ValueError):
        dlbridge.Device("foo")
    with pytest.raises(TypeError):
        dlbridge.Device(3.5)


# ---------------------------------------------------------------------------------------------
# repr and the command line.


def test_repr():
    # NumPy's form (tests/python/test_numpy_habits.py compares many more with NumPy's own).
    assert repr(dlbridge.arange(3)) == "Array([0, 1, 2])"  # int64 is implied, as in NumPy
    assert repr(dlbridge.arange(3, dtype="int32")) == "Array([0, 1, 2], dtype=int32)"
    assert repr(dlbridge.full((), 2.5)) == "Array(2.5, dtype=float32)"
    assert repr(dlbridge.asarray([[True], [False]])) == "Array([[ True],\n       [False]])"
    big = repr(dlbridge.zeros((100, 100)))
    assert "shape=(100, 100)" in big and "float32" in big and "..." in big and len(big) < 400
    assert repr(dlbridge.zeros((0, 3))) == "Array([], shape=(0, 3), dtype=float32)"
    # Views print their own elements.
    assert repr(dlbridge.arange(5)[::-2]) == "Array([4, 2, 0])"
    assert str(dlbridge.arange(5)[::-2]) == "[4 2 0]"


def test_info_command():
    out = subprocess.run([sys.executable, "-m", "dlbridge", "info"], capture_output=True,
                         text=True, timeout=60, check=True)
    text = out.stdout
    assert dlbridge.__version__ in text
    assert "DLPack 1." in text
    assert "backends" in text and "cpu" in text
    assert "devices" in text
    info = dlbridge.build_info()
    assert info["version"] == dlbridge.__version__
    assert tuple(info["dlpack_version"])[0] == 1
    assert "cpu" in info["devices"]


def test_info_command_usage_error():
    out = subprocess.run([sys.executable, "-m", "dlbridge", "bogus"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "usage" in out.stderr


def test_random_values_helper_is_seeded(rng):
    a = random_values(rng, (4,), np.int32)
    b = random_values(np.random.default_rng(20240607), (4,), np.int32)
    assert a.tolist() == b.tolist()
