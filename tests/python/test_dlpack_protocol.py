"""Capsule-level DLPack semantics: naming, versions, flags, copies, devices, ownership, lifetimes."""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
import weakref

import numpy as np
import pytest

import dlbridge
from conftest import (
    FLAG_IS_COPIED,
    FLAG_IS_SUBBYTE_TYPE_PADDED,
    FLAG_READ_ONLY,
    capsule_info,
    capsule_name,
    collect,
    make_capsule,
    ptr_of,
)


def readonly_numpy(n=6, dtype=np.float64):
    x = np.arange(n, dtype=dtype)
    x.flags.writeable = False
    return x


# ---------------------------------------------------------------------------------------------
# Capsule names and consumption.


@pytest.mark.parametrize("max_version,name", [(None, "dltensor"), ((1, 0), "dltensor_versioned")])
def test_consumed_capsule_is_renamed_and_cannot_be_reused(max_version, name):
    a = dlbridge.arange(5)
    cap = a.__dlpack__(max_version=max_version)
    assert capsule_name(cap) == name
    assert f'"{name}"' in repr(cap)
    b = dlbridge.from_dlpack(cap)
    assert b.tolist() == [0, 1, 2, 3, 4]
    assert b.data_ptr == a.data_ptr
    assert capsule_name(cap) == "used_" + name
    assert f'"used_{name}"' in repr(cap)
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(cap)
    with pytest.raises(BufferError):
        dlbridge.asarray(cap)
    # The consumer (not the capsule) owns the export now: dropping the capsule is harmless.
    del cap
    collect()
    assert b.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("producer", ["numpy-legacy", "numpy-versioned", "torch"])
def test_foreign_capsules_are_renamed_on_consumption(producer):
    if producer == "torch":
        import torch

        src = torch.arange(4)
        cap = src.__dlpack__(max_version=(1, 3))
    else:
        src = np.arange(4)
        cap = src.__dlpack__() if producer == "numpy-legacy" else src.__dlpack__(max_version=(1, 0))
    name = capsule_name(cap)
    a = dlbridge.from_dlpack(cap)
    assert capsule_name(cap) == "used_" + name
    assert a.data_ptr == ptr_of(src)
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(cap)


def _capsule(name: bytes):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.c_void_p(0x1000), name, None)


@pytest.mark.parametrize("name", [b"foo", b"dltensor_v", b"DLTENSOR", b"dlpack_exchange_api"])
def test_unknown_capsule_names_are_type_errors(name):
    cap = _capsule(name)
    with pytest.raises(TypeError):
        dlbridge.from_dlpack(cap)
    assert capsule_name(cap) == name.decode()  # untouched


@pytest.mark.parametrize("obj", [object(), [1, 2], 3, "abc", None])
def test_objects_without_dlpack_are_type_errors(obj):
    with pytest.raises(TypeError):
        dlbridge.from_dlpack(obj)


def test_producer_returning_a_non_capsule_is_a_type_error():
    class NotACapsule:
        def __dlpack__(self, **kwargs):
            return 5

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError):
        dlbridge.from_dlpack(NotACapsule())


def test_producer_errors_propagate():
    class Refuses:
        def __dlpack__(self, **kwargs):
            raise BufferError("cannot export this")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(BufferError, match="cannot export this"):
        dlbridge.from_dlpack(Refuses())


def test_keyword_less_producers_are_supported():
    """Producers older than DLPack 1.0 take only ``stream``: dlbridge falls back to a plain call."""
    n = np.arange(3.0)

    class Old:
        def __dlpack__(self, stream=None):
            return n.__dlpack__()

        def __dlpack_device__(self):
            return (1, 0)

    a = dlbridge.from_dlpack(Old())
    assert a.data_ptr == ptr_of(n)
    assert a.tolist() == [0.0, 1.0, 2.0]


def _cuda_driver_library_opens() -> bool:
    for name in ("libcuda.so.1", "libcuda.so", "libcuda.dylib", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def test_device_asked_only_where_cuda_memory_can_exist():
    """`__dlpack_device__` is asked to choose a CUDA stream (1 us for a JAX array): a process
    that cannot open the CUDA driver library holds no CUDA memory, so it is not asked there,
    unless a device was asked for."""
    n = np.arange(3.0)
    asked = []

    class Counted:
        def __dlpack__(self, **kwargs):
            return n.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            asked.append(1)
            return (1, 0)

    a = dlbridge.from_dlpack(Counted())
    assert a.tolist() == [0.0, 1.0, 2.0] and a.data_ptr == ptr_of(n)
    assert len(asked) == (1 if _cuda_driver_library_opens() else 0)
    asked.clear()
    dlbridge.from_dlpack(Counted(), device="cpu")
    assert len(asked) == 1


def test_consumer_passes_max_version_and_copy_to_producer():
    n = np.arange(3.0)
    seen = []

    class Recorder:
        def __dlpack__(self, **kwargs):
            seen.append(kwargs)
            return n.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return (1, 0)

    dlbridge.from_dlpack(Recorder())
    copied = dlbridge.from_dlpack(Recorder(), copy=True)
    dlbridge.from_dlpack(Recorder(), copy=False, device="cpu")
    assert [tuple(k["max_version"]) for k in seen] == [(1, 3)] * 3
    assert seen[0].get("copy") is None
    # copy=True: dlbridge imports without a copy and makes the copy itself, into its own memory
    # (a copy the producer made would be the producer's, which Backend.free must refuse).
    assert seen[1].get("copy") is None
    assert not copied.is_foreign and copied.data_ptr != n.ctypes.data
    assert seen[2]["copy"] is False
    assert all(k.get("dl_device") is None for k in seen), "same-device requests are not sent"


# ---------------------------------------------------------------------------------------------
# max_version.


@pytest.mark.parametrize("max_version,name,version", [
    (None, "dltensor", None),
    ((0, 8), "dltensor", None),
    ((1, 0), "dltensor_versioned", (1, 0)),
    ((1, 1), "dltensor_versioned", (1, 1)),
    ((1, 2), "dltensor_versioned", (1, 2)),
    ((1, 3), "dltensor_versioned", (1, 3)),
    ((1, 99), "dltensor_versioned", (1, 3)),
])
def test_max_version_selects_capsule_kind_and_version(max_version, name, version):
    a = dlbridge.arange(10, dtype="float32")[3:]
    cap = a.__dlpack__(max_version=max_version)
    assert f'capsule object "{name}"' in repr(cap)
    info = capsule_info(cap)
    assert info["name"] == name
    assert info["version"] == version
    if version is not None:
        assert info["flags"] == 0
    # Addressable memory: data is the first element, byte_offset 0, strides always emitted.
    assert info["data"] == a.data_ptr
    assert info["byte_offset"] == 0
    assert info["shape"] == [7] and info["strides"] == [1]
    assert info["dtype"] == (2, 32, 1) and info["device"] == (1, 0)
    assert dlbridge.from_dlpack(cap).tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def test_max_version_with_a_higher_major_gets_a_1x_capsule():
    info = capsule_info(dlbridge.arange(3).__dlpack__(max_version=(2, 0)))
    assert info["name"] == "dltensor_versioned"
    assert info["version"][0] == 1


@pytest.mark.parametrize("view", ["T", "neg", "bcast", "0d", "empty"])
def test_exported_descriptors(view):
    base = dlbridge.arange(12, dtype="int16").reshape(3, 4)
    a = {
        "T": lambda: base.T,
        "neg": lambda: base[::-1, 1::2],
        "bcast": lambda: dlbridge.arange(4, dtype="int16").broadcast_to((3, 4)),
        "0d": lambda: base[2, 3],
        "empty": lambda: dlbridge.zeros((0, 4), "int16"),
    }[view]()
    info = capsule_info(a.__dlpack__(max_version=(1, 3)))
    assert info["ndim"] == a.ndim
    assert tuple(info["shape"]) == a.shape
    assert tuple(info["strides"]) == a.strides
    assert info["dtype"] == (0, 16, 1)
    if a.size:
        assert info["data"] == a.data_ptr
        assert info["byte_offset"] == 0


# ---------------------------------------------------------------------------------------------
# dl_device, copy and stream on export.


@pytest.mark.parametrize("dl_device", [(1, 0), "cpu"])
def test_dl_device_cpu_does_not_copy(dl_device):
    a = dlbridge.arange(6)
    cap = a.__dlpack__(max_version=(1, 0), dl_device=dl_device)
    info = capsule_info(cap)
    assert info["data"] == a.data_ptr
    assert info["flags"] & FLAG_IS_COPIED == 0
    assert dlbridge.from_dlpack(cap).data_ptr == a.data_ptr
    assert a.__dlpack__(dl_device=(1, 0), copy=False) is not None


@pytest.mark.parametrize("max_version", [None, (1, 0), (1, 3)])
def test_export_copy_true_gives_independent_memory(max_version):
    a = dlbridge.arange(12, dtype="float64").reshape(3, 4)[:, ::-1]
    cap = a.__dlpack__(max_version=max_version, copy=True)
    info = capsule_info(cap)
    assert info["data"] != a.data_ptr
    if max_version is not None:
        assert info["flags"] & FLAG_IS_COPIED
    b = dlbridge.from_dlpack(cap)
    assert b.tolist() == a.tolist()
    assert b.data_ptr != a.data_ptr
    a[...] = -1.0
    assert b.tolist() == np.arange(12.0).reshape(3, 4)[:, ::-1].tolist()
    b[0, 0] = 99.0
    assert a[0, 0].item() == -1.0


def test_export_copy_false_on_cpu_shares():
    a = dlbridge.arange(4)
    cap = a.__dlpack__(max_version=(1, 0), copy=False)
    info = capsule_info(cap)
    assert info["data"] == a.data_ptr and info["flags"] & FLAG_IS_COPIED == 0
    b = dlbridge.from_dlpack(cap)
    b[0] = 5
    assert a[0].item() == 5


@pytest.mark.parametrize("stream", [0, 1, 2, -1, 12345, object()])
def test_stream_on_cpu_is_rejected(stream):
    a = dlbridge.arange(3)
    with pytest.raises((ValueError, BufferError)):
        a.__dlpack__(stream=stream)
    with pytest.raises((ValueError, BufferError)):
        a.__dlpack__(stream=stream, max_version=(1, 0))
    assert a.__dlpack__(stream=None) is not None


def test_export_to_a_device_dlbridge_cannot_reach_is_a_buffer_error():
    """DLPack export to a device that this build cannot copy to: the array API asks for
    BufferError (what DLPack export cannot do), so consumers can fall back."""
    a = dlbridge.arange(3)
    with pytest.raises(BufferError):
        a.__dlpack__(dl_device=(2, 0), copy=False)
    with pytest.raises(BufferError):
        a.__dlpack__(dl_device=(99, 0))
    if dlbridge.cuda.is_available():
        # With a GPU the move is possible (a copy): the capsule says so.
        assert a.__dlpack__(dl_device=(2, 0)) is not None
    else:
        with pytest.raises(BufferError):
            a.__dlpack__(dl_device=(2, 0))  # no CUDA driver here


def test_from_dlpack_to_a_device_dlbridge_cannot_reach_is_a_buffer_error():
    a = dlbridge.arange(3)
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(a, device="cuda:0", copy=False)
    if dlbridge.cuda.is_available():
        # NumPy refuses to move its array, so dlbridge imports it and copies it over itself.
        moved = dlbridge.from_dlpack(np.arange(3), device="cuda:0")
        assert str(moved.device) == "cuda:0" and moved.tolist() == [0, 1, 2]
        moved = dlbridge.from_dlpack(a, device="cuda:0")  # a copy onto the GPU
        assert str(moved.device) == "cuda:0" and moved.tolist() == [0, 1, 2]
    else:
        with pytest.raises(BufferError):
            dlbridge.from_dlpack(np.arange(3), device="cuda:0")  # NumPy refuses the move
        with pytest.raises(BufferError):
            dlbridge.from_dlpack(a, device="cuda:0")  # no CUDA driver here


def test_invalid_dl_device_values():
    a = dlbridge.arange(3)
    with pytest.raises(ValueError):
        a.__dlpack__(dl_device="nonsense")
    with pytest.raises(TypeError):
        a.__dlpack__(dl_device=3.5)


# ---------------------------------------------------------------------------------------------
# copy on import.


def test_from_dlpack_copy_semantics_with_numpy():
    n = np.arange(6.0)
    shared = dlbridge.from_dlpack(n)
    assert shared.data_ptr == ptr_of(n)
    assert dlbridge.from_dlpack(n, copy=False).data_ptr == ptr_of(n)
    fresh = dlbridge.from_dlpack(n, copy=True)
    assert fresh.data_ptr != ptr_of(n)
    assert not fresh.readonly
    n[0] = 42.0
    assert shared[0].item() == 42.0
    assert fresh[0].item() == 0.0


def test_from_dlpack_copy_true_trusts_is_copied():
    """A producer that already copied (IS_COPIED) is not copied again."""
    n = np.arange(5, dtype=np.int32)
    hand = make_capsule(n, flags=FLAG_IS_COPIED)
    a = dlbridge.from_dlpack(hand.capsule, copy=True)
    assert a.data_ptr == ptr_of(n)
    del a
    collect()
    assert hand.deleted == 1


def test_from_dlpack_copy_true_copies_an_uncopied_capsule():
    n = np.arange(5, dtype=np.int32)
    hand = make_capsule(n)
    a = dlbridge.from_dlpack(hand.capsule, copy=True)
    assert a.data_ptr != ptr_of(n)
    assert a.tolist() == [0, 1, 2, 3, 4]
    collect()
    assert hand.deleted == 1, "the producer's tensor is released once the copy is made"


# ---------------------------------------------------------------------------------------------
# Read-only memory.


def test_readonly_numpy_import_and_export():
    n = readonly_numpy()
    a = dlbridge.from_dlpack(n)
    assert a.readonly
    assert a.data_ptr == ptr_of(n)
    for view in (a, a[1:], a[::-1], a.reshape(2, 3).T, a.broadcast_to((2, 6))):
        assert view.readonly
        with pytest.raises(BufferError):
            view[0] = 1.0
        with pytest.raises(BufferError):
            view.__dlpack__()  # legacy capsules cannot say read-only
        cap = view.__dlpack__(max_version=(1, 0))
        assert capsule_info(cap)["flags"] & FLAG_READ_ONLY
        back = np.from_dlpack(view)
        assert not back.flags.writeable
    with pytest.raises(BufferError):
        a[...] = [1, 2, 3, 4, 5, 6]
    assert n.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_readonly_copies_are_writable():
    a = dlbridge.from_dlpack(readonly_numpy())
    c = a.copy()
    assert not c.readonly
    c[0] = 7.0
    assert not a.astype("float32").readonly
    cap = a.__dlpack__(copy=True)  # a legacy export of a fresh copy is fine
    assert capsule_info(cap)["data"] != a.data_ptr
    v = capsule_info(a.__dlpack__(copy=True, max_version=(1, 0)))
    assert v["flags"] & FLAG_IS_COPIED and not v["flags"] & FLAG_READ_ONLY
    assert not dlbridge.from_dlpack(a, copy=True).readonly


def test_readonly_flag_on_a_hand_made_capsule():
    n = np.arange(4, dtype=np.float32)
    hand = make_capsule(n, flags=FLAG_READ_ONLY)
    a = dlbridge.from_dlpack(hand.capsule)
    assert a.readonly
    with pytest.raises(BufferError):
        a[1] = 0.0
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0]
    del a
    collect()
    assert hand.deleted == 1


def test_legacy_capsules_import_writable():
    n = np.arange(4, dtype=np.float32)
    hand = make_capsule(n, versioned=False)
    a = dlbridge.from_dlpack(hand.capsule)
    assert not a.readonly
    a[0] = 9.0
    assert n[0] == 9.0


# ---------------------------------------------------------------------------------------------
# Hand-made descriptors: byte_offset, NULL strides, and malformed tensors.


@pytest.mark.parametrize("versioned", [False, True])
def test_nonzero_byte_offset_is_honoured(versioned):
    n = np.arange(20, dtype=np.float64).reshape(4, 5)
    view = n[1:, 2:]
    # data points at the start of n; byte_offset reaches the view's first element.
    offset = ptr_of(view) - ptr_of(n)
    hand = make_capsule(view, byte_offset=offset, versioned=versioned)
    assert capsule_info(hand.capsule)["byte_offset"] == offset
    a = dlbridge.from_dlpack(hand.capsule)
    assert a.tolist() == view.tolist()
    assert a.data_ptr == ptr_of(view)
    # Views and re-exports of it keep addressing the same elements.
    assert a[1:, ::-1].tolist() == view[1:, ::-1].tolist()
    assert np.from_dlpack(a).tolist() == view.tolist()
    assert ptr_of(np.from_dlpack(a)) == ptr_of(view)
    a[0, 0] = -1.0
    assert n[1, 2] == -1.0


@pytest.mark.parametrize("version", [None, (1, 0), (1, 1)])
def test_null_strides_mean_row_major_before_1_2(version):
    n = np.arange(12, dtype=np.int32).reshape(3, 4)
    hand = make_capsule(n, strides=None, versioned=version is not None, version=version or (1, 0))
    a = dlbridge.from_dlpack(hand.capsule)
    assert a.strides == (4, 1)
    assert a.tolist() == n.tolist()


@pytest.mark.parametrize("version", [(1, 2), (1, 3)])
def test_null_strides_are_rejected_from_1_2(version):
    n = np.arange(12, dtype=np.int32).reshape(3, 4)
    hand = make_capsule(n, strides=None, version=version)
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(hand.capsule)
    assert hand.deleted == 1, "a failed import still releases the producer's tensor exactly once"


def test_null_strides_are_fine_for_0d_from_1_2():
    n = np.array(3.5, dtype=np.float64)
    hand = make_capsule(n, strides=None, version=(1, 3))
    assert dlbridge.from_dlpack(hand.capsule).item() == 3.5


@pytest.mark.parametrize("case", [
    "major-2", "major-0", "negative-extent", "ndim-too-large", "negative-ndim", "null-data",
    "bad-dtype-code", "bad-float-bits", "bad-device",
])
def test_malformed_capsules_raise_and_release(case):
    n = np.arange(6, dtype=np.float32)
    kwargs = {
        "major-2": dict(version=(2, 0)),
        "major-0": dict(version=(0, 9)),
        "negative-extent": dict(shape=[-1], strides=[1]),
        "ndim-too-large": dict(shape=[1] * 65, strides=[1] * 65),
        "negative-ndim": dict(shape=[6], strides=[1], ndim=-1),
        "null-data": dict(data=0),
        "bad-dtype-code": dict(dtype=(99, 32, 1)),
        "bad-float-bits": dict(dtype=(2, 24, 1)),
        "bad-device": dict(device=(99, 0)),
    }[case]
    hand = make_capsule(n, **kwargs)
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(hand.capsule)
    assert hand.deleted == 1
    assert capsule_name(hand.capsule) == "used_dltensor_versioned"


@pytest.mark.parametrize("versioned", [False, True])
def test_packed_float4_is_read_correctly_or_refused(versioned):
    """Sub-byte tensors without IS_SUBBYTE_TYPE_PADDED are packed (two float4 per byte, low
    nibble first): six elements live in three bytes. Reading them must give the six values or
    raise, and must never read past the three bytes (the bytes after them are 0xff here)."""
    memory = np.array([0x21, 0x43, 0x7D, 0xFF, 0xFF, 0xFF], dtype=np.uint8)
    hand = make_capsule(memory[:3], shape=[6], strides=[1], dtype=(17, 4, 1), versioned=versioned)
    a = dlbridge.from_dlpack(hand.capsule)
    assert a.shape == (6,) and a.dtype == "float4_e2m1fn"
    assert a.nbytes == 3
    assert a.data_ptr == ptr_of(memory)
    try:
        got = a.tolist()
    except BufferError:
        return
    assert got == [0.5, 1.0, 1.5, 2.0, -3.0, 6.0]


@pytest.mark.parametrize("dtype", ["float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"])
def test_padded_sub_byte_arrays_are_never_exported_as_packed(dtype):
    """dlbridge stores sub-byte elements one per byte (IS_SUBBYTE_TYPE_PADDED in versioned
    capsules). A legacy capsule has no flags, and DLPack reads sub-byte types there as packed:
    a legacy export must refuse (like read-only arrays) or describe the same memory exactly."""
    vals = [0.5, 1.0, 1.5, 2.0, -3.0, 6.0]
    d = dlbridge.asarray(vals, dtype=dtype)
    v = capsule_info(d.__dlpack__(max_version=(1, 3)))
    assert v["flags"] & FLAG_IS_SUBBYTE_TYPE_PADDED
    r = dlbridge.from_dlpack(d.__dlpack__(max_version=(1, 3)))
    assert r.nbytes == d.nbytes and r.astype("float32").tolist() == vals
    try:
        cap = d.__dlpack__()
    except BufferError:
        return
    b = dlbridge.from_dlpack(cap)
    assert b.nbytes == d.nbytes, "the legacy capsule describes packed memory that is not there"
    assert b.astype("float32").tolist() == vals


def test_zero_size_capsule_with_null_data():
    n = np.zeros((0, 3), dtype=np.float32)
    hand = make_capsule(n, data=0)
    a = dlbridge.from_dlpack(hand.capsule)
    assert a.shape == (0, 3) and a.size == 0
    assert a.tolist() == []
    assert np.from_dlpack(a).shape == (0, 3)


def test_deleter_runs_once_when_the_last_view_goes():
    n = np.arange(10, dtype=np.int64)
    hand = make_capsule(n)
    a = dlbridge.from_dlpack(hand.capsule)
    views = [a[1:], a[::-2], a.reshape(2, 5).T, a[3]]
    reexport = np.from_dlpack(a)
    del a
    collect()
    assert hand.deleted == 0
    views.clear()
    collect()
    assert hand.deleted == 0, "NumPy's view still holds the memory"
    assert reexport.tolist() == list(range(10))
    del reexport
    collect()
    assert hand.deleted == 1


# ---------------------------------------------------------------------------------------------
# Reference counting and lifetimes.


def test_unconsumed_foreign_capsules_release_the_producer():
    n = np.arange(10.0)
    base = sys.getrefcount(n)
    caps = [n.__dlpack__(max_version=(1, 0)) for _ in range(4)] + [n.__dlpack__()]
    assert sys.getrefcount(n) > base
    del caps
    collect()
    assert sys.getrefcount(n) == base


def test_import_then_drop_restores_refcount():
    n = np.arange(10.0)
    base = sys.getrefcount(n)
    a = dlbridge.from_dlpack(n)
    v = a[2:]
    del a
    assert sys.getrefcount(n) > base
    del v
    collect()
    assert sys.getrefcount(n) == base


def test_consuming_capsules_then_dropping_views_releases_numpy():
    n = np.arange(10.0)
    w = weakref.ref(n)
    a = dlbridge.from_dlpack(n)
    b = dlbridge.from_dlpack(n.__dlpack__(max_version=(1, 0)))
    views = [a[::2], b.T, a[None]]
    del n
    collect()
    assert w() is not None
    del a, b
    collect()
    assert w() is not None
    views.clear()
    collect()
    assert w() is None


def test_unconsumed_dlbridge_capsules_release_their_buffer():
    """Dropping capsules dlbridge exported (never consumed) frees what they hold: observed on the
    NumPy array at the bottom of the chain NumPy -> dlbridge -> capsules."""
    n = np.arange(8.0)
    w = weakref.ref(n)
    a = dlbridge.from_dlpack(n)
    del n
    caps = [a.__dlpack__(), a.__dlpack__(max_version=(1, 0)), a[2:].__dlpack__(max_version=(1, 3)),
            a.__dlpack__(max_version=(1, 0), copy=True)]
    del a
    collect()
    assert w() is not None, "the capsules keep the memory alive"
    assert dlbridge.from_dlpack(caps.pop(1)).tolist() == [float(i) for i in range(8)]
    collect()
    assert w() is not None
    caps.clear()
    collect()
    assert w() is None


def test_capsule_outlives_its_dlbridge_array():
    a = dlbridge.arange(5, dtype="float64")
    cap = a.__dlpack__(max_version=(1, 0))
    legacy = a[1:].__dlpack__()
    del a
    collect()
    assert dlbridge.from_dlpack(cap).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert dlbridge.from_dlpack(legacy).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_numpy_view_outlives_its_dlbridge_array():
    a = dlbridge.arange(6, dtype="int32")
    n = np.from_dlpack(a[::-1])
    del a
    collect()
    _ = [np.ones(1000) for _ in range(50)]  # churn the allocator
    assert n.tolist() == [5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize("producer", ["numpy", "torch"])
def test_producer_deleted_before_consumer_reads(producer):
    if producer == "torch":
        import torch

        src = torch.arange(1000, dtype=torch.float32)
    else:
        src = np.arange(1000, dtype=np.float32)
    a = dlbridge.from_dlpack(src)[::7]
    cap = (src.__dlpack__(max_version=(1, 0)))
    del src
    collect()
    _ = [np.ones(1000, np.float32) * 5 for _ in range(50)]
    assert a.tolist() == [float(i) for i in range(0, 1000, 7)]
    b = dlbridge.from_dlpack(cap)
    assert b[999].item() == 999.0


@pytest.mark.parametrize("producer", ["numpy", "torch", "hand-made"])
def test_last_view_dropped_on_another_thread(producer):
    hand = None
    if producer == "torch":
        import torch

        src = torch.arange(100, dtype=torch.float64)
    elif producer == "numpy":
        src = np.arange(100, dtype=np.float64)
    else:
        backing = np.arange(100, dtype=np.float64)
        hand = make_capsule(backing)
        src = hand.capsule
    w = weakref.ref(src) if producer != "hand-made" else None
    holder = [dlbridge.from_dlpack(src)[10:20]]
    del src
    collect()
    errors = []

    def drop():
        try:
            assert holder[0].tolist() == [float(i) for i in range(10, 20)]
            holder.clear()
            gc.collect()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=drop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    collect()
    if w is not None:
        assert w() is None
    else:
        assert hand.deleted == 1


def test_many_threads_import_and_drop_concurrently():
    n = np.arange(1000, dtype=np.int64)
    w = weakref.ref(n)
    errors = []

    def work(k):
        try:
            for _ in range(50):
                a = dlbridge.from_dlpack(n)[k::8]
                c = np.from_dlpack(a)
                assert int(c[0]) == k
                del a, c
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    del n
    collect()
    assert w() is None


def test_failed_import_keeps_pending_exception_semantics():
    """Capsule destructors run while errors propagate; they must not swallow or replace them."""
    a = dlbridge.from_dlpack(readonly_numpy())

    def f():
        cap = a.__dlpack__(max_version=(1, 0))  # dropped during unwinding
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        f()


# ---------------------------------------------------------------------------------------------
# The DLPack C exchange API table (DLPack 1.3).


def test_exchange_api_capsule_is_published():
    cap = dlbridge.Array.__dlpack_c_exchange_api__
    assert capsule_name(cap) == "dlpack_exchange_api"
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ptr = get(cap, b"dlpack_exchange_api")
    major, minor = (ctypes.c_uint32 * 2).from_address(ptr)
    assert (major, minor) == (1, 3)
