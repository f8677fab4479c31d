"""NumPy's protocols on ``dlbridge.Array``: the keywords NumPy's functions pass to the reduction
methods (``np.sum(a)`` calls ``a.sum(axis=None, out=None)``), ``__array__``'s ``dtype`` and
``copy``, ufuncs with ``out=``, and bfloat16 / float8 arrays through ``ml_dtypes``.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import dlbridge


@pytest.fixture
def a():
    return dlbridge.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))


def test_numpy_reductions_call_the_methods_with_their_keywords(a):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert float(np.sum(a)) == 15.0
    got = np.sum(a, axis=0, keepdims=True)
    assert isinstance(got, dlbridge.Array) and got.shape == (1, 3)
    np.testing.assert_array_equal(np.asarray(got), np.sum(x, axis=0, keepdims=True))
    np.testing.assert_array_equal(np.asarray(np.mean(a, axis=1)), np.mean(x, axis=1))
    assert float(np.max(a)) == 5.0 and float(np.min(a)) == 0.0
    np.testing.assert_array_equal(np.asarray(np.max(a, axis=(0, 1), keepdims=True)), [[5.0]])
    # dtype= computes in and returns that dtype.
    s = np.sum(a, dtype=np.float64)
    assert str(s.dtype) == "float64" and float(s) == 15.0
    small = dlbridge.asarray(np.array([100, 100, 100], dtype=np.int8))
    assert str(np.sum(small).dtype) == "int64" and int(np.sum(small)) == 300
    assert int(np.sum(small, dtype=np.int8)) == np.sum(np.array([100] * 3, np.int8), dtype=np.int8)
    assert str(np.mean(small, dtype=np.float32).dtype) == "float32"


def test_out_receives_the_result_and_is_returned(a):
    out = np.empty((), np.float64)
    assert np.sum(a, out=out) is out and out == 15.0
    rows = np.empty(2, np.float32)
    assert np.max(a, axis=1, out=rows) is rows and rows.tolist() == [2.0, 5.0]
    mine = dlbridge.zeros((3,), "float64")
    assert a.mean(axis=0, out=mine) is mine and mine.tolist() == [1.5, 2.5, 3.5]
    with pytest.raises(ValueError, match=r"out has shape \(3,\) but the result has shape \(2,\)"):
        np.sum(a, axis=1, out=mine)
    with pytest.raises(TypeError, match="out must be"):
        a.sum(out=[0.0])
    readonly = np.zeros(())
    readonly.flags.writeable = False
    with pytest.raises((ValueError, BufferError, TypeError)):
        np.sum(a, out=readonly)
    # Keywords with no meaning here are refused clearly, not ignored.
    with pytest.raises(TypeError, match="where"):
        np.sum(a, where=np.ones((2, 3), bool))
    with pytest.raises(TypeError, match="initial"):
        np.max(a, initial=0.0)


def test_array_protocol_dtype_and_copy(a):
    as64 = np.asarray(a, dtype=np.float64)
    assert as64.dtype == np.float64 and as64.tolist() == [[0, 1, 2], [3, 4, 5]]
    same = np.asarray(a)
    assert same.ctypes.data == a.data_ptr  # zero-copy
    assert np.asarray(a, dtype=np.float32).ctypes.data == a.data_ptr
    copied = np.array(a, copy=True)
    assert copied.ctypes.data != a.data_ptr
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(a, dtype=np.float64, copy=False)
    assert np.asarray(a, copy=False).ctypes.data == a.data_ptr


def test_ufuncs_take_numpy_out_arrays(a):
    b = dlbridge.asarray(np.ones((2, 3), np.float32))
    out = np.empty((2, 3), np.float32)
    assert np.add(a, b, out=out) is out
    assert out.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert np.multiply(a, 2, out=out) is out and out[1, 2] == 10


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_minifloats_reach_numpy_through_ml_dtypes_without_copies(dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    src = dlbridge.asarray(np.array([0.5, -2.0, 3.0, 1.0], np.float32)).astype(dtype)
    view = np.asarray(src)
    assert view.dtype == np.dtype(getattr(ml_dtypes, dtype))
    assert view.ctypes.data == src.data_ptr  # zero-copy
    assert view.astype(np.float32).tolist() == [0.5, -2.0, 3.0, 1.0]
    view[0] = 4.0  # a write on one side is seen on the other
    assert src.astype("float32").tolist()[0] == 4.0
    # Strided views too.
    assert np.asarray(src[::2]).astype(np.float32).tolist() == [4.0, 3.0]
    assert np.asarray(src, dtype=np.float32).tolist() == [4.0, -2.0, 3.0, 1.0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_numpy_minifloat_arrays_import_without_copies(dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([[1.0, 2.0], [0.5, -1.0]], np.float32).astype(getattr(ml_dtypes, dtype))
    for a in (dlbridge.asarray(x), dlbridge.from_dlpack(x)):
        assert str(a.dtype) == dtype and a.shape == (2, 2)
        assert a.data_ptr == x.ctypes.data  # zero-copy
        assert a.astype("float32").tolist() == [[1.0, 2.0], [0.5, -1.0]]
    t = dlbridge.asarray(x.T)
    assert t.strides == (1, 2) and t.astype("float32").tolist() == [[1.0, 0.5], [2.0, -1.0]]
    c = dlbridge.asarray(x, copy=True)
    assert c.data_ptr != x.ctypes.data and not c.is_foreign


def test_without_ml_dtypes_the_error_says_to_install_it(monkeypatch):
    b = dlbridge.asarray([1.0, 2.0]).astype("bfloat16")
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    with pytest.raises(TypeError, match=r"install ml_dtypes"):
        np.asarray(b)
