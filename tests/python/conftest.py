"""Shared helpers for the dlbridge Python suite.

* ``ptr_of(obj)``: the address of the first element of an array of any library under test.
* ``rng``: a seeded ``np.random.default_rng`` (fresh per test, so tests are reproducible alone).
* ``random_values``: random NumPy data of a given dtype (bool, ints, floats, complex).
* ``capsule_info``: reads a DLPack capsule's descriptor through ctypes *without consuming it*.
* ``make_capsule``: a hand-built DLPack capsule (ctypes producer) with an observable deleter, for
  descriptor shapes no library produces on demand (byte offsets, NULL strides, bad versions...).
"""

from __future__ import annotations

import ctypes
import gc
import sys

import numpy as np
import pytest

import dlbridge

SEED = 20240607

# ---------------------------------------------------------------------------------------------
# Pointers.


def ptr_of(obj) -> int:
    """Address of the first element of ``obj`` (dlbridge, NumPy, PyTorch, JAX, MLX or TVM-FFI)."""
    if isinstance(obj, dlbridge.Array):
        return obj.data_ptr
    if isinstance(obj, np.ndarray):
        return obj.__array_interface__["data"][0]
    mod = type(obj).__module__ or ""
    if mod.startswith("torch"):
        return obj.data_ptr()
    if mod.startswith("jax") or mod.startswith("jaxlib"):
        return obj.unsafe_buffer_pointer()
    if mod.startswith("mlx"):
        import mlx.core as mx

        mx.eval(obj)
        # np.from_dlpack of an MLX array is zero-copy and folds MLX's byte_offset in.
        return np.from_dlpack(obj).__array_interface__["data"][0]
    if mod.startswith("tvm_ffi"):
        return obj.data_ptr()  # includes the byte offset
    raise TypeError(f"ptr_of: unsupported type {type(obj)!r}")


# ---------------------------------------------------------------------------------------------
# Random data.


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


def random_values(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random NumPy values of ``dtype`` that every library represents exactly (small ints, floats
    that are exact in float16 / bfloat16 / float8)."""
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind == "u":
        return rng.integers(0, 100, size=shape).astype(dtype)
    if dtype.kind == "i":
        return rng.integers(-50, 50, size=shape).astype(dtype)
    # Multiples of 1/4 in [-8, 8): exact in every float format from float8_e4m3fn up.
    real = rng.integers(-32, 32, size=shape) / 4.0
    if dtype.kind == "c":
        imag = rng.integers(-32, 32, size=shape) / 4.0
        return (real + 1j * imag).astype(dtype)
    return real.astype(dtype)


@pytest.fixture
def values(rng):
    """``values(shape, dtype)``: seeded random data (see ``random_values``)."""
    return lambda shape, dtype=np.float32: random_values(rng, shape, dtype)


# ---------------------------------------------------------------------------------------------
# DLPack structures through ctypes.


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


LegacyDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", LegacyDeleter),
]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


VersionedDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", VersionedDeleter),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1
FLAG_IS_SUBBYTE_TYPE_PADDED = 1 << 2

_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def capsule_name(capsule) -> str:
    return _api.PyCapsule_GetName(capsule).decode()


def capsule_info(capsule) -> dict:
    """The descriptor inside an unconsumed ``dltensor`` / ``dltensor_versioned`` capsule."""
    name = _api.PyCapsule_GetName(capsule)
    ptr = _api.PyCapsule_GetPointer(capsule, name)
    if name == b"dltensor_versioned":
        m = DLManagedTensorVersioned.from_address(ptr)
        version, flags = (m.version.major, m.version.minor), m.flags
    elif name == b"dltensor":
        m = DLManagedTensor.from_address(ptr)
        version, flags = None, None
    else:
        raise ValueError(f"not an unconsumed DLPack capsule: {name!r}")
    t = m.dl_tensor
    return {
        "name": name.decode(),
        "version": version,
        "flags": flags,
        "data": t.data or 0,
        "byte_offset": t.byte_offset,
        "ndim": t.ndim,
        "shape": [t.shape[i] for i in range(t.ndim)] if t.ndim else [],
        "strides": None if not t.strides else [t.strides[i] for i in range(t.ndim)],
        "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        "device": (t.device.device_type, t.device.device_id),
    }


class HandMadeCapsule:
    """A DLPack capsule produced by ctypes over memory kept by ``owner``.

    ``deleted`` counts calls of the deleter; the ctypes structures stay alive with this object,
    so keep it referenced until the deleter has run (the tests do).
    """

    _live: "set[HandMadeCapsule]" = set()

    def __init__(self, owner, data, shape, strides, dtype, *, byte_offset=0, versioned=True,
                 version=(1, 3), flags=0, device=(1, 0), ndim=None):
        self.owner = owner
        self.deleted = 0
        nd = len(shape) if ndim is None else ndim
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
        cls = DLManagedTensorVersioned if versioned else DLManagedTensor
        deleter_type = VersionedDeleter if versioned else LegacyDeleter
        self.managed = cls()
        self._deleter = deleter_type(self._on_delete)
        t = self.managed.dl_tensor
        t.data = data
        t.device = DLDevice(*device)
        t.ndim = nd
        t.dtype = DLDataType(*dtype)
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = (ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
                     if self._strides is not None else ctypes.POINTER(ctypes.c_int64)())
        t.byte_offset = byte_offset
        self.managed.deleter = self._deleter
        if versioned:
            self.managed.version = DLPackVersion(*version)
            self.managed.flags = flags
        name = b"dltensor_versioned" if versioned else b"dltensor"
        # No capsule destructor: the tests consume every capsule they make, or check the
        # deleter was not run.
        self.capsule = _api.PyCapsule_New(ctypes.addressof(self.managed), name, None)
        HandMadeCapsule._live.add(self)

    def _on_delete(self, _ptr):
        self.deleted += 1


def make_capsule(arr: np.ndarray, *, byte_offset=0, data=None, shape=None, strides="auto",
                 dtype=None, **kw) -> HandMadeCapsule:
    """A capsule over ``arr``'s memory; strides default to ``arr``'s (in elements), ``None``
    gives NULL strides, ``data`` defaults to ``arr``'s first element minus ``byte_offset``."""
    codes = {"b": 1, "i": 0, "u": 1, "f": 2, "c": 5}
    if dtype is None:
        kind = arr.dtype.kind
        dtype = (6 if kind == "b" else codes[kind], arr.dtype.itemsize * 8, 1)
    if shape is None:
        shape = arr.shape
    if strides == "auto":
        strides = [s // arr.itemsize for s in arr.strides]
    if data is None:
        data = ptr_of(arr) - byte_offset
    return HandMadeCapsule(arr, data, list(shape), None if strides is None else list(strides),
                           dtype, byte_offset=byte_offset, **kw)


def collect():
    """Full garbage collection (twice, for finalizer chains)."""
    gc.collect()
    gc.collect()


def refcount(obj) -> int:
    return sys.getrefcount(obj)


# ---------------------------------------------------------------------------------------------
# Devices.


def _devices():
    """CPU always; CUDA and Metal skipped with the reason where the device is missing."""
    out = [pytest.param("cpu", id="cpu")]
    cuda_reason = dlbridge.cuda.unavailable_reason() or "no CUDA device"
    out.append(
        pytest.param(
            "cuda:0",
            id="cuda",
            marks=pytest.mark.skipif(not dlbridge.cuda.is_available(), reason=f"no CUDA GPU: {cuda_reason}"),
        )
    )
    metal_ok = "metal:0" in dlbridge.build_info()["devices"]
    out.append(
        pytest.param(
            "metal:0",
            id="metal",
            marks=pytest.mark.skipif(not metal_ok, reason="no Metal device (Apple GPU) on this machine"),
        )
    )
    return out


@pytest.fixture(params=_devices())
def device(request):
    return request.param
