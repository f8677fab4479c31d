"""What a new user meets: exceptions from Python-callable kernels keep their tracebacks (raised
with ``raise_errors=True``, in the failed result's ``error`` otherwise), copies dlbridge makes are
dlbridge's memory (``Backend.free`` takes them), messages name the right thing, and slices clamp
huge bounds as Python and NumPy do.
"""

from __future__ import annotations

import numpy as np
import pytest

import dlbridge

CUDA = pytest.mark.skipif(
    not dlbridge.cuda.is_available(),
    reason=f"no CUDA GPU: {dlbridge.cuda.unavailable_reason() or 'no CUDA device'}",
)


# ---------------------------------------------------------------------------------------------
# Python-callable kernels.


def _raising_kernel(x):
    raise KeyError("from inside the kernel")


def test_a_callable_kernels_exception_propagates_with_its_traceback():
    """Asked for (``raise_errors=True``; by default it is a failed result, test_backend.py)."""
    be = dlbridge.Backend("cpu")
    a = be.allocate_zeros((3,))
    with pytest.raises(KeyError, match="from inside the kernel") as raised:
        be.execute_kernel(_raising_kernel, 1, 1, a, raise_errors=True)
    assert raised.traceback[-1].name == "_raising_kernel"
    # A kernel that works still reports a result.
    res = be.execute_kernel(lambda x: x.sum(), 1, 1, a)
    assert res.success and res.error is None and float(res.output) == 0.0


@CUDA
def test_a_callable_kernels_exception_propagates_on_cuda():
    be = dlbridge.Backend("cuda:0")
    a = be.allocate_zeros((3,))
    with pytest.raises(KeyError, match="from inside the kernel") as raised:
        be.execute_kernel(_raising_kernel, 1, 1, a, raise_errors=True)
    assert raised.traceback[-1].name == "_raising_kernel"
    res = be.execute_kernel(lambda x: x + 1, 1, 1, a)
    assert res.success and res.output.tolist() == [1.0] * 3


# ---------------------------------------------------------------------------------------------
# Copies dlbridge makes are its own memory.


def _copies(device):
    src = np.arange(5, dtype=np.float32)
    be = dlbridge.Backend(device)
    return src, be, {
        "copy_to_device": be.copy_to_device(src),
        "asarray(copy=True)": dlbridge.asarray(src, device=device, copy=True),
        "from_dlpack(copy=True)": dlbridge.from_dlpack(src, device=device, copy=True),
        "asarray(memoryview, copy=True)": dlbridge.asarray(memoryview(src), device=device, copy=True),
    }


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=CUDA)])
def test_copies_are_new_dlbridge_memory_that_free_takes(device):
    src, be, copies = _copies(device)
    for what, arr in copies.items():
        assert not arr.is_foreign, what
        if device == "cpu":
            assert arr.data_ptr != src.ctypes.data, what
        assert arr.tolist() == src.tolist(), what
        be.free(arr)  # refused (BufferError) for foreign memory
        with pytest.raises(ValueError, match="freed"):
            arr.tolist()
    # An import without a copy stays the producer's, and free refuses it.
    shared = dlbridge.from_dlpack(src)
    assert shared.is_foreign
    with pytest.raises(BufferError, match="another library owns"):
        be.free(shared)


def test_copies_of_dlbridge_arrays_and_conversions_are_dlbridge_memory():
    a = dlbridge.asarray([1.0, 2.0])
    for arr in (
        dlbridge.asarray(a, copy=True),
        dlbridge.from_dlpack(a, copy=True),
        dlbridge.asarray(np.ones(3), dtype="float32", copy=True),
    ):
        assert not arr.is_foreign and arr.data_ptr != a.data_ptr
        dlbridge.Backend("cpu").free(arr)


# ---------------------------------------------------------------------------------------------
# Messages.


@pytest.mark.skipif(dlbridge.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_backend_unavailable_says_so_once():
    with pytest.raises(dlbridge.BackendUnavailableError) as raised:
        dlbridge.Backend("cuda")
    message = str(raised.value)
    assert message.count("CUDA backend not available") == 1, message
    assert dlbridge.cuda.unavailable_reason() in message
    assert "not available" not in dlbridge.cuda.unavailable_reason()


def test_an_index_out_of_bounds_names_its_axis_and_size():
    c = dlbridge.zeros((3, 4))
    with pytest.raises(IndexError, match=r"^index 4 is out of bounds for axis 1 with size 4$"):
        c[0, 4]
    with pytest.raises(IndexError, match=r"^index -5 is out of bounds for axis 1 with size 4$"):
        c[1, -5]
    with pytest.raises(IndexError, match=r"^index 3 is out of bounds for axis 0 with size 3$"):
        c[3]
    with pytest.raises(IndexError, match="axis 1 with size 4"):
        c[..., 9]
    with pytest.raises(IndexError, match="axis 1 with size 4"):
        c[None, 0, 7]
    with pytest.raises(IndexError, match="axis 2 with size 5"):
        dlbridge.zeros((2, 3, 5))[1, :, 5]


def test_reshape_refusal_shows_the_shape_as_written():
    a = dlbridge.zeros(12)
    with pytest.raises(ValueError, match=r"cannot reshape 12 elements into shape \(-1, 5\)"):
        a.reshape(-1, 5)
    with pytest.raises(ValueError, match=r"cannot reshape 12 elements into shape \(5,\)"):
        a.reshape(5)
    assert "None" not in _message(lambda: a.reshape(-1, 7))


def _message(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def test_a_negative_device_index_is_named_as_such():
    with pytest.raises(ValueError, match="a device index cannot be negative") as raised:
        dlbridge.Device("cuda:-1")
    assert "not a number" not in str(raised.value)
    with pytest.raises(ValueError, match="not a number"):
        dlbridge.Device("cuda:one")


@pytest.mark.parametrize("name", ["empty", "zeros", "full", "arange", "asarray"])
def test_creation_docstrings_say_the_default_float_is_float32(name):
    doc = getattr(dlbridge, name).__doc__
    assert "float32" in doc and "float64" in doc, doc


# ---------------------------------------------------------------------------------------------
# Slices and indices past 64 bits.


@pytest.mark.parametrize(
    "key",
    [
        slice(-(2**70), 2**70),
        slice(2**70, None),
        slice(None, -(2**70)),
        slice(None, None, 2**70),
        slice(None, None, -(2**70)),
        slice(2**70, -(2**70), -1),
        slice(-(2**70), 2**70, 3),
        slice(1, 2**64, 2**63),
        slice(-(2**63), 2**63 - 1),
    ],
)
def test_huge_slice_bounds_and_steps_clamp_like_numpy(key):
    x = np.arange(10)
    a = dlbridge.asarray(x)
    assert a[key].tolist() == x[key].tolist()
    assert a[:, None][key, 0].tolist() == x[:, None][key, 0].tolist()


def test_zero_step_and_huge_integer_indices_raise_what_numpy_raises():
    a = dlbridge.asarray(np.arange(10))
    with pytest.raises(ValueError, match="slice step cannot be zero"):
        a[::0]
    for i in (2**70, -(2**70), 2**63):
        with pytest.raises(IndexError, match="out of bounds for axis 0 with size 10"):
            a[i]
    with pytest.raises(IndexError):
        a[np.int64(10)]
    assert a[np.int64(-1)].tolist() == 9
    with pytest.raises(TypeError, match="slice indices must be integers"):
        a[1.5:]
