"""The built-in kernels (``dlbridge.ops``, operators, reductions, matmul) on every available
device, against NumPy computed in float64 on the same (fresh, random) inputs.

CUDA and Metal cases skip with the reason where the device is missing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import dlbridge
from dlbridge import ops


FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
# Relative error bounds per dtype (a few units in the last place, after float64 reference).
RTOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "float64": 1e-12}


def skip_unsupported(device, dtype):
    if device.startswith("metal") and dtype == "float64":
        pytest.skip("Metal GPUs have no float64")


def put(x: np.ndarray, dtype: str, device: str) -> dlbridge.Array:
    """``x`` as a dlbridge array of ``dtype`` on ``device`` (bfloat16 made from float32)."""
    if dtype == "bfloat16":
        return dlbridge.asarray(x.astype(np.float32), device=device).astype("bfloat16")
    return dlbridge.asarray(x.astype(dtype), device=device)


def get(a: dlbridge.Array) -> np.ndarray:
    """A host NumPy copy of ``a`` (bfloat16 read as float32)."""
    if str(a.dtype) == "bfloat16":
        a = a.astype("float32")
    return np.array(np.asarray(a.to("cpu")), copy=True)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and back to float64 (what the kernel really received)."""
    if dtype == "bfloat16":
        return get(put(x, "bfloat16", "cpu")).astype(np.float64)
    return x.astype(dtype).astype(np.float64)


def close(got: dlbridge.Array, want: np.ndarray, dtype: str, scale: float = 1.0):
    g = get(got).astype(np.float64)
    assert g.shape == want.shape
    rtol = RTOL[dtype]
    np.testing.assert_allclose(g, want, rtol=rtol, atol=rtol * scale, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# Element-wise, floating.

UNARY_DOMAIN = {
    "sqrt": (0.0, 9.0),
    "log": (0.05, 9.0),
    "exp": (-4.0, 4.0),
    "sin": (-6.0, 6.0),
    "cos": (-6.0, 6.0),
    "abs": (-9.0, 9.0),
    "square": (-9.0, 9.0),
    "negative": (-9.0, 9.0),
}
NUMPY_UNARY = {"negative": np.negative, "square": np.square, "abs": np.abs}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", sorted(UNARY_DOMAIN))
def test_unary_floats_match_numpy(device, dtype, name, rng):
    skip_unsupported(device, dtype)
    lo, hi = UNARY_DOMAIN[name]
    x = rng.uniform(lo, hi, size=(37, 29))
    a = put(x, dtype, device)
    out = getattr(ops, name)(a)
    assert str(out.dtype) == dtype and out.device == a.device and out.shape == (37, 29)
    want = NUMPY_UNARY.get(name, getattr(np, name))(rounded(x, dtype))
    close(out, want, dtype, scale=1.0 if name != "square" else 81.0)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
def test_binary_floats_match_numpy(device, dtype, name, rng):
    skip_unsupported(device, dtype)
    x = rng.uniform(-4, 4, size=(1031,))
    y = rng.uniform(0.5, 4, size=(1031,)) * rng.choice([-1, 1], size=1031)
    out = getattr(ops, name)(put(x, dtype, device), put(y, dtype, device))
    fn = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[name]
    close(out, fn(rounded(x, dtype), rounded(y, dtype)), dtype, scale=4.0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_broadcasting_and_strided_views(device, dtype, rng):
    x = rng.uniform(-2, 2, size=(6, 1, 10))
    y = rng.uniform(-2, 2, size=(3, 4, 8))
    a = put(x, dtype, device)[::2, :, ::-3]  # (3, 1, 4): strided, reversed, broadcast axis
    b = put(y, dtype, device).permute(0, 2, 1)  # (3, 8, 4): transposed
    out = ops.mul(a, b)
    assert out.shape == (3, 8, 4) and out.is_contiguous
    close(out, rounded(x, dtype)[::2, :, ::-3] * rounded(y, dtype).transpose(0, 2, 1), dtype, scale=4.0)
    # A row broadcast against a column.
    r, c = rng.uniform(-1, 1, size=(7,)), rng.uniform(-1, 1, size=(5, 1))
    out = ops.add(put(r, dtype, device), put(c, dtype, device))
    assert out.shape == (5, 7)
    close(out, rounded(r, dtype) + rounded(c, dtype), dtype)
    # 0-d operands.
    z = ops.sub(put(np.array(3.0), dtype, device), put(np.array(1.0), dtype, device))
    assert z.shape == () and float(z) == 2.0


def test_scalars_are_weak_and_both_orders_work(device, rng):
    x = rng.uniform(1, 3, size=(9,))
    a = put(x, "float16", device)
    out = 2.5 - a
    assert str(out.dtype) == "float16"
    close(out, 2.5 - rounded(x, "float16"), "float16", scale=3)
    close(a / 2, rounded(x, "float16") / 2, "float16")
    close(3 * a, 3 * rounded(x, "float16"), "float16", scale=9)
    i = put(np.arange(6), "int32", device)
    f = i * 0.5  # a Python float with an int array: float64, as NumPy
    assert str(f.dtype) == "float64" or device.startswith("metal")
    assert get(i + 1).tolist() == list(range(1, 7))
    assert get(10 - i).tolist() == [10 - k for k in range(6)]


def test_operators(device, rng):
    x, y = rng.uniform(1, 2, size=(4, 4)), rng.uniform(1, 2, size=(4, 4))
    a, b = put(x, "float32", device), put(y, "float32", device)
    for got, want in [
        (a + b, x + y),
        (a - b, x - y),
        (a * b, x * y),
        (a / b, x / y),
        (-a, -x),
        (abs(-a), x),
        (a @ b, x @ y),
        (a + 1.0, x + 1),
        (1.0 / a, 1 / x),
    ]:
        close(got, want.astype(np.float32).astype(np.float64), "float32", scale=8)


# ---------------------------------------------------------------------------------------------
# Element-wise, integers.


@pytest.mark.parametrize("dtype", INTS)
def test_integer_arithmetic_wraps_like_numpy(device, dtype, rng):
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, size=257, dtype=dtype, endpoint=True)
    y = rng.integers(info.min, info.max, size=257, dtype=dtype, endpoint=True)
    a, b = put(x, dtype, device), put(y, dtype, device)
    with np.errstate(over="ignore"):
        for got, want in [
            (ops.add(a, b), x + y),
            (ops.sub(a, b), x - y),
            (ops.mul(a, b), x * y),
            (ops.negative(a), np.negative(x)),
            (ops.square(a), np.square(x)),
            (ops.abs(a), np.abs(x)),
        ]:
            assert str(got.dtype) == dtype
            np.testing.assert_array_equal(get(got), want)


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int32", "int64"])
def test_integer_division_and_functions_give_floats(device, dtype, rng):
    if device.startswith("metal") and dtype in ("int32", "int64"):
        pytest.skip("int32/int64 / and sqrt give float64, which Metal GPUs lack")
    x = rng.integers(1, 100, size=50).astype(dtype)
    y = rng.integers(1, 9, size=50).astype(dtype)
    q = ops.div(put(x, dtype, device), put(y, dtype, device))
    assert str(q.dtype) == "float64"
    np.testing.assert_allclose(get(q), x / y, rtol=1e-12)
    s = ops.sqrt(put(x, dtype, device))
    want = np.sqrt(x)
    assert str(s.dtype) == str(want.dtype)
    np.testing.assert_allclose(get(s).astype(np.float64), want.astype(np.float64), rtol=RTOL[str(want.dtype)])


def test_mixed_dtypes_promote(device):
    a = put(np.arange(4), "int16", device)
    b = put(np.arange(4), "uint8", device)
    assert str((a + b).dtype) == "int16"
    c = put(np.arange(4), "int8", device)
    assert str((c + b).dtype) == "int16"
    f = put(np.arange(4) / 2, "float32", device)
    assert str((a + f).dtype) == "float32"
    np.testing.assert_allclose(get(a + f), np.arange(4) * 1.5)


# ---------------------------------------------------------------------------------------------
# Reductions.


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 2), (1,)])
@pytest.mark.parametrize("name", ["sum", "mean", "max", "min"])
def test_reductions_float(device, dtype, axis, name, rng):
    skip_unsupported(device, dtype)
    x = rng.uniform(-1, 1, size=(7, 13, 5))
    a = put(x, dtype, device)
    out = getattr(ops, name)(a, axis=axis)
    xr = rounded(x, dtype)
    want = getattr(np, {"max": "max", "min": "min", "sum": "sum", "mean": "mean"}[name])(xr, axis=axis)
    want = np.asarray(want)
    assert str(out.dtype) == dtype
    n = x.size if axis is None else math.prod(x.shape[i] for i in ((axis,) if isinstance(axis, int) else axis))
    scale = math.sqrt(n) if name == "sum" else 1.0
    close(out, want, dtype, scale=scale)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape, axis", [((64, 3000), 0), ((16, 4, 2000), 1), ((3, 5000), 0)])
@pytest.mark.parametrize("name", ["sum", "max"])
def test_reductions_over_wide_kept_axes(device, dtype, shape, axis, name, rng):
    # Kept rows wider than one block of widened half-precision elements (1024): every column
    # gets its own total (a regression: columns past the first block once folded into the first).
    skip_unsupported(device, dtype)
    x = rng.uniform(-1, 1, size=shape)
    out = getattr(ops, name)(put(x, dtype, device), axis=axis)
    want = getattr(np, name)(rounded(x, dtype), axis=axis)
    scale = math.sqrt(shape[axis]) if name == "sum" else 1.0
    close(out, want, dtype, scale=scale)


def test_reductions_keepdims_and_strided(device, rng):
    x = rng.uniform(-1, 1, size=(9, 8, 6))
    a = put(x, "float32", device)[::-2, 1::3, :].permute(2, 0, 1)  # (6, 5, 3)
    xv = rounded(x, "float32")[::-2, 1::3, :].transpose(2, 0, 1)
    out = a.sum(axis=(0, 2), keepdims=True)
    assert out.shape == (1, 5, 1)
    close(out, xv.sum(axis=(0, 2), keepdims=True), "float32", scale=4)
    close(a.max(axis=1), xv.max(axis=1), "float32")
    close(a.mean(), np.asarray(xv.mean()), "float32")


def test_many_axes_that_do_not_merge(device, rng):
    # 18 axes whose reversed order keeps any two from merging: more axes, on each side of the
    # reduction too, than the GPU kernels walk (CUDA 6, Metal 8), so the backends copy first.
    perm = tuple(reversed(range(18)))
    x, y = rng.uniform(-1, 1, size=(2,) * 18), rng.uniform(-1, 1, size=(2,) * 18)
    a = put(x, "float32", device).permute(*perm)
    b = put(y, "float32", device)
    xv, yv = rounded(x, "float32").transpose(perm), rounded(y, "float32")
    close(a + b, xv + yv, "float32")
    close(ops.multiply(a, 2.0), xv * 2.0, "float32")
    every_other = tuple(range(0, 18, 2))
    close(a.sum(axis=every_other), xv.sum(axis=every_other), "float32", scale=8)
    close(a.max(axis=every_other), xv.max(axis=every_other), "float32")
    close(b.mean(axis=every_other), yv.mean(axis=every_other), "float32")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64", "uint64"])
def test_integer_reductions(device, dtype, rng):
    x = rng.integers(0, 100, size=(33, 17)).astype(dtype)
    a = put(x, dtype, device)
    s = ops.sum(a, axis=0)
    want_dtype = "uint64" if dtype.startswith("u") else "int64"
    assert str(s.dtype) == want_dtype
    np.testing.assert_array_equal(get(s), x.sum(axis=0, dtype=want_dtype))
    np.testing.assert_array_equal(get(ops.max(a, axis=1)), x.max(axis=1))
    np.testing.assert_array_equal(get(ops.min(a)), x.min())
    if not device.startswith("metal"):
        m = ops.mean(a, axis=1)
        assert str(m.dtype) == "float64"
        np.testing.assert_allclose(get(m), x.mean(axis=1), rtol=1e-12)


def test_reductions_propagate_nan_and_handle_empty(device):
    a = put(np.array([1.0, np.nan, 3.0]), "float32", device)
    assert math.isnan(float(ops.max(a))) and math.isnan(float(ops.min(a)))
    e = put(np.zeros((0, 3)), "float32", device)
    assert get(ops.sum(e, axis=0)).tolist() == [0.0, 0.0, 0.0]
    assert math.isnan(float(ops.mean(e)))
    with pytest.raises(ValueError, match="empty"):
        ops.max(e)
    with pytest.raises(ValueError, match="identity"):
        ops.min(e, axis=0)
    assert ops.sum(e, axis=1).shape == (0,)


def test_large_sum_is_accurate(device, rng):
    x = rng.uniform(0, 1, size=1 << 22).astype(np.float32)
    got = float(ops.sum(dlbridge.asarray(x, device=device)))
    want = float(x.astype(np.float64).sum())
    assert abs(got - want) / want < 1e-5


# ---------------------------------------------------------------------------------------------
# matmul.


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "sa,sb",
    [((33, 17), (17, 9)), ((2, 3, 4, 5), (5, 6)), ((4,), (4, 3)), ((3, 4), (4,)), ((6,), (6,)), ((1, 5, 0), (0, 2))],
)
def test_matmul_matches_numpy(device, dtype, sa, sb, rng):
    skip_unsupported(device, dtype)
    x, y = rng.uniform(-1, 1, size=sa), rng.uniform(-1, 1, size=sb)
    out = ops.matmul(put(x, dtype, device), put(y, dtype, device))
    want = np.asarray(np.matmul(rounded(x, dtype), rounded(y, dtype)))
    assert out.shape == want.shape and str(out.dtype) == dtype
    k = sa[-1]
    close(out, want, dtype, scale=max(1.0, math.sqrt(k)))


def test_matmul_with_an_empty_batch(device):
    a = dlbridge.zeros((2, 0, 3, 4), device=device)
    out = ops.matmul(a, dlbridge.zeros((4, 5), device=device))
    assert out.shape == (2, 0, 3, 5)


def test_matmul_transposed_and_broadcast_batch(device, rng):
    x, y = rng.uniform(-1, 1, size=(3, 7, 5)), rng.uniform(-1, 1, size=(6, 7))
    a = put(x, "float32", device).permute(0, 2, 1)  # (3, 5, 7), column-major matrices
    b = put(y, "float32", device).T  # (7, 6)
    out = a @ b
    close(out, rounded(x, "float32").transpose(0, 2, 1) @ rounded(y, "float32").T, "float32", scale=3)
    s = put(rng.uniform(-1, 1, size=(8, 12)), "float32", device)[::2, ::3]  # not BLAS-compatible
    t = put(rng.uniform(-1, 1, size=(4, 2)), "float32", device)
    close(s @ t, get(s).astype(np.float64) @ get(t).astype(np.float64), "float32", scale=2)


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_bad_input_names_the_problem(device):
    a = put(np.ones((3, 4)), "float32", device)
    with pytest.raises(ValueError, match="broadcast"):
        ops.add(a, put(np.ones((5,)), "float32", device))
    with pytest.raises(TypeError, match="uint64"):
        ops.add(put(np.ones(3), "uint64", device), put(np.ones(3), "int8", device))
    with pytest.raises(TypeError):
        ops.sqrt(dlbridge.asarray([True, False], device=device))
    with pytest.raises(TypeError, match="matmul"):
        ops.matmul(put(np.ones((2, 2)), "int32", device), put(np.ones((2, 2)), "int32", device))
    with pytest.raises(ValueError, match="contracted"):
        ops.matmul(a, a)
    with pytest.raises(IndexError, match="axis"):
        ops.sum(a, axis=2)
    with pytest.raises(TypeError):
        ops.add(a, "x")
    with pytest.raises(TypeError):
        ops.add(1, 2)
    assert a.__add__("x") is NotImplemented
    # The backend stays usable.
    assert get(a + 1).tolist() == [[2.0] * 4] * 3


@pytest.mark.skipif(not dlbridge.cuda.is_available(), reason="needs a CUDA GPU for two devices")
def test_arrays_on_different_devices_are_refused():
    a = dlbridge.zeros((3,))
    b = dlbridge.zeros((3,), device="cuda:0")
    with pytest.raises(ValueError, match="different devices"):
        ops.add(a, b)


def test_operands_from_other_libraries_are_used_in_place(device):
    x = np.arange(6, dtype=np.float32)
    if device == "cpu":
        out = ops.add(x, x)  # NumPy arrays through DLPack, no copy on import
        assert get(out).tolist() == (2 * x).tolist()
