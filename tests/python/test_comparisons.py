"""Element-wise comparisons: the operators ``== != < <= > >=`` of ``dlbridge.Array`` and
``dlbridge.ops.equal`` ... ``greater_equal``, on every available device, against NumPy on the same
inputs (NaN semantics, broadcasting, scalars on either side, type promotion).

CUDA and Metal cases skip with the reason where the device is missing.
"""

from __future__ import annotations

import operator

import numpy as np
import pytest

import dlbridge
from dlbridge import ops


DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
]

# (Python operator, dlbridge.ops function, NumPy function)
OPS = [
    (operator.eq, ops.equal, np.equal),
    (operator.ne, ops.not_equal, np.not_equal),
    (operator.lt, ops.less, np.less),
    (operator.le, ops.less_equal, np.less_equal),
    (operator.gt, ops.greater, np.greater),
    (operator.ge, ops.greater_equal, np.greater_equal),
]
OP_IDS = ["eq", "ne", "lt", "le", "gt", "ge"]


def skip_unsupported(device, dtype):
    if device.startswith("metal") and dtype == "float64":
        pytest.skip("Metal GPUs have no float64")


def data(rng, shape, dtype):
    """Values with many ties (small range), NaN and infinities for floats, as float64 or int."""
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.startswith("int") or dtype.startswith("uint"):
        lo = 0 if dtype.startswith("u") else -3
        x = rng.integers(lo, 4, size=shape).astype(dtype)
        info = np.iinfo(dtype)
        flat = x.reshape(-1)
        if flat.size > 2:
            flat[0], flat[1] = info.min, info.max
        return x
    x = rng.integers(-3, 4, size=shape) / 2.0
    flat = x.reshape(-1)
    if flat.size > 4:
        flat[0], flat[1], flat[2], flat[3] = np.nan, np.inf, -np.inf, -0.0
    return x


def put(x: np.ndarray, dtype: str, device: str) -> dlbridge.Array:
    if dtype == "bfloat16":
        return dlbridge.asarray(x.astype(np.float32), device=device).astype("bfloat16")
    return dlbridge.asarray(x.astype(dtype), device=device)


def get(a: dlbridge.Array) -> np.ndarray:
    assert str(a.dtype) == "bool", a.dtype
    return np.array(np.asarray(a.to("cpu")), copy=True)


def reference(x: np.ndarray, dtype: str) -> np.ndarray:
    """What the kernel sees (bfloat16 values are exact in float32 here)."""
    return x.astype(np.float32) if dtype == "bfloat16" else x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pyop,dlop,npop", OPS, ids=OP_IDS)
def test_arrays_broadcast_and_give_bool_like_numpy(device, dtype, pyop, dlop, npop, rng):
    skip_unsupported(device, dtype)
    a_np, b_np = data(rng, (3, 1, 5), dtype), data(rng, (4, 5), dtype)
    b_np.reshape(-1)[5:10] = a_np.reshape(-1)[:5]  # ties across the broadcast
    a, b = put(a_np, dtype, device), put(b_np, dtype, device)
    want = npop(reference(a_np, dtype), reference(b_np, dtype))
    for got in (pyop(a, b), dlop(a, b)):
        assert isinstance(got, dlbridge.Array)
        assert got.shape == (3, 4, 5) and str(got.device) == str(dlbridge.Device(device))
        np.testing.assert_array_equal(get(got), want)
    # A DLPack producer on the other side works too (CPU only: NumPy lives there).
    if device == "cpu" and dtype != "bfloat16":
        np.testing.assert_array_equal(get(dlop(a, reference(b_np, dtype))), want)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bool"])
@pytest.mark.parametrize("pyop,dlop,npop", OPS, ids=OP_IDS)
def test_scalars_on_either_side_follow_numpy(device, dtype, pyop, dlop, npop, rng):
    skip_unsupported(device, dtype)
    x_np = data(rng, (2, 7), dtype)
    x = put(x_np, dtype, device)
    ref = reference(x_np, dtype)
    for s in (1, -1, 0.5, 1.5, 300, -300, 10**6, 2**63 - 1):
        # NumPy 2's weak scalars: rounded to a float dtype (float16 overflows to inf), compared
        # by value with an integer dtype that cannot hold them.
        with np.errstate(over="ignore"):
            want_right, want_left = npop(ref, s), npop(s, ref)
        np.testing.assert_array_equal(get(pyop(x, s)), want_right, err_msg=f"x op {s!r}")
        np.testing.assert_array_equal(get(pyop(s, x)), want_left, err_msg=f"{s!r} op x")
        np.testing.assert_array_equal(get(dlop(s, x)), want_left, err_msg=f"ops({s!r}, x)")


def test_nan_is_unequal_to_everything_itself_included(device):
    x = dlbridge.asarray([np.nan, 1.0, np.inf], device=device)
    assert get(x == x).tolist() == [False, True, True]
    assert get(x != x).tolist() == [True, False, False]
    for op in (operator.lt, operator.le, operator.gt, operator.ge):
        assert get(op(x, float("nan"))).tolist() == [False, False, False]
    assert get(x != float("nan")).tolist() == [True, True, True]


def test_mixed_dtypes_promote_and_bool_compares(device):
    a = dlbridge.asarray(np.array([-1, 3, 100], dtype=np.int8), device=device)
    b = dlbridge.asarray(np.array([255, 3, 99], dtype=np.uint8), device=device)
    assert get(a < b).tolist() == [True, False, False]  # in int16: -1 < 255
    m = dlbridge.asarray([True, False, True], device=device)
    n = dlbridge.asarray([True, True, False], device=device)
    assert get(m == n).tolist() == [True, False, False]
    assert get(m > n).tolist() == [False, False, True]
    assert get(m == True).tolist() == [True, False, True]  # noqa: E712 (the operator is the test)
    assert get(m != 1).tolist() == [False, True, False]
    assert get(m < 2).tolist() == [True, True, True]
    f = dlbridge.asarray(np.array([1.0, 0.5, 2.0], dtype=np.float32), device=device)
    assert get(m == f).tolist() == [True, False, False]
    # Integers past int64 compare by value.
    assert get(a < 2**70).tolist() == [True, True, True]
    assert get(a == -(2**70)).tolist() == [False, False, False]
    # Views (reversed, transposed, broadcast) are read in place.
    x = dlbridge.asarray(np.arange(12, dtype=np.float32).reshape(3, 4), device=device)
    v = x[:, ::-1].T
    want = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::-1].T >= 6
    np.testing.assert_array_equal(get(v >= 6), want)
    np.testing.assert_array_equal(get(x[:1] == x), np.arange(12).reshape(3, 4) < 4)
    # 0-d and empty.
    assert get(dlbridge.asarray(2.0, device=device) > 1).tolist() is True
    assert get(x[:0] < 1).shape == (0, 4)


def test_unsupported_operands_return_notimplemented():
    a = dlbridge.asarray([1.0, 2.0])
    assert a.__eq__("text") is NotImplemented
    assert a.__lt__(object()) is NotImplemented
    # Python then falls back: identity for == and !=, TypeError for ordering.
    assert (a == "text") is False and (a != "text") is True
    assert (a == None) is False  # noqa: E711 (the operator is the test)
    with pytest.raises(TypeError):
        _ = a < "text"
    with pytest.raises(TypeError, match="complex"):
        _ = dlbridge.asarray([1 + 1j]) == dlbridge.asarray([1 + 1j])
    with pytest.raises(ValueError, match="broadcast"):
        _ = a == dlbridge.asarray([1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="Python numbers"):
        ops.equal(1, 2)


def test_arrays_are_unhashable_like_numpy():
    a = dlbridge.asarray([1, 2])
    assert type(a).__hash__ is None
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)
    with pytest.raises(TypeError):
        {a: 1}
    # Identity-based containers still work where they do for NumPy.
    assert a in [a]
    assert dlbridge.Array.__hash__ is None and np.ndarray.__hash__ is None


def test_comparison_results_feed_the_numpy_protocol():
    a = dlbridge.asarray(np.array([1.0, 5.0, 3.0], dtype=np.float32))
    mask = a > 2
    assert str(mask.dtype) == "bool"
    assert np.asarray(mask).tolist() == [False, True, True]
    assert int(np.count_nonzero(np.asarray(mask))) == 2
    assert bool(dlbridge.asarray([3]) == 3) is True
    with pytest.raises(TypeError, match="one element"):
        bool(a == a)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8", "uint32", "uint64", "bool"])
@pytest.mark.parametrize(
    "value", [2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1, 2**64, 2**100, -(2**63), -(2**63) - 1, -(2**100)]
)
def test_integers_beyond_int64_compare_exactly(device, dtype, value):
    info = np.iinfo(dtype) if dtype != "bool" else None
    values = [0, 1] if dtype == "bool" else [info.min, info.min + 1, 0, info.max - 1, info.max]
    host = np.array(values, dtype=dtype)
    a = dlbridge.asarray(host, device=device)
    for op in (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge):
        expected = [op(int(v), value) for v in values]
        assert op(a, value).to("cpu").tolist() == expected, (op.__name__, dtype, value)
        # Reflected: Python swaps the operands of `value < a` into `a > value`.
        assert op(value, a).to("cpu").tolist() == [op(value, int(v)) for v in values]
    # dlbridge.ops takes the scalar on either side too.
    assert ops.less(a, value).to("cpu").tolist() == [int(v) < value for v in values]
    assert ops.less(value, a).to("cpu").tolist() == [value < int(v) for v in values]
