"""The hand-written fastcall entry points: ``dlbridge.from_dlpack``, ``dlbridge.empty`` and
``Array.__dlpack__`` parse their own arguments (see ``crates/python-module/src/fastcall.rs``), so
their argument handling is tested here as CPython's own would behave.

This file, with ``test_compute.py``, is also what ``scripts/test.sh`` runs on the oldest CPython
the abi3 wheel supports (3.9, with the last NumPy for it, 2.0), so it uses nothing newer.
"""

from __future__ import annotations

import inspect
import sys

import numpy as np
import pytest

import dlbridge
from conftest import capsule_info, ptr_of


def not_interned(text: str) -> str:
    """An equal string that is not the interned copy (the entry points' slower path)."""
    fresh = "".join([text[:1], text[1:]])
    assert fresh == text
    return fresh


def test_signatures_are_introspectable():
    assert str(inspect.signature(dlbridge.empty)) == "(shape, dtype=None, *, device=None, storage=None)"
    assert str(inspect.signature(dlbridge.from_dlpack)) == "(x, /, *, device=None, copy=None)"
    sig = inspect.signature(dlbridge.Array.__dlpack__)
    assert list(sig.parameters) == ["self", "stream", "max_version", "dl_device", "copy"]
    assert dlbridge.empty.__name__ == "empty"
    assert "undefined contents" in dlbridge.empty.__doc__


@pytest.mark.parametrize(
    "call",
    [
        lambda: dlbridge.empty(4, "uint8"),
        lambda: dlbridge.empty(4, dtype="uint8"),
        lambda: dlbridge.empty(shape=4, dtype="uint8"),
        lambda: dlbridge.empty((4,), dlbridge.uint8, device="cpu", storage="shared"),
        lambda: dlbridge.empty(4, dtype=None).astype("uint8"),
        lambda: dlbridge.empty(4, not_interned("uint8"), **{not_interned("device"): not_interned("cpu")}),
        lambda: dlbridge.empty(4, "uint8", device=None, storage=None),
    ],
)
def test_empty_takes_every_argument_form(call):
    a = call()
    assert (a.shape, a.dtype, a.device) == ((4,), "uint8", "cpu")


def test_empty_defaults():
    a = dlbridge.empty((2, 3))
    assert (a.shape, a.dtype, a.device, a.storage) == ((2, 3), "float32", "cpu", "shared")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: dlbridge.empty(), r"empty\(\) missing required argument 'shape' \(pos 1\)"),
        (lambda: dlbridge.empty(dtype="uint8"), "missing required argument 'shape'"),
        (lambda: dlbridge.empty(4, "uint8", "cpu"), r"at most 2 positional arguments \(3 given\)"),
        (lambda: dlbridge.empty(4, shape=4), "multiple values for argument 'shape'"),
        (lambda: dlbridge.empty(4, "uint8", dtype="uint8"), "multiple values for argument 'dtype'"),
        (lambda: dlbridge.empty(4, devise="cpu"), "unexpected keyword argument 'devise'"),
        (lambda: dlbridge.empty(4, storage=3), "'storage' must be a str or None, not int"),
        (lambda: dlbridge.empty(4, dtype=3.5), None),
        (lambda: dlbridge.from_dlpack(), "missing required argument 'x'"),
        (lambda: dlbridge.from_dlpack(x=np.zeros(2)), "unexpected keyword argument 'x'"),
        (lambda: dlbridge.from_dlpack(np.zeros(2), "cpu"), r"at most 1 positional argument \(2 given\)"),
        (lambda: dlbridge.from_dlpack(np.zeros(2), copy="no"), "'copy' must be a bool or None, not str"),
        (lambda: dlbridge.from_dlpack(np.zeros(2), cpy=True), "unexpected keyword argument 'cpy'"),
    ],
)
def test_bad_arguments_raise_type_errors_naming_them(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def test_bad_values_keep_their_own_errors():
    with pytest.raises(ValueError, match="negative extent"):
        dlbridge.empty(-1)
    with pytest.raises(ValueError, match="storage"):
        dlbridge.empty(4, storage="everywhere")
    with pytest.raises(MemoryError):
        dlbridge.empty((2**45,), "float64")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_version": (1, 3)},
        {"max_version": (1, 0), "dl_device": None, "copy": None},
        {"stream": None, "max_version": None},
        {not_interned("max_version"): (1, 1)},
        {"max_version": (2, 0)},
        {"dl_device": (1, 0), "copy": False},
    ],
)
def test_dlpack_takes_every_argument_form(kwargs):
    a = dlbridge.arange(6, dtype="int32")
    info = capsule_info(a.__dlpack__(**kwargs))
    versioned = (kwargs.get("max_version") or kwargs.get(not_interned("max_version")) or (0,))[0] >= 1
    assert info["name"] == ("dltensor_versioned" if versioned else "dltensor")
    assert info["data"] == a.data_ptr
    assert info["shape"] == [6]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_version": 1}, r"'max_version' must be a \(major, minor\) tuple"),
        ({"max_version": [1, 3]}, r"'max_version' must be a \(major, minor\) tuple"),
        ({"max_version": (1,)}, "non-negative ints"),
        ({"max_version": (1, 2, 3)}, "non-negative ints"),
        ({"max_version": (1, -1)}, "non-negative ints"),
        ({"max_version": (1, 2**40)}, "non-negative ints"),
        ({"max_version": (1.0, 3)}, "non-negative ints"),
        ({"max_version": (True, 3)}, "non-negative ints"),
        ({"copy": "yes"}, "'copy' must be a bool or None, not str"),
        ({"max_versions": (1, 3)}, "unexpected keyword argument 'max_versions'"),
        ({"stream": None, "stream ": None}, "unexpected keyword argument 'stream '"),
    ],
)
def test_dlpack_bad_arguments(kwargs, message):
    a = dlbridge.zeros(3)
    with pytest.raises(TypeError, match=message):
        a.__dlpack__(**kwargs)


def test_dlpack_takes_no_positional_arguments():
    a = dlbridge.zeros(3)
    with pytest.raises(TypeError, match=r"at most 0 positional arguments \(1 given\)"):
        a.__dlpack__(None)


def test_dlpack_checks_self():
    with pytest.raises(TypeError):
        dlbridge.Array.__dlpack__(np.zeros(3))
    with pytest.raises(TypeError):
        dlbridge.Array.__dlpack__()


def test_dlpack_of_a_freed_array_raises_value_error():
    a = dlbridge.zeros(3)
    dlbridge._dlbridge._free(a)
    with pytest.raises(ValueError, match="freed"):
        a.__dlpack__(max_version=(1, 3))


def test_numpy_round_trip_is_zero_copy_on_every_numpy():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = dlbridge.from_dlpack(x)
    assert a.data_ptr == ptr_of(x)
    x[1, 2] = -5.0
    assert a.tolist()[1][2] == -5.0
    # NumPy 2.0 asks for a legacy capsule (and marks the result read-only); newer NumPy asks
    # for a versioned one. Either way the memory is shared.
    back = np.from_dlpack(a)
    assert ptr_of(back) == a.data_ptr
    assert back.tolist() == x.tolist()


def test_arguments_are_released():
    # The parsed arguments are borrowed: none of them gains a reference.
    shape, dtype, version = (4, 2), not_interned("float64"), (1, 3)
    before = [sys.getrefcount(o) for o in (shape, dtype, version)]
    for _ in range(100):
        dlbridge.empty(shape, dtype).__dlpack__(max_version=version)
    assert [sys.getrefcount(o) for o in (shape, dtype, version)] == before


def test_device_strings_parse_right_through_the_cache():
    # More distinct string objects than the parse cache keeps, each used twice, interleaved with
    # strings that name other devices and bad ones (never cached).
    names = [not_interned(f"cuda:{i}") for i in range(12)] + [not_interned("cpu:0")] * 3
    for _ in range(2):
        for i, name in enumerate(names):
            expected = "cpu" if name == "cpu:0" else f"cuda:{i}"
            assert dlbridge.Device(name) == expected
            assert dlbridge.Device(not_interned("metal:1")) == "metal:1"
            with pytest.raises(ValueError):
                dlbridge.Device(not_interned("tpu:0"))
    assert dlbridge.empty(2, device=names[-1]).device == "cpu"
