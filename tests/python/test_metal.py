"""Metal (Apple GPU) <-> dlbridge, against PyTorch MPS and MLX.

Skips, saying why, unless this is a Mac where ``torch.backends.mps.is_available()`` and dlbridge
was built with its Metal backend (``"metal" in dlbridge.build_info()["backends"]``).

DLPack's ``data`` for ``kDLMetal`` (device type 8) is the ``id<MTLBuffer>``; offsets travel in
``byte_offset``. Zero-copy is therefore proven by comparing the capsules' ``data`` handles and by a
write on one side that the other side reads. Synchronization is explicit, as in PyTorch and MLX:
``torch.mps.synchronize()`` after PyTorch writes, ``mx.eval`` after MLX writes, and
``dlbridge.synchronize("metal")`` after dlbridge's own GPU work, before another framework reads.

The tests are written against the intended Python API of the Metal backend (``device="metal"``,
``storage=...``, ``dlbridge.synchronize``); the Rust side is ``dlbridge::backend::metal``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import dlbridge
from conftest import capsule_info, collect

torch = pytest.importorskip("torch")

K_DL_METAL = 8

if "metal" not in dlbridge.build_info()["backends"]:
    pytest.skip("dlbridge was built without its Metal backend (feature `metal`, Apple only)",
                allow_module_level=True)
if not torch.backends.mps.is_available():
    pytest.skip("PyTorch reports no MPS device (torch.backends.mps.is_available() is False)",
                allow_module_level=True)


def handle_and_offset(x):
    """The ``id<MTLBuffer>`` and byte offset that ``x`` exports (the capsule is not consumed)."""
    info = capsule_info(x.__dlpack__(max_version=(1, 3)))
    assert info["device"][0] == K_DL_METAL, info
    return info["data"], info["byte_offset"]


def mps_arange(n, dtype=torch.float32):
    t = torch.arange(n, dtype=dtype, device="mps")
    torch.mps.synchronize()
    return t


def mps_storage() -> str:
    """How this PyTorch allocates MPS tensors, as dlbridge finds out on import: ``"shared"`` (or
    ``"managed"``), shared without a copy, or ``"private"``, which dlbridge must copy."""
    t = mps_arange(4)
    try:
        a = dlbridge.from_dlpack(t, copy=False)
    except BufferError as e:
        assert "private" in str(e)
        return "private"
    return a.storage


@pytest.fixture
def shared_mps():
    storage = mps_storage()
    if storage == "private":
        pytest.skip("this PyTorch allocates MPS tensors in private storage, which the host cannot "
                    "address: dlbridge copies them (test_private_mps_tensors_are_copied)")
    return storage


# ---------------------------------------------------------------------------------------------
# dlbridge's own Metal arrays


def test_metal_device_is_listed():
    info = dlbridge.build_info()
    assert "metal:0" in info["devices"]


@pytest.mark.parametrize("storage", [None, "shared", "private", "managed"])
def test_zeros_in_every_storage_mode(storage):
    kwargs = {} if storage is None else {"storage": storage}
    a = dlbridge.zeros((3, 5), dtype="float32", device="metal", **kwargs)
    assert a.device == "metal:0"
    assert a.__dlpack_device__() == (K_DL_METAL, 0)
    assert a.tolist() == [[0.0] * 5] * 3


def test_private_arrays_refuse_host_access_but_copy():
    a = dlbridge.full((4,), 2.5, dtype="float32", device="metal", storage="private")
    with pytest.raises(BufferError):
        memoryview(a)
    assert a.to("cpu").tolist() == [2.5] * 4
    assert a.copy().tolist() == [2.5] * 4


def test_strided_views_copy_on_the_gpu():
    t = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    a = dlbridge.asarray(t.numpy()).to("metal")
    view = a.permute((2, 0, 1))[::-2, 1:, :]
    expected = t.permute(2, 0, 1)[::-2, 1:, :].contiguous().tolist()
    assert view.copy().tolist() == expected
    assert view.to("cpu").tolist() == expected


# ---------------------------------------------------------------------------------------------
# PyTorch MPS


def test_mps_to_dlbridge_is_zero_copy(shared_mps):
    t = mps_arange(12).reshape(3, 4)
    a = dlbridge.from_dlpack(t)
    assert a.device == "metal:0"
    assert handle_and_offset(a) == handle_and_offset(t)
    assert a.tolist() == t.cpu().tolist()
    # A PyTorch write is what dlbridge reads next (after PyTorch's queue drained).
    t[1, 2] = -7.0
    torch.mps.synchronize()
    assert a.tolist()[1][2] == -7.0


def test_mps_slices_keep_the_buffer_and_move_the_offset(shared_mps):
    t = mps_arange(12)
    s = t[4:]
    a = dlbridge.from_dlpack(s)
    base_handle, _ = handle_and_offset(t)
    handle, offset = handle_and_offset(a)
    assert handle == base_handle
    assert offset == 16
    assert a.tolist() == list(range(4, 12))


def test_dlbridge_to_mps_is_zero_copy():
    a = dlbridge.arange(12, dtype="float32", device="metal")
    dlbridge.synchronize("metal")
    t = torch.from_dlpack(a)
    assert t.device.type == "mps"
    assert handle_and_offset(t) == handle_and_offset(a)
    t[0] = 42.0
    torch.mps.synchronize()
    assert a.tolist()[0] == 42.0


@pytest.mark.parametrize("copy", [None, True, False])
def test_copy_keyword_from_mps(copy, shared_mps):
    t = mps_arange(6)
    a = dlbridge.from_dlpack(t, copy=copy)
    same = handle_and_offset(a)[0] == handle_and_offset(t)[0]
    assert same == (copy is not True)
    assert a.tolist() == list(range(6))


def test_private_producer_is_copied_or_refused():
    # dlbridge's own private array, handed back through DLPack, stands in for a private producer.
    p = dlbridge.full((5,), 3.0, dtype="float32", device="metal", storage="private")
    dlbridge.synchronize("metal")
    a = dlbridge.from_dlpack(p)
    assert handle_and_offset(a)[0] != handle_and_offset(p)[0]
    assert a.tolist() == [3.0] * 5
    with pytest.raises(BufferError, match="private"):
        dlbridge.from_dlpack(p, copy=False)


def test_private_mps_tensors_are_copied():
    if mps_storage() != "private":
        pytest.skip("this PyTorch allocates MPS tensors in host-visible storage (shared, no copy)")
    t = mps_arange(8).reshape(2, 4)
    a = dlbridge.from_dlpack(t)
    assert a.storage == "shared"
    assert handle_and_offset(a)[0] != handle_and_offset(t)[0]
    assert a.tolist() == t.cpu().tolist()
    # The copy is complete and independent: later PyTorch writes do not reach it.
    t[0, 0] = 100.0
    torch.mps.synchronize()
    assert a.tolist()[0][0] == 0.0


# ---------------------------------------------------------------------------------------------
# MLX


def _mlx():
    mx = pytest.importorskip("mlx.core")
    m = mx.arange(12, dtype=mx.float32)
    mx.eval(m)
    if m.__dlpack_device__()[0] != K_DL_METAL:
        pytest.skip("this MLX exports its arrays as kDLCPU, not kDLMetal (needs MLX with Metal "
                    "DLPack sharing, ml-explore/mlx#3531)")
    return mx


def test_mlx_to_dlbridge_is_zero_copy():
    mx = _mlx()
    m = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    mx.eval(m)
    a = dlbridge.from_dlpack(m)
    assert a.device == "metal:0"
    assert handle_and_offset(a) == handle_and_offset(m)
    assert a.tolist() == m.tolist()


def test_dlbridge_to_mlx_is_zero_copy():
    mx = _mlx()
    a = dlbridge.arange(8, dtype="float32", device="metal")
    dlbridge.synchronize("metal")
    m = mx.from_dlpack(a)
    mx.eval(m)
    assert m.tolist() == list(range(8))
    assert handle_and_offset(m) == handle_and_offset(a)


def test_mps_through_dlbridge_to_mlx_keeps_one_buffer(shared_mps):
    mx = _mlx()
    t = mps_arange(16)
    a = dlbridge.from_dlpack(t)
    m = mx.from_dlpack(a)
    mx.eval(m)
    assert handle_and_offset(m)[0] == handle_and_offset(t)[0]
    assert m.tolist() == list(range(16))


# ---------------------------------------------------------------------------------------------
# Environment switches (read once per process: checked in a child interpreter)


@pytest.mark.parametrize("value, disabled", [("0", True), ("off", True), ("1", False)])
def test_residency_switch(value, disabled):
    code = "import dlbridge; print(dlbridge.metal_device_info(0)['residency'])"
    env = dict(os.environ, DLBRIDGE_METAL_RESIDENCY=value)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert (out.stdout.strip() == "disabled") == disabled, out.stdout
