"""The example PyO3 extension on dlbridge-pyo3 (examples/pyo3-ext, built by scripts/test.sh):
every accepted input kind, every constraint violation, borrows, lifetime, deleter counts, and
return values imported by each framework. CUDA cases run on a CUDA device."""

from __future__ import annotations

import array
import gc
import weakref

import numpy as np
import pytest

ext = pytest.importorskip(
    "dlbridge_pyo3_ext", reason="the example extension is not built (scripts/test.sh builds it)"
)
torch = pytest.importorskip("torch")


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


needs_cuda = pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")


def notes(err: BaseException) -> str:
    """The exception's message and PyO3's 'while processing' note, which names the argument."""
    return str(err) + " ".join(getattr(err, "__notes__", []))


# --- accepted input kinds, zero copy ------------------------------------------------------------


def test_numpy_zero_copy_and_write_seen():
    x = np.arange(4, dtype=np.float32)
    assert ext.data_ptr(x) == x.ctypes.data
    y = np.zeros(4, np.float32)
    ext.axpy(2.0, x, y)
    np.testing.assert_array_equal(y, 2 * x)


def test_numpy_strided_layouts():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for view in (x, x.T, x[:, ::-1], x[::2, 1::2], x[::-1]):
        assert ext.total(view) == pytest.approx(float(view.sum()))
    assert ext.data_ptr(x[:, ::-1]) == x[:, ::-1].ctypes.data


def test_numpy_non_native_byte_order_goes_through_dlpack():
    x = np.arange(3, dtype=">f4")
    with pytest.raises(BufferError):
        ext.total(x)


def test_torch_zero_copy_and_write_seen():
    x = torch.arange(4, dtype=torch.float32)
    assert ext.data_ptr(x) == x.data_ptr()
    y = torch.zeros(4)
    ext.axpy(1.0, x, y)
    assert torch.equal(y, x)


def test_torch_strided_layouts_zero_d_and_empty():
    # PyTorch tensors are read from the descriptor their exchange table fills (no export): each
    # view's element zero is the tensor's own data pointer, and every layout reads its values.
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for view in (x, x.T, x[::2, 1::2], x[1:], x[:, 1:3], x.expand(2, 3, 4)):
        assert ext.total(view) == pytest.approx(float(view.sum()))
        assert ext.data_ptr(view) == view.data_ptr()
    assert ext.total(torch.tensor(3.0)) == 3.0
    assert ext.total(torch.empty(0)) == 0.0
    assert ext.total(torch.empty(3, 0)) == 0.0


def test_torch_lazy_bits_refused():
    # The exchange table describes a conjugated or negated view's raw memory without saying so:
    # those are refused before their memory is read, with the way out named.
    z = torch.tensor([1 + 2j, 3 + 4j])
    with pytest.raises(BufferError, match="conjugate"):
        ext.total(z.conj())
    negated = z.conj().imag  # a real tensor with the negative bit set
    assert negated.is_neg() and negated.dtype == torch.float32
    for x in (negated, negated.detach()):
        with pytest.raises(BufferError, match="negative bit"):
            ext.total(x)
    assert ext.total(negated.resolve_neg()) == pytest.approx(-6.0)


def test_torch_floor_asks_what_the_table_does_not_say():
    # The benchmark's floor row (PyTorch's own share of a call) does the work a correct consumer
    # cannot skip: the table hands out plain, negated and grad-requiring tensors alike.
    plain = torch.arange(4.0)
    assert ext.torch_floor(plain) == 0.0
    assert ext.torch_floor(plain._neg_view()) == 1.0
    assert ext.torch_floor(torch.arange(4.0, requires_grad=True)) == 1.0


def test_jax_input():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    # `total` takes host arrays; JAX puts new arrays on its default device, a GPU where it has one,
    # so both arrays are committed to the CPU.
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.arange(6, dtype=jnp.float32).reshape(2, 3), cpu)
    assert ext.total(x) == 15.0
    assert ext.total(jax.device_put(x.T, cpu)) == 15.0


def test_mlx_input():
    mx = pytest.importorskip("mlx.core")
    x = mx.arange(5, dtype=mx.float32)
    assert ext.total(x) == 10.0


def test_jax_array_refused_for_mutable_access():
    """JAX arrays are immutable (XLA may share or donate their buffers): a mutable borrow is
    refused, the array is unchanged, and reading stays zero-copy."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    cpu = jax.devices("cpu")[0]
    y = jax.device_put(jnp.zeros(3, dtype=jnp.float32), cpu)
    with pytest.raises(ValueError, match="argument 'y': expected a writable array, got a read-only one"):
        ext.axpy(1.0, np.ones(3, np.float32), y)
    assert np.asarray(y).tolist() == [0.0, 0.0, 0.0]
    assert ext.data_ptr(y) == y.unsafe_buffer_pointer()
    assert ext.total(y) == 0.0


def test_mlx_array_writable_as_its_own_buffer_protocol_says():
    """MLX is not immutable by contract: its buffer protocol hands out writable memory and its
    documentation shows writes through a NumPy view reaching the array. A mutable borrow is
    allowed and the write is seen, as through MLX's own memoryview."""
    mx = pytest.importorskip("mlx.core")
    y = mx.zeros(3, dtype=mx.float32)
    mx.eval(y)
    assert not memoryview(y).readonly
    ext.axpy(2.0, np.ones(3, np.float32), y)
    assert y.tolist() == [2.0, 2.0, 2.0]


# --- NumPy arrays of ml_dtypes types (bfloat16, the 8-bit floats) -------------------------------

ML_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
             "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu"]
# Representable in every one of them (float8_e8m0fnu holds powers of two only).
ML_VALUES = [[0.25, 0.5, 1.0], [2.0, 4.0, 8.0]]


def ml_array(name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not hasattr(ml_dtypes, name):
        pytest.skip(f"this ml_dtypes has no {name}")
    return np.array(ML_VALUES, dtype=np.float32).astype(getattr(ml_dtypes, name))


class NumPySubclass(np.ndarray):
    pass


@pytest.mark.parametrize("name", ML_DTYPES)
def test_ml_dtypes_numpy_arrays_zero_copy(name):
    """NumPy's own DLPack export refuses these types; dlbridge.from_dlpack takes them through
    their bytes, and so does an extension's argument: shape, dtype, values, no copy."""
    x = ml_array(name)
    assert ext.describe(x) == ([2, 3], name)
    assert ext.data_ptr(x) == x.ctypes.data
    assert ext.to_float32(x).tolist() == ML_VALUES
    for view in (x[:, ::-2], x.T, x[1:]):
        assert ext.describe(view) == (list(view.shape), name)
        assert ext.data_ptr(view) == view.ctypes.data
        assert ext.to_float32(view).tolist() == view.astype(np.float32).tolist()
    sub = x.view(NumPySubclass)  # not the struct path: through the array's bytes
    assert ext.describe(sub) == ([2, 3], name)
    assert ext.data_ptr(sub) == x.ctypes.data
    with pytest.raises(TypeError, match=f"argument 'x': expected an array of float32, got {name}"):
        ext.total(x)
    # dlbridge.from_dlpack, on the same implementation, agrees (float8_e5m2, which ml_dtypes
    # gives NumPy kind 'f' where the others have 'V', was refused by both).
    dlbridge = pytest.importorskip("dlbridge")
    for source in (x, sub, x[:, ::-2]):
        a = dlbridge.from_dlpack(source)
        assert a.dtype == name and a.data_ptr == source.ctypes.data
        assert a.astype("float32").tolist() == source.astype(np.float32).tolist()


def test_bfloat16_written_in_place_seen_by_numpy():
    x = ml_array("bfloat16")
    ext.scale_bf16(x, 2.0)
    assert x.astype(np.float32).tolist() == [[0.5, 1.0, 2.0], [4.0, 8.0, 16.0]]
    strided = x[:, ::2]
    ext.scale_bf16(strided, 0.5)
    assert x.astype(np.float32).tolist() == [[0.25, 1.0, 1.0], [2.0, 8.0, 8.0]]
    x.flags.writeable = False
    with pytest.raises(ValueError, match="argument 'x': expected a writable array"):
        ext.scale_bf16(x, 2.0)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_ml_dtypes_returned_to_numpy(name):
    """A returned array of such a type becomes a NumPy array of the ml_dtypes type (NumPy's own
    from_dlpack refuses it), sharing the tensor's memory."""
    ml_array(name)  # skips where ml_dtypes lacks the type
    out = ext.cast(np.array(ML_VALUES, np.float32), name, "numpy")
    assert isinstance(out, np.ndarray) and out.dtype.name == name
    assert out.astype(np.float32).tolist() == ML_VALUES


def test_dlbridge_array_through_its_exchange_table():
    dlbridge = pytest.importorskip("dlbridge")
    base = np.arange(5, dtype=np.float32)
    a = dlbridge.asarray(base)
    assert ext.total(a) == 10.0
    assert ext.data_ptr(a) == base.ctypes.data


def test_buffer_protocol_inputs():
    data = array.array("f", [1, 2, 3])
    assert ext.total(data) == 6.0
    assert ext.total(memoryview(data)) == 6.0
    ext.axpy(1.0, np.ones(3, np.float32), data)
    assert list(data) == [2, 3, 4]


def test_capsule_input_and_used_capsule():
    capsule = np.arange(3, dtype=np.float32).__dlpack__()
    assert ext.total(capsule) == 3.0
    with pytest.raises(BufferError, match="already consumed"):
        ext.total(capsule)


# --- constraint violations ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["abc", 3, None, [1.0, 2.0], object()])
def test_not_an_array(bad):
    with pytest.raises(TypeError, match="expected an array") as err:
        ext.total(bad)
    assert "'x'" in notes(err.value)


def test_wrong_dtype():
    with pytest.raises(TypeError, match="argument 'x': expected an array of float32, got float64"):
        ext.total(np.ones(3))
    with pytest.raises(TypeError, match="argument 'x'"):
        ext.total(torch.ones(3, dtype=torch.int32))


def test_wrong_rank_and_shape():
    with pytest.raises(ValueError, match="argument 'x': expected 1 axis, got 2"):
        ext.first(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"argument 'm': expected shape \(\?, 3\), got \(3, 2\)"):
        ext.row_sums(np.ones((3, 2)))


def test_non_contiguous_refused_where_required():
    with pytest.raises(ValueError, match="argument 'x': expected a C-contiguous array"):
        ext.first(np.ones(6, np.float32)[::2])
    with pytest.raises(ValueError, match="argument 'm': expected a C-contiguous"):
        ext.row_sums(np.ones((3, 3)).T)


def test_read_only_refused_for_mutable_access():
    r = np.ones(3, np.float32)
    r.flags.writeable = False
    with pytest.raises(ValueError, match="argument 'y': expected a writable array, got a read-only one"):
        ext.axpy(1.0, np.ones(3, np.float32), r)
    with pytest.raises(ValueError, match="argument 'y'"):
        ext.axpy(1.0, np.ones(3, np.float32), memoryview(bytes(12)).cast("f"))


def test_device_refused():
    with pytest.raises(ValueError, match="argument 'x': expected an array on cuda, got one on cpu"):
        ext.scale_cuda(torch.ones(3), 2.0)


def test_requires_grad_refused():
    with pytest.raises(BufferError, match="requires grad"):
        ext.total(torch.ones(3, requires_grad=True))


# --- borrows ------------------------------------------------------------------------------------


def test_overlapping_mutable_borrows_refused():
    z = np.ones(4, np.float32)
    with pytest.raises(BufferError, match="argument 'y': cannot borrow the array mutably"):
        ext.axpy(1.0, z, z)
    with pytest.raises(BufferError, match="argument 'y'"):
        ext.axpy(1.0, z[:2], z[1:3])
    # Disjoint halves of one array are fine.
    ext.axpy(1.0, z[:2], z[2:])
    np.testing.assert_array_equal(z, [1, 1, 2, 2])


def test_held_borrow_blocks_writers_until_released():
    z = np.ones(4, np.float32)
    held = ext.hold(z)
    with pytest.raises(BufferError):
        ext.axpy(1.0, np.ones(2, np.float32), z[2:])
    # Shared borrows do not conflict with each other.
    assert ext.total(z) == 4.0
    held.release()
    ext.axpy(1.0, np.ones(2, np.float32), z[2:])
    np.testing.assert_array_equal(z, [1, 1, 2, 2])


def test_borrows_are_released_after_errors():
    z = np.ones(3, np.float32)
    with pytest.raises(ValueError):
        ext.axpy(1.0, np.ones(2, np.float32), z)  # length mismatch, after both borrows
    ext.axpy(1.0, np.ones(3, np.float32), z)


def test_registry_is_shared_in_sys_modules():
    import sys

    ext.total(np.ones(1, np.float32))
    assert "registry_v1" in dir(sys.modules["_dlbridge_borrows"])


# --- lifetime and deleters ----------------------------------------------------------------------


def test_producer_kept_alive_while_rust_holds_the_view():
    x = torch.arange(4, dtype=torch.float32)
    alive = weakref.ref(x)
    held = ext.hold(x)
    del x
    gc.collect()
    assert alive() is not None
    assert held.total() == 6.0
    held.release()
    gc.collect()
    assert alive() is None


def test_numpy_kept_alive_through_struct_path():
    x = np.arange(4, dtype=np.float32)
    base_refs = __import__("sys").getrefcount(x)
    held = ext.hold(x)
    assert __import__("sys").getrefcount(x) == base_refs + 1
    held.release()
    assert __import__("sys").getrefcount(x) == base_refs


def test_capsule_deleter_runs_exactly_once():
    x = np.arange(3, dtype=np.float32)
    before = __import__("sys").getrefcount(x)
    for _ in range(50):
        ext.total(x.__dlpack__())
    gc.collect()
    assert __import__("sys").getrefcount(x) == before


def test_returned_tensor_deleter_runs_once_per_consumer():
    t = ext.arange(8)
    views = [np.from_dlpack(t) for _ in range(10)]
    assert all(v.ctypes.data == views[0].ctypes.data for v in views)
    del views
    gc.collect()
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(8, dtype=np.float32))


# --- return values ------------------------------------------------------------------------------


def test_returned_tensor_protocol():
    t = ext.arange(3)
    assert t.__dlpack_device__() == (1, 0)
    assert type(t).__dlpack_c_exchange_api__ is not None
    assert t.shape == [3] and t.dtype == "float32" and t.device == "cpu"


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax", "dlbridge"])
def test_returned_to_framework(framework):
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax", "dlbridge": "dlbridge"}[framework])
    out = ext.arange(5, framework)
    np.testing.assert_array_equal(np.asarray(out), np.arange(5, dtype=np.float32))
    assert type(out).__module__.split(".")[0] in {"numpy", "torch", "jaxlib", "jax", "dlbridge"}


def test_returned_zero_copy_write_seen():
    t = ext.arange(4)
    a = torch.from_dlpack(t)
    b = np.from_dlpack(t)
    a[0] = 42
    assert b[0] == 42
    assert a.data_ptr() == b.ctypes.data


def test_returned_goes_back_into_an_argument():
    assert ext.total(ext.arange(4)) == 6.0


def test_unknown_framework():
    with pytest.raises(ValueError, match="unknown framework"):
        ext.arange(3, "tensorflow")


def test_cupy_needs_cuda():
    cupy = pytest.importorskip("cupy", reason="needs a CUDA device")
    if not _cuda_available():
        pytest.skip("needs a CUDA device")
    x = cupy.ones(4, dtype=cupy.float32)
    ext.scale_cuda(x, 3.0)
    assert float(x.sum()) == 12.0


# --- CUDA -------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_kernel_on_torch_memory_and_stream():
    x = torch.ones(1000, device="cuda")
    ptr = x.data_ptr()
    ext.scale_cuda(x, 2.5)
    torch.cuda.synchronize()
    assert x.data_ptr() == ptr
    assert torch.all(x == 2.5)


@needs_cuda
def test_cuda_refused_for_host_functions():
    with pytest.raises(ValueError, match="argument 'x': expected an array on cpu"):
        ext.total(torch.ones(3, device="cuda"))


# --- the shared borrow registry, as another extension uses it -----------------------------------


def _registry():
    """The process's borrow registry, called through its C table as any other extension would."""
    import ctypes
    import sys

    ext.total(np.ones(1, np.float32))  # publishes it if nothing has yet
    capsule = sys.modules["_dlbridge_borrows"].registry_v1
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, b"dlbridge_pyo3.borrows.registry_v1")

    class Range(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                    ("start", ctypes.c_uint64), ("end", ctypes.c_uint64)]

    acquire_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Range), ctypes.c_int)
    release_t = ctypes.CFUNCTYPE(None, ctypes.POINTER(Range), ctypes.c_int)

    class Registry(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("acquire", acquire_t), ("release", release_t)]

    return Registry.from_address(ptr), Range


def test_borrow_by_another_extension_is_respected():
    registry, Range = _registry()
    assert registry.version == 1
    z = np.ones(8, np.float32)
    theirs = Range(1, 0, z.ctypes.data + 8, z.ctypes.data + 16)  # elements 2 and 3, mutably
    assert registry.acquire(ctypes_ref(theirs), 1) == 0
    try:
        with pytest.raises(BufferError, match="argument 'x'"):
            ext.total(z)  # a shared borrow overlapping their mutable one
        assert ext.total(z[4:]) == 4.0  # disjoint: fine
    finally:
        registry.release(ctypes_ref(theirs), 1)
    assert ext.total(z) == 8.0
    # And ours blocks theirs.
    held = ext.hold(z)
    assert registry.acquire(ctypes_ref(theirs), 1) == 1
    held.release()
    assert registry.acquire(ctypes_ref(theirs), 1) == 0
    registry.release(ctypes_ref(theirs), 1)


def ctypes_ref(obj):
    import ctypes

    return ctypes.pointer(obj)


# --- deleter counts through the exchange table --------------------------------------------------


def test_dlbridge_exports_released_exactly_once():
    dlbridge = pytest.importorskip("dlbridge")
    a = dlbridge.asarray(np.arange(8, dtype=np.float32))
    base = a._buffer_ref_count
    for _ in range(100):
        ext.total(a)
    assert a._buffer_ref_count == base
    held = ext.hold(a)
    assert a._buffer_ref_count == base + 1
    held.release()
    assert a._buffer_ref_count == base


def test_view_dropped_on_another_thread_releases_once():
    import threading

    dlbridge = pytest.importorskip("dlbridge")
    a = dlbridge.asarray(np.arange(8, dtype=np.float32))
    base = a._buffer_ref_count
    held = [ext.hold(a)]
    assert a._buffer_ref_count == base + 1

    def drop():
        held[0].release()
        held.clear()

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    gc.collect()
    assert a._buffer_ref_count == base
