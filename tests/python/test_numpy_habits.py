"""What NumPy users reach for, with NumPy's semantics, on every available device, checked against
NumPy itself on the same data: the operators ``// % **``; the methods ``all any argmax argmin
prod std var flatten ravel transpose``; ``ones`` and the ``*_like`` functions; integer-array and
boolean indexing and assignment; ``numpy.dtype(a.dtype)``; and ``repr`` / ``str`` as NumPy prints.

CUDA and Metal cases skip with the reason where the device is missing; Metal GPUs have no float64.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest

import dlbridge
from dlbridge import ops

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]


def on_metal(device: str) -> bool:
    return device.startswith("metal")


def skip_f64(device: str, *dtypes: str):
    if on_metal(device) and any(d in ("float64", "complex128") for d in dtypes):
        pytest.skip("Metal GPUs have no float64")


def put(x: np.ndarray, device: str) -> dlbridge.Array:
    return dlbridge.asarray(x, device=device)


def get(a: dlbridge.Array) -> np.ndarray:
    return np.array(np.asarray(a.to("cpu")), copy=True)


def same(got: dlbridge.Array, want, *, rtol: float = 0.0, atol: float = 0.0):
    """``got`` equals NumPy's ``want`` in dtype, shape and values (NaN matching NaN, the sign of
    zeros included when exact)."""
    want = np.asarray(want)
    g = get(got)
    assert g.dtype == want.dtype, (g.dtype, want.dtype)
    assert g.shape == want.shape, (g.shape, want.shape)
    if rtol or atol:
        np.testing.assert_allclose(g, want, rtol=rtol, atol=atol, equal_nan=True)
    else:
        np.testing.assert_array_equal(g, want)
        if g.dtype.kind == "f":
            zeros = (g == 0) & (want == 0)
            assert np.array_equal(np.signbit(g[zeros]), np.signbit(want[zeros])), "signs of zeros"


# ---------------------------------------------------------------------------------------------
# Operators // % **


def int_pairs(rng, dtype, n=501):
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    y = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    # Small divisors, zeros, -1 against the most negative value, and every sign combination.
    y[:40] = np.array([0, 1, 2, 3, 7] * 8, dtype=np.int64).astype(dtype)
    if info.min < 0:
        y[40:60] = -1
        x[40:50] = info.min
        y[60:80] = -3
        x[60:80] = np.arange(-10, 10)
    return x, y


@pytest.mark.parametrize("dtype", INTS)
def test_integer_floor_divide_and_remainder_match_numpy(device, dtype, rng):
    x, y = int_pairs(rng, dtype)
    a, b = put(x, device), put(y, device)
    with np.errstate(all="ignore"):
        same(a // b, x // y)
        same(a % b, x % y)
        same(ops.floor_divide(a, b), np.floor_divide(x, y))
        same(ops.remainder(a, b), np.remainder(x, y))
        same(ops.mod(a, b), np.mod(x, y))
        # Division by zero gives 0, as NumPy's values (NumPy warns; dlbridge does not).
        assert get(a // 0).tolist() == [0] * len(x)
        assert get(a % 0).tolist() == [0] * len(x)
        for s in (3, -3, 1):
            if s < 0 and dtype.startswith("u"):
                continue
            same(a // s, x // np.array(s, dtype=dtype))
            same(a % s, x % np.array(s, dtype=dtype))
            same(s // b, np.array(s, dtype=dtype) // y)
            same(s % b, np.array(s, dtype=dtype) % y)


@pytest.mark.parametrize("dtype", INTS)
def test_integer_powers_wrap_and_refuse_negative_exponents(device, dtype, rng):
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, size=300, dtype=dtype, endpoint=True)
    e = rng.integers(0, 70, size=300).astype(dtype)
    a, b = put(x, device), put(e, device)
    with np.errstate(all="ignore"):
        same(a**b, x**e)
        same(ops.pow(a, b), np.power(x, e))
        same(ops.power(a, 3), x ** np.array(3, dtype=dtype))
        same(2**b, np.array(2, dtype=dtype) ** e)
        same(a**0, np.ones_like(x))
    if info.min < 0:
        with pytest.raises(ValueError, match="negative integer powers"):
            a ** put(np.array([1, -1, 2], dtype=dtype)[:1].repeat(300) * -1, device)
        with pytest.raises(ValueError, match="negative integer powers"):
            a**-1
        with pytest.raises(ValueError, match="negative integer powers"):
            3 ** put(np.array([2, -2], dtype=dtype), device)
        with pytest.raises(ValueError):
            np.array([2], dtype=dtype) ** np.array([-1], dtype=dtype)  # NumPy raises the same
    # A Python float exponent computes in float64, as NumPy does.
    if not on_metal(device):
        with np.errstate(invalid="ignore"):
            same(a[:5] ** 0.5, x[:5] ** 0.5, rtol=1e-12)


SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 7.0, -7.0, 1e-3, -1e30, np.inf, -np.inf, np.nan, 3.0]


@pytest.mark.parametrize("dtype", FLOATS)
def test_float_floor_divide_remainder_and_power_match_numpy(device, dtype, rng):
    skip_f64(device, dtype)
    pairs = np.array(list(itertools.product(SPECIAL, SPECIAL)))
    with np.errstate(over="ignore"):  # -1e30 is -inf in float16
        x = np.concatenate([pairs[:, 0], rng.uniform(-50, 50, 500)]).astype(dtype)
        y = np.concatenate([pairs[:, 1], rng.uniform(-9, 9, 500)]).astype(dtype)
    a, b = put(x, device), put(y, device)
    with np.errstate(all="ignore"):
        same(a // b, x // y)
        same(a % b, x % y)
        same(ops.floor_divide(a, 0.75), x // np.array(0.75, dtype=dtype))
        same(2.5 % b, np.array(2.5, dtype=dtype) % y)
        tol = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-14}[dtype]
        same(abs(a) ** b, np.abs(x) ** y, rtol=tol)
        same(a**2, x**2, rtol=tol)
        same(2.0**b, np.array(2.0, dtype=dtype) ** y, rtol=tol)


def test_operators_follow_the_documented_promotion(device):
    i16 = put(np.array([7, -7], dtype=np.int16), device)
    u8 = put(np.array([2, 3], dtype=np.uint8), device)
    assert (i16 // u8).dtype == "int16" and (i16 % u8).dtype == "int16"
    assert (u8**u8).dtype == "uint8"
    h = put(np.array([1.5, -2.5], dtype=np.float16), device)
    assert (h**2).dtype == "float16" and (h // 1).dtype == "float16"
    if not on_metal(device):
        assert (i16 // 0.5).dtype == "float64"  # a Python float with an int array
    with pytest.raises(TypeError):
        pow(i16, 2, 3)  # NumPy's arrays take no modulo either
    with pytest.raises(TypeError):
        dlbridge.asarray([True]) // 2
    assert i16.__floordiv__("x") is NotImplemented


def test_views_broadcasting_and_zero_d_operands(device, rng):
    x = rng.integers(-20, 20, size=(6, 5)).astype(np.int32)
    y = rng.integers(1, 6, size=(5,)).astype(np.int32)
    a = put(x, device)[::-2, ::2]  # reversed, strided
    b = put(y, device)[::2]
    same(a // b, x[::-2, ::2] // y[::2])
    same(a % b, x[::-2, ::2] % y[::2])
    z = put(np.array(7, dtype=np.int32), device)
    same(z // 2, np.array(7, dtype=np.int32) // np.int32(2))
    e = put(np.zeros((0, 3), dtype=np.int32), device)
    assert (e // 2).shape == (0, 3) and (e**2).shape == (0, 3)


# ---------------------------------------------------------------------------------------------
# Reductions: prod, argmax, argmin, all, any, std, var.

AXES = [None, 0, 1, -1, (0, 2), (2, 0), (0, 1, 2)]


def np_reduce(name, x, axis, keepdims, **kw):
    if name in ("argmax", "argmin"):
        return getattr(np, name)(x, axis=axis, keepdims=keepdims)
    return getattr(np, name)(x, axis=axis, keepdims=keepdims, **kw)


@pytest.mark.parametrize("dtype", INTS + FLOATS)
@pytest.mark.parametrize("name", ["prod", "argmax", "argmin", "all", "any"])
def test_reductions_match_numpy(device, dtype, name, rng):
    skip_f64(device, dtype)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        x = rng.integers(max(info.min, -9), min(info.max, 9), size=(4, 5, 6), endpoint=True)
        x = x.astype(dtype)
    else:
        x = rng.uniform(-2, 2, size=(4, 5, 6)).astype(dtype)
        x[1, 2, 3] = 0
    x[0, 0, :2] = x[0, 0, 2]  # ties
    a = put(x, device)
    views = [(a, x), (a.transpose(2, 0, 1), x.transpose(2, 0, 1)), (a[::-1, :, 1::2], x[::-1, :, 1::2])]
    for (av, xv), axis, keepdims in itertools.product(views, AXES, [False, True]):
        if name.startswith("arg") and isinstance(axis, tuple):
            continue
        with np.errstate(all="ignore"):
            want = np_reduce(name, xv, axis, keepdims)
        got = getattr(av, name)(axis=axis, keepdims=keepdims)
        rtol = {"float16": 4e-3, "float32": 1e-5, "float64": 1e-12}.get(dtype, 0) if name == "prod" else 0
        if name == "prod" and dtype == "float16":
            want = np.prod(xv.astype(np.float32), axis=axis, keepdims=keepdims).astype(np.float16)
        same(got, want, rtol=rtol)
        assert get(getattr(ops, name)(av, axis=axis, keepdims=keepdims)).tolist() == get(got).tolist()


def test_prod_of_integers_wraps_in_64_bits(device):
    x = np.array([2**40, 2**40, 3], dtype=np.int64)
    same(put(x, device).prod(), np.prod(x))
    u = np.array([200, 200, 200], dtype=np.uint8)
    same(put(u, device).prod(), np.prod(u))  # uint64, as NumPy
    same(put(np.array([True, True]), device).prod(), np.prod(np.array([True, True])))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_argmax_and_argmin_find_the_first_nan(device, dtype):
    skip_f64(device, dtype)
    x = np.array([[1.0, np.nan, 3.0, np.nan], [5.0, 5.0, -1.0, -1.0], [np.nan, 0.0, 9.0, 9.0]], dtype=dtype)
    a = put(x, device)
    for name in ("argmax", "argmin"):
        for axis in (None, 0, 1, -1):
            same(getattr(a, name)(axis=axis), getattr(np, name)(x, axis=axis))
        assert getattr(a, name)().item() == 1


def test_arg_reductions_take_one_axis_and_refuse_empty(device):
    a = put(np.zeros((0, 3), dtype=np.float32), device)
    with pytest.raises(ValueError, match="empty sequence"):
        a.argmax()
    with pytest.raises(ValueError, match="empty sequence"):
        a.argmin(axis=0)
    assert a.argmax(axis=1).shape == (0,)  # as NumPy: nothing to reduce, nothing to fail
    with pytest.raises(TypeError, match="one axis"):
        put(np.ones((2, 2)), device).argmax(axis=(0, 1))
    z = put(np.array(5.0, dtype=np.float32), device)
    assert z.argmax().item() == 0 and z.argmax().dtype == "int64"


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int16", "uint8", "bool"])
def test_all_and_any_match_numpy(device, dtype, rng):
    skip_f64(device, dtype)
    x = rng.integers(0, 3, size=(3, 4, 5)).astype(dtype)
    if dtype.startswith("float"):
        x[0, 0, 0] = np.nan  # NaN is true
    x[1] = 1
    a = put(x, device)
    for axis, keepdims in itertools.product(AXES, [False, True]):
        for name in ("all", "any"):
            same(getattr(a, name)(axis=axis, keepdims=keepdims), getattr(np, name)(x, axis=axis, keepdims=keepdims))
    e = put(np.zeros((0, 2), dtype=dtype), device)
    same(e.all(), np.all(np.zeros((0, 2))))
    same(e.any(axis=0), np.any(np.zeros((0, 2)), axis=0))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "bool"])
@pytest.mark.parametrize("ddof", [0, 1, 2.5])
def test_var_and_std_match_numpy(device, dtype, ddof, rng):
    want_f64 = not dtype.startswith("float") or dtype == "float64"
    skip_f64(device, dtype if not want_f64 else "float64")
    x = (rng.uniform(-3, 3, size=(5, 6, 7)) * (10 if dtype == "int32" else 1)).astype(dtype)
    a = put(x, device)
    rtol = {"float16": 2e-3, "float32": 2e-5}.get(dtype, 1e-10)
    for axis, keepdims in itertools.product(AXES, [False, True]):
        for name in ("var", "std"):
            want = getattr(np, name)(x, axis=axis, ddof=ddof, keepdims=keepdims)
            same(getattr(a, name)(axis=axis, ddof=ddof, keepdims=keepdims), want, rtol=rtol)
    # The array API's `correction` is `ddof`.
    same(a.var(correction=ddof), np.var(x, ddof=ddof), rtol=rtol)
    same(ops.std(a, axis=1, ddof=ddof), np.std(x, axis=1, ddof=ddof), rtol=rtol)
    with pytest.raises(ValueError, match="ddof and correction"):
        a.var(ddof=1, correction=1)


def test_var_with_too_few_elements_gives_numpys_values(device):
    skip_f64(device, "float64")
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        x = np.arange(4.0)
        same(put(x, device).std(ddof=5), np.std(x, ddof=5))
        same(put(x, device).var(ddof=4), np.var(x, ddof=4))
        e = np.zeros((0,))
        same(put(e, device).var(), np.var(e))


# ---------------------------------------------------------------------------------------------
# argmax / argmin / var / std over long arrays and views: one pass over the data, in pieces merged
# in order (CPU) or split over many blocks and merged by a second kernel (CUDA): 2^24 + 17
# elements, so that a wrong merge fails.

LONG = 2**24 + 17


def np_dtype(name: str):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64", "uint64"]
)
def test_arg_reductions_of_long_arrays_find_the_first_extreme(device, dtype):
    skip_f64(device, dtype)
    npd = np_dtype(dtype)
    x = ((np.arange(LONG, dtype=np.int64) * 7919) % 40 + 1).astype(npd)  # 1..40, exact in all
    bottom = 0 if dtype.startswith("uint") else -100
    cases = [
        {LONG - 1: 100, LONG - 2: bottom},  # at the very end
        {0: 100, 1: bottom},  # at the very start
        # Ties far apart: the first wins.
        {LONG - 1: 100, LONG // 2 + 3: 100, 9_000_001: 100, LONG - 3: bottom, 4_000_000: bottom},
    ]
    if npd.kind == "f" or dtype == "bfloat16":
        cases += [
            {0: 100, 1: bottom, LONG - 1: np.nan, 12_345_678: np.nan, LONG - 9: np.inf},  # NaN first
            {LONG - 9: np.inf, 77: -np.inf, LONG - 2: np.inf},
        ]
    rows = 4095 * 4097
    for case in cases:
        y = x.copy()
        for i, v in case.items():
            y[i] = v
        a = put(y, device)
        ref = y.astype(np.float32) if dtype == "bfloat16" else y  # exact
        assert a.argmax().item() == np.argmax(ref), case
        assert a.argmin().item() == np.argmin(ref), case
        same(a.argmax(keepdims=True), np.argmax(ref, keepdims=True))
        m, am = ref[:rows].reshape(4095, 4097), a[:rows].reshape(4095, 4097)
        for axis in (0, 1):
            same(am.argmax(axis=axis), np.argmax(m, axis=axis))
            same(am.argmin(axis=axis), np.argmin(m, axis=axis))


@pytest.mark.parametrize(
    "dtype, offset, rtol",
    [
        ("float32", 1000.0, 1e-5),
        ("float64", 1e6, 1e-10),
        ("float16", 2.0, 4e-3),
        ("bfloat16", 2.0, 2e-2),
        ("int32", 1e6, 1e-10),
        ("uint8", 100.0, 1e-10),
    ],
)
def test_var_and_std_of_long_arrays_are_accurate(device, dtype, offset, rtol, rng):
    # Far from 0, where E[x²] - E[x]² in float32 would lose every digit.
    npd = np_dtype(dtype)
    skip_f64(device, "float64" if npd.kind in "iu" else dtype)
    x = (offset + rng.uniform(-50, 50, LONG)).astype(npd)
    a = put(x, device)
    exact = x.astype(np.float64)
    want_dtype = np.dtype(np.float64) if npd.kind in "iu" else npd
    for ddof in (0, 1):
        want = np.var(exact, ddof=ddof)
        got = a.var(ddof=ddof)
        assert get(got).dtype == want_dtype
        np.testing.assert_allclose(float(got.item()), want, rtol=rtol)
        np.testing.assert_allclose(float(a.std(ddof=ddof).item()), np.sqrt(want), rtol=rtol)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int16", "uint8"])
def test_arg_reductions_var_and_std_of_views_match_numpy(device, dtype, rng):
    skip_f64(device, "float64" if dtype[0] in "iu" else dtype)
    if dtype.startswith(("int", "uint")):
        x = rng.integers(0, 9, size=(6, 7, 9)).astype(dtype)
    else:
        x = rng.uniform(-5, 5, size=(6, 7, 9)).astype(dtype)
        x[2, 3, 4] = np.nan
    x[0, 0, :3] = x[0, 0, 3]  # ties
    a = put(x, device)
    views = [
        (a.transpose(2, 0, 1), x.transpose(2, 0, 1)),
        (a[::-2, :, 1::3], x[::-2, :, 1::3]),
        (a[:, 2:3].broadcast_to((6, 5, 9)), np.broadcast_to(x[:, 2:3], (6, 5, 9))),
    ]
    rtol = {"float16": 2e-3, "float32": 2e-5}.get(dtype, 1e-10)
    for (av, xv), axis, keepdims in itertools.product(views, AXES, [False, True]):
        with np.errstate(all="ignore"):
            for name in ("var", "std"):
                want = getattr(np, name)(xv, axis=axis, ddof=1, keepdims=keepdims)
                # Along the broadcast axis the deviations are 0: NumPy's rounding is not.
                got = getattr(av, name)(axis=axis, ddof=1, keepdims=keepdims)
                atol = (1e-4 if dtype == "float16" else 1e-6) if name == "var" else 1e-2
                same(got, want, rtol=rtol, atol=atol)
        if isinstance(axis, tuple):
            continue
        for name in ("argmax", "argmin"):
            same(getattr(av, name)(axis=axis, keepdims=keepdims), getattr(np, name)(xv, axis=axis, keepdims=keepdims))


def test_long_selections_match_numpy(device, rng):
    # A mask over every axis and one index array into a 1-d array: single elements copied in one
    # pass (in parallel on the CPU), strided views, several chunks, every index dtype.
    n = 300_007
    x = rng.standard_normal(n).astype(np.float32)
    a = put(x, device)
    for m in (x > 0, np.zeros(n, dtype=bool), np.ones(n, dtype=bool)):
        same(a[dlbridge.asarray(m, device=device)], x[m])
    s, xs = a[::-3], x[::-3]
    ms = xs > 0.5
    same(s[dlbridge.asarray(ms, device=device)], xs[ms])
    x2 = x[: 600 * 500].reshape(600, 500)
    m2 = x2 > 0.25
    same(a[: 600 * 500].reshape(600, 500)[dlbridge.asarray(m2, device=device)], x2[m2])
    idx = rng.integers(-n, n, size=100_000)
    for dt in ("int64", "int32", "uint32"):
        i = idx if dt != "uint32" else idx % n
        i = i.astype(dt)
        same(a[i], x[i])
        same(a[dlbridge.asarray(i)], x[i])
        same(s[i % len(xs)], xs[i % len(xs)])
    same(a[idx.reshape(250, 400)], x[idx.reshape(250, 400)])
    bad = idx.copy()
    bad[90_000] = n
    bad[50_000] = -n - 1
    with pytest.raises(IndexError, match=f"index {-n - 1} is out of bounds for axis 0 with size {n}"):
        a[bad]


def test_bool_arrays_reduce_as_numpy(device):
    m = np.array([[True, False, True], [True, True, False]])
    a = put(m, device)
    for name in ("sum", "max", "min", "prod"):
        same(getattr(a, name)(), getattr(np, name)(m))
        same(getattr(a, name)(axis=0), getattr(np, name)(m, axis=0))
    if not on_metal(device):
        same(a.mean(axis=1), np.mean(m, axis=1))


def test_reductions_write_out(device):
    a = put(np.arange(6, dtype=np.float32).reshape(2, 3), device)
    out = dlbridge.zeros((3,), dtype="int64", device=device)
    assert a.argmax(axis=0, out=out) is out
    assert get(out).tolist() == [1, 1, 1]
    flags = dlbridge.zeros((2,), dtype="bool", device=device)
    a.any(axis=1, out=flags)
    assert get(flags).tolist() == [True, True]


# ---------------------------------------------------------------------------------------------
# flatten, ravel, transpose.


def test_ravel_is_a_view_when_it_can_be_and_flatten_always_copies(device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = put(x, device)
    r = a.ravel()
    assert r.shape == (12,) and r.data_ptr == a.data_ptr and r._buffer_ref_count > 1
    r[0] = 100.0  # a view: the write shows in `a`
    assert get(a)[0, 0] == 100.0
    f = a.flatten()
    assert f.shape == (12,) and f.data_ptr != a.data_ptr
    f[1] = -5.0
    assert get(a)[0, 1] == 1.0
    t = a.T.ravel()  # a transposed view cannot be raveled in place: a copy, NumPy's order
    same(t, np.ravel(get(a).T))
    same(ops.ravel(a.T), np.ravel(get(a).T))
    assert put(np.array(3.0), device).ravel().shape == (1,)
    with pytest.raises(ValueError, match="order"):
        a.ravel("F")


def test_transpose_takes_numpys_arguments(device):
    x = np.arange(24).reshape(2, 3, 4)
    a = put(x, device)
    same(a.transpose(), x.transpose())
    same(a.transpose(1, 0, 2), x.transpose(1, 0, 2))
    same(a.transpose((2, 0, 1)), x.transpose((2, 0, 1)))
    same(a.transpose([-1, 0, 1]), x.transpose([-1, 0, 1]))
    same(ops.transpose(a, (0, 2, 1)), np.transpose(x, (0, 2, 1)))
    assert a.transpose().data_ptr == a.data_ptr  # a view
    with pytest.raises(ValueError, match="axes don't match"):
        a.transpose(0, 1)
    with pytest.raises(IndexError):
        a.transpose(0, 1, 3)


# ---------------------------------------------------------------------------------------------
# Creation: ones and the *_like functions.


def test_ones_and_like_functions(device):
    o = dlbridge.ones((2, 3), device=device)
    assert o.dtype == "float32" and o.device == dlbridge.Device(device) and get(o).tolist() == [[1.0] * 3] * 2
    assert get(dlbridge.ones(3, dtype="int8", device=device)).tolist() == [1, 1, 1]
    src = put(np.arange(6, dtype=np.int16).reshape(2, 3), device)
    for fn, want in [(dlbridge.zeros_like, 0), (dlbridge.ones_like, 1)]:
        r = fn(src)
        assert (r.shape, r.dtype, r.device) == ((2, 3), "int16", src.device)
        assert get(r).tolist() == [[want] * 3] * 2
    f = dlbridge.full_like(src, 7)
    assert f.dtype == "int16" and get(f).tolist() == [[7] * 3] * 2
    f = dlbridge.full_like(src, 2.5, dtype="float32", shape=(4,))
    assert (f.dtype, f.shape) == ("float32", (4,)) and get(f).tolist() == [2.5] * 4
    e = dlbridge.empty_like(src, dtype="uint8")
    assert (e.shape, e.dtype, e.device) == ((2, 3), "uint8", src.device)
    moved = dlbridge.zeros_like(src, device="cpu")
    assert moved.device == "cpu"
    # Any array NumPy takes: a NumPy array, a list.
    assert dlbridge.ones_like(np.zeros((2, 2), np.float64)).dtype == "float64"
    assert dlbridge.zeros_like([1, 2, 3]).dtype == "int64"
    with pytest.raises(TypeError, match="fill_value"):
        dlbridge.full_like(src, "x")
    if on_metal(device):
        shared = dlbridge.zeros((2,), device=device, storage="shared")
        assert dlbridge.ones_like(shared).storage == "shared"


# ---------------------------------------------------------------------------------------------
# Indexing with integer arrays and masks.


def index_cases(x: np.ndarray):
    """Keys NumPy defines, as (name, key built from a module `m` of arrays)."""
    n0, n1 = x.shape[0], x.shape[1]
    mask0 = (np.arange(n0) % 2 == 0)
    return [
        ("list", lambda m: [0, 2, -1, 0]),
        ("array", lambda m: m.asarray(np.array([1, 0, 1]))),
        ("2-d index", lambda m: m.asarray(np.array([[0, 1], [2, 0]]))),
        ("mask", lambda m: m.asarray(mask0)),
        ("full mask", lambda m: m.asarray(x > 5)),
        ("2-d mask", lambda m: m.asarray((x > 3)[:, :, 0])),
        ("slice, list", lambda m: (slice(None), [1, 3])),
        ("two lists", lambda m: ([0, 1], [1, 2])),
        ("broadcast lists", lambda m: ([[0], [1]], [0, 2])),
        ("int, slice, list", lambda m: (0, slice(None), [1, 2])),
        ("slice, int, list", lambda m: (slice(None), 0, [1, 2])),
        ("list, ellipsis, list", lambda m: ([0, 1], Ellipsis, [1, 2])),
        ("list, None, list", lambda m: ([0, 1], None, [1, 2])),
        ("reversed slice, mask", lambda m: (slice(None, None, -1), m.asarray(np.arange(n1) != 1))),
        ("empty list", lambda m: []),
        ("negative", lambda m: (-1, [-1, -2])),
        ("ellipsis, list", lambda m: (Ellipsis, [0, 0, 1])),
        ("True", lambda m: True),
        ("False, slice", lambda m: (False, slice(1, None))),
        ("0-d mask, list", lambda m: (m.asarray(np.array(True)), slice(None), [0, 1])),
        ("list, True", lambda m: ([1, 0], True)),
    ]


def test_advanced_indexing_matches_numpy(device, rng):
    x = rng.integers(-9, 9, size=(4, 5, 3)).astype(np.int32)
    a = put(x, device)
    for name, key in index_cases(x):
        want = x[key(np)]
        got = a[key(dlbridge)]
        same(got, want)
        # A copy, as in NumPy: writing it leaves `a` alone.
        if got.size:
            got[...] = 99
            assert np.array_equal(get(a), x), name


def test_advanced_assignment_matches_numpy(device, rng):
    x = rng.integers(-9, 9, size=(4, 5, 3)).astype(np.float32)
    for name, key in index_cases(x):
        want = x.copy()
        a = put(x, device)
        want[key(np)] = -1.5
        a[key(dlbridge)] = -1.5
        same(a, want)
        # Values broadcast to the selection.
        sel = x[key(np)]
        values = np.arange(sel.shape[-1] if sel.ndim else 1, dtype=np.float32) + 100
        want = x.copy()
        a = put(x, device)
        want[key(np)] = values
        a[key(dlbridge)] = dlbridge.asarray(values, device=device) if device != "cpu" else values
        same(a, want)
    # The mask idiom, and repeated indices: the last write wins, as in NumPy.
    y = np.arange(10.0, dtype=np.float32)
    b = put(y, device)
    b[b > 4] = 0
    y[y > 4] = 0
    same(b, y)
    b[[1, 1, 2]] = dlbridge.asarray([7.0, 8.0, 9.0])
    y[[1, 1, 2]] = [7.0, 8.0, 9.0]
    same(b, y)


def test_indexing_errors_are_numpys(device):
    a = put(np.arange(12).reshape(3, 4), device)
    with pytest.raises(IndexError, match="index 5 is out of bounds for axis 0 with size 3"):
        a[[0, 5]]
    with pytest.raises(IndexError, match="boolean index did not match indexed array along axis 0"):
        a[dlbridge.asarray([True, False])]
    with pytest.raises(IndexError, match="integer"):
        a[[0.5]]
    with pytest.raises(IndexError, match="broadcast"):
        a[[0, 1], [0, 1, 2]]
    with pytest.raises(IndexError, match="too many indices"):
        a[[0], [0], [0]]
    with pytest.raises(ValueError, match="broadcast"):
        a[[0, 1]] = dlbridge.asarray([1, 2, 3])
    with pytest.raises(IndexError, match="out of bounds"):
        a[[7]] = 0
    assert get(a).tolist() == np.arange(12).reshape(3, 4).tolist()  # nothing was written


def test_random_advanced_keys_match_numpy(rng):
    # The class: random shapes and random mixes of integers, slices, lists and masks.
    for trial in range(300):
        shape = tuple(int(n) for n in rng.integers(1, 5, size=rng.integers(1, 4)))
        x = rng.integers(-100, 100, size=shape)
        key = []
        for n in shape:
            kind = rng.integers(0, 5)
            if kind == 0:
                key.append(int(rng.integers(-n, n)))
            elif kind == 1:
                key.append(slice(int(rng.integers(0, n)), None, int(rng.choice([1, 2, -1]))))
            elif kind == 2:
                key.append(rng.integers(-n, n, size=int(rng.integers(0, 4))).tolist())
            elif kind == 3:
                key.append(rng.integers(0, 2, size=n).astype(bool))
            else:
                key.append(slice(None))
        key = tuple(key)
        try:
            want = x[key]
        except IndexError:
            with pytest.raises(IndexError):
                dlbridge.asarray(x)[tuple(dlbridge.asarray(k) if isinstance(k, np.ndarray) else k for k in key)]
            continue
        dkey = tuple(dlbridge.asarray(k) if isinstance(k, np.ndarray) else k for k in key)
        got = dlbridge.asarray(x)[dkey]
        assert np.array_equal(get(got), want) and get(got).shape == want.shape, (shape, key)


# ---------------------------------------------------------------------------------------------
# NumPy's dtype.

ALL_DTYPES = ["bool", *INTS, "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
              "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_numpy_dtype_of_a_dlbridge_dtype(name):
    pytest.importorskip("ml_dtypes")
    d = dlbridge.DType(name)
    nd = np.dtype(d)
    assert nd.name == name and nd.itemsize == d.itemsize
    assert np.zeros(2, dtype=d).dtype == nd
    a = dlbridge.zeros((2,), dtype=name)
    assert np.dtype(a.dtype) == nd and a.dtype.itemsize == nd.itemsize
    assert np.asarray(a).dtype == nd


# ---------------------------------------------------------------------------------------------
# repr and str as NumPy prints them.

PRINTED = [
    np.array([0.1, 0.2, 0.3], dtype=np.float32),
    np.array([[0.1, 1.5, -2.25], [3.0, np.nan, 1e-3]], dtype=np.float32),
    np.array(1.5, dtype=np.float32),
    np.array(1.0),
    np.array(7),
    np.array(True),
    np.array([True, False]),
    np.zeros((2, 0)),
    np.array([], dtype=np.float32),
    np.array([1e-5, 1.5, np.nan, -np.inf]),
    np.array([1e20, 1.0]),
    np.array([1 + 2j, 3.5 - 1j], dtype=np.complex64),
    np.array([[1e-9 + 1j], [-2.5 - 0j]]),
    np.arange(24).reshape(2, 3, 4).astype(np.uint8),
    np.arange(2000).reshape(2, 1000),
    np.arange(1001),
    np.arange(-5, 5, dtype=np.int64) * 10**15,
    np.linspace(0, 1, 30).reshape(3, 10),
    np.full((3, 3), np.inf),
    np.array([-0.0, 0.0, 100.0, 1234567.0], dtype=np.float32),
    np.array([123456789.0, 0.5], dtype=np.float64),
    np.array([0.999999999, 1e-8]),
    np.array([65504.0, 0.0001, 1.0], dtype=np.float16),
]


def printed_cases(rng):
    cases = list(PRINTED)
    for dtype in ["float16", "float32", "float64", "int8", "uint16", "int64"]:
        for shape in [(5,), (3, 4), (2, 3, 4), (40, 40), (1, 1, 1, 7), (3000,), (11, 101)]:
            if dtype.startswith("float"):
                scale = 10.0 ** rng.integers(-6, 9)
                with np.errstate(over="ignore"):  # large scales overflow float16: infinities
                    x = (rng.standard_normal(shape) * scale).astype(dtype)
            else:
                x = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, size=shape, dtype=dtype)
            cases.append(x)
    return cases


def dlbridge_repr_of(np_repr: str) -> str:
    return "Array" + np_repr[len("array"):]


def test_repr_and_str_match_numpy(rng):
    for x in printed_cases(rng):
        a = dlbridge.asarray(x)
        assert repr(a) == dlbridge_repr_of(repr(x)), f"\n{repr(a)}\n{repr(x)}"
        assert str(a) == str(x), f"\n{str(a)}\n{str(x)}"


@pytest.mark.parametrize(
    "options",
    [
        {"linewidth": 40},
        {"threshold": 10, "edgeitems": 2},
        {"precision": 3},
        {"suppress": True},
        {"floatmode": "fixed", "precision": 4},
        {"floatmode": "unique"},
        {"floatmode": "maxprec_equal"},
        {"sign": "+"},
        {"sign": " "},
        {"nanstr": "NaN", "infstr": "Inf"},
    ],
)
def test_repr_follows_numpys_print_options(options, rng):
    cases = [
        rng.standard_normal((4, 9)).astype(np.float32),
        np.array([1e-7, 3.25, np.nan, -np.inf, 0.0]),
        np.arange(30).reshape(5, 6) - 10,
        np.array([1.5 - 2j, -0.25 + 1e-9j]),
    ]
    with np.printoptions(**options):
        for x in cases:
            a = dlbridge.asarray(x)
            assert repr(a) == dlbridge_repr_of(repr(x)), f"{options}\n{repr(a)}\n{repr(x)}"
            assert str(a) == str(x), f"{options}\n{str(a)}\n{str(x)}"


def test_repr_of_each_float_type_uses_its_own_digits():
    # The issue: float32 printed float64's digits on one line.
    a = dlbridge.asarray([0.1, 0.2], dtype="float32")
    assert repr(a) == "Array([0.1, 0.2], dtype=float32)"
    h = dlbridge.asarray([0.1, 1000.0], dtype="float16")
    assert repr(h) == "Array([1.e-01, 1.e+03], dtype=float16)" == dlbridge_repr_of(repr(np.array([0.1, 1000.0], np.float16)))
    b = dlbridge.asarray([0.1, 1.5, 2.0], dtype="float32").astype("bfloat16")
    assert repr(b) == "Array([0.1, 1.5, 2. ], dtype=bfloat16)"
    assert str(b[0]) == "0.1"
    assert str(dlbridge.asarray(np.float32(1e20))) == str(np.float32(1e20)) == "1e+20"
    assert str(dlbridge.asarray(np.array(0.1, dtype=np.float32))) == "0.1"
    assert str(dlbridge.asarray(np.array(1 + 2j))) == str(np.array(1 + 2j)) == "(1+2j)"


def test_large_arrays_print_their_edges(device, rng):
    x = rng.standard_normal(1_000_000).astype(np.float32)
    a = put(x, device)
    want = dlbridge_repr_of(repr(x))
    if device != "cpu":
        # NumPy's rule for what follows the values: on the last line when it fits the line
        # width, else on a line of its own, indented under the values.
        body, extras = want[: want.index(" shape=")], want[want.index(" shape=") + 1 : -1]
        extras += f", device='{a.device}'"
        last = body[body.rfind("\n") + 1 :]
        fits = len(last) + len(extras) + 1 <= np.get_printoptions()["linewidth"]
        want = body + (" " if fits else "\n" + " " * len("Array(")) + extras + ")"
    assert repr(a) == want
    assert "..." in repr(a) and "shape=(1000000,)" in repr(a)


def test_device_arrays_name_their_device(device):
    if device == "cpu":
        pytest.skip("the CPU's arrays have no device= in their repr, as NumPy's")
    a = dlbridge.asarray(np.array([1.5, 2.5], dtype=np.float32), device=device)
    assert repr(a) == f"Array([1.5, 2.5], dtype=float32, device='{a.device}')"
    assert str(a) == "[1.5 2.5]"


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "bool"])
def test_isnan_isinf_isfinite_match_numpy(device, dtype):
    skip_f64(device, dtype)
    x = np.array([0.0, -1.5, np.nan, np.inf, -np.inf, 3.0]) if dtype.startswith("float") else np.arange(6) % 2
    x = x.astype(dtype)
    a = put(x, device)
    for name in ("isnan", "isinf", "isfinite"):
        same(getattr(ops, name)(a), getattr(np, name)(x))
