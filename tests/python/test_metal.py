"""Metal (Apple GPU) <-> dlbridge, against PyTorch MPS and MLX; and what every call says where there
is no Metal.

The GPU tests need ``dlbridge.metal.is_available()`` (a Mac; every build asks for the Metal
backend, which is compiled on Apple targets) and skip with the reason elsewhere; the PyTorch ones
also need ``torch.backends.mps.is_available()``, the MLX ones an MLX that exports ``kDLMetal``.
The tests at the end run only where Metal is *not* available (Linux CI): typed errors, no crash.

DLPack's ``data`` for ``kDLMetal`` (device type 8) is the ``id<MTLBuffer>``; offsets travel in
``byte_offset``. Zero-copy is therefore proven by comparing the capsules' ``data`` handles and by a
write on one side that the other side reads. Synchronization is explicit, as in PyTorch and MLX:
``torch.mps.synchronize()`` after PyTorch writes, ``mx.eval`` after MLX writes; dlbridge's
``__dlpack__`` waits for its own GPU work (``dlbridge.synchronize("metal")`` does so by hand).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import dlbridge
from conftest import HandMadeCapsule, capsule_info, collect

K_DL_CPU = 1
K_DL_METAL = 8

METAL = dlbridge.metal.is_available()
needs_metal = pytest.mark.skipif(
    not METAL, reason=f"no Metal device: {dlbridge.metal.unavailable_reason()}"
)
without_metal = pytest.mark.skipif(METAL, reason="Metal is available here")
UNAVAILABLE = "Metal backend not available"


def storages():
    """The storage modes this OS has (managed only on macOS)."""
    modes = ["shared", "private"]
    if METAL and dlbridge.metal.device_info()["managed_storage"]:
        modes.append("managed")
    return modes


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    if not torch.backends.mps.is_available():
        pytest.skip("PyTorch reports no MPS device (torch.backends.mps.is_available() is False)")
    return torch


@pytest.fixture
def mx():
    mx = pytest.importorskip("mlx.core")
    m = mx.arange(12, dtype=mx.float32)
    mx.eval(m)
    if m.__dlpack_device__()[0] != K_DL_METAL:
        pytest.skip("this MLX exports its arrays as kDLCPU, not kDLMetal (needs MLX with Metal "
                    "DLPack sharing, ml-explore/mlx#3531)")
    return mx


def handle_and_offset(x):
    """The ``id<MTLBuffer>`` and byte offset that ``x`` exports (the capsule is not consumed)."""
    info = capsule_info(x.__dlpack__(max_version=(1, 3)))
    assert info["device"][0] == K_DL_METAL, info
    return info["data"], info["byte_offset"]


def mps_arange(torch, n, dtype=None):
    t = torch.arange(n, dtype=dtype or torch.float32, device="mps")
    torch.mps.synchronize()
    return t


def mps_storage(torch) -> str:
    """How this PyTorch allocates MPS tensors, as dlbridge finds out on import: ``"shared"`` (or
    ``"managed"``), shared without a copy, or ``"private"``, which dlbridge must copy."""
    t = mps_arange(torch, 4)
    try:
        a = dlbridge.from_dlpack(t, copy=False)
    except BufferError as e:
        assert "private" in str(e)
        return "private"
    return a.storage


@pytest.fixture
def shared_mps(torch):
    if mps_storage(torch) == "private":
        pytest.skip("this PyTorch allocates MPS tensors in private storage, which the host cannot "
                    "address: dlbridge copies them (test_private_mps_tensors_are_copied)")
    return torch


# ---------------------------------------------------------------------------------------------
# dlbridge's own Metal arrays


@needs_metal
def test_devices_are_listed_and_described():
    info = dlbridge.build_info()
    assert "metal" in info["backends"]
    assert "metal:0" in info["devices"]
    assert dlbridge.metal.device_count() >= 1
    assert dlbridge.metal.unavailable_reason() == ""
    d = dlbridge.metal.device_info()
    assert d == dlbridge.metal.devices()[0] == dlbridge.metal.device_info("metal:0")
    assert d["device"] == "metal:0" and d["name"]
    assert d["default_storage"] in ("shared", "private", "managed")
    assert d["residency"] in ("enabled", "disabled", "unsupported", "failed")
    assert d["page_size"] >= 4096
    with pytest.raises(ValueError, match="not a Metal device"):
        dlbridge.metal.device_info("cpu")
    out = subprocess.run([sys.executable, "-m", "dlbridge", "info"], capture_output=True,
                         text=True, check=True)
    assert d["name"] in out.stdout, out.stdout


@needs_metal
@pytest.mark.parametrize("storage", [None, "shared", "private", "managed"])
def test_zeros_in_every_storage_mode(storage):
    if storage is not None and storage not in storages():
        pytest.skip("managed storage exists only on macOS")
    kwargs = {} if storage is None else {"storage": storage}
    a = dlbridge.zeros((3, 5), dtype="float32", device="metal", **kwargs)
    assert a.device == "metal:0"
    assert a.__dlpack_device__() == (K_DL_METAL, 0)
    assert a.storage == (storage or dlbridge.metal.device_info()["default_storage"])
    assert a.tolist() == [[0.0] * 5] * 3


@needs_metal
@pytest.mark.parametrize("storage", storages())
def test_creation_functions_honour_storage(storage):
    for a in (
        dlbridge.empty((4,), device="metal:0", storage=storage),
        dlbridge.full((4,), 1.5, device="metal", storage=storage),
        dlbridge.arange(4, device="metal", storage=storage),
        dlbridge.asarray(np.arange(4.0), device="metal", storage=storage),
        dlbridge.asarray([1, 2, 3, 4], device="metal", storage=storage),
        dlbridge.zeros(4).to("metal", storage=storage),
    ):
        assert (a.device, a.storage, a.shape) == ("metal:0", storage, (4,))
    assert dlbridge.full((2,), 1.5, device="metal", storage=storage).tolist() == [1.5, 1.5]
    assert dlbridge.arange(4, device="metal", storage=storage).tolist() == [0, 1, 2, 3]
    assert dlbridge.storage_mode("metal", requested=storage) == (storage, "explicit")


@needs_metal
def test_private_arrays_refuse_host_access_but_copy():
    a = dlbridge.full((4,), 2.5, dtype="float32", device="metal", storage="private")
    with pytest.raises(BufferError, match="private"):
        a.__dlpack__(dl_device=(K_DL_CPU, 0), copy=False)
    with pytest.raises(ValueError):
        np.asarray(a, copy=False)
    assert np.asarray(a).tolist() == [2.5] * 4
    assert a.to("cpu").tolist() == [2.5] * 4
    b = a.copy()
    assert (b.storage, b.tolist()) == ("private", [2.5] * 4)
    assert a.astype("float64").tolist() == [2.5] * 4


@needs_metal
def test_shared_arrays_are_host_views_without_copies():
    a = dlbridge.arange(6, dtype="float32", device="metal", storage="shared")[1:]
    n = np.asarray(a)  # a view of the MTLBuffer's contents
    n[0] = 42.0
    assert a.tolist() == [42.0, 2.0, 3.0, 4.0, 5.0]
    cap = a.__dlpack__(max_version=(1, 3), dl_device=(K_DL_CPU, 0), copy=False)
    info = capsule_info(cap)
    assert info["device"] == (K_DL_CPU, 0)
    assert info["data"] + info["byte_offset"] == n.ctypes.data
    assert np.from_dlpack(a.__dlpack__(dl_device=(K_DL_CPU, 0))) is not None
    # copy=True asks for independent memory.
    c = np.from_dlpack(dlbridge.from_dlpack(a, copy=True).to("cpu"))
    c[0] = -1.0
    assert a.tolist()[0] == 42.0


@needs_metal
def test_managed_arrays_reach_the_host_as_copies():
    if "managed" not in storages():
        pytest.skip("managed storage exists only on macOS")
    a = dlbridge.arange(4, dtype="float32", device="metal", storage="managed")
    info = capsule_info(a.__dlpack__(max_version=(1, 3), dl_device=(K_DL_CPU, 0)))
    assert info["device"] == (K_DL_CPU, 0) and info["flags"] & 2  # IS_COPIED
    with pytest.raises(BufferError, match="managed"):
        a.__dlpack__(dl_device=(K_DL_CPU, 0), copy=False)
    a[1:3] = 7.0  # a host write announced to Metal (didModifyRange)
    assert a.copy().tolist() == [0.0, 7.0, 7.0, 3.0]


@needs_metal
@pytest.mark.parametrize("storage", storages())
def test_strided_views_copy_on_the_gpu(storage):
    host = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    a = dlbridge.asarray(host).to("metal", storage=storage)
    view = a.permute(2, 0, 1)[::-2, 1:, :]
    expected = host.transpose(2, 0, 1)[::-2, 1:, :].tolist()
    assert view.copy().tolist() == expected
    assert view.to("cpu").tolist() == expected
    assert np.asarray(view).tolist() == expected


@needs_metal
@pytest.mark.parametrize("storage", storages())
def test_setitem_and_astype_on_the_gpu(storage):
    a = dlbridge.zeros((2, 3), dtype="int32", device="metal", storage=storage)
    a[0] = 5
    a[1, ::2] = np.array([7, 8], dtype=np.int32)
    a[1, 1] = dlbridge.full((), 9, dtype="int32", device="metal", storage="private")
    assert a.tolist() == [[5, 5, 5], [7, 9, 8]]
    f = a.astype("float16")
    assert (f.device, f.dtype, f.tolist()) == ("metal:0", "float16", [[5, 5, 5], [7, 9, 8]])


@needs_metal
@pytest.mark.parametrize("storage", storages())
def test_pool_reuses_and_rezeroes_metal_blocks(storage):
    dlbridge.synchronize("metal")
    a = dlbridge.full((1000,), 3.0, dtype="float32", device="metal", storage=storage)
    dlbridge.synchronize("metal")
    before = dlbridge.memory_stats("metal", storage=storage)
    del a
    collect()
    assert dlbridge.memory_stats("metal", storage=storage)["cached_blocks"] >= 1
    b = dlbridge.zeros((1000,), dtype="float32", device="metal", storage=storage)
    after = dlbridge.memory_stats("metal", storage=storage)
    assert after["cache_hits"] == before["cache_hits"] + 1
    assert after["driver_allocations"] == before["driver_allocations"]
    assert b.tolist() == [0.0] * 1000, "a recycled block is zeroed again"
    del b
    collect()
    dlbridge.empty_cache("metal", storage=storage)
    assert dlbridge.memory_stats("metal", storage=storage)["cached_bytes"] == 0


@needs_metal
def test_shared_blocks_wait_for_the_gpu_before_reuse():
    src = dlbridge.full((1 << 16,), 1.0, dtype="float32", device="metal", storage="private")
    dlbridge.synchronize("metal")
    dst = dlbridge.empty((1 << 16,), dtype="float32", device="metal", storage="shared")
    dst[:] = src  # a GPU copy, encoded but not waited for
    handle = dst.data_ptr  # the id<MTLBuffer> (exporting would synchronize)
    del dst
    collect()
    # The copy may still be writing the released block: a new request must not get it.
    fresh = dlbridge.zeros((1 << 16,), dtype="float32", device="metal", storage="shared")
    assert fresh.data_ptr != handle
    assert fresh.tolist()[:4] == [0.0] * 4


@needs_metal
def test_memory_limits_per_storage_pool():
    dlbridge.set_memory_limit(1 << 20, "metal", storage="private")
    try:
        with pytest.raises(MemoryError, match="memory limit"):
            dlbridge.empty((1 << 21,), dtype="uint8", device="metal", storage="private")
        dlbridge.empty((1 << 21,), dtype="uint8", device="metal", storage="shared")
    finally:
        dlbridge.set_memory_limit(None, "metal", storage="private")
    dlbridge.reset_peak_memory("metal", storage="private")
    dlbridge.set_cache_limit(None, "metal", storage="private")


@needs_metal
def test_synchronize_spellings():
    a = dlbridge.arange(4, device="metal")
    dlbridge.synchronize("metal")
    dlbridge.synchronize("metal:0")
    dlbridge.synchronize(a.device)
    dlbridge.metal.synchronize()
    dlbridge.metal.synchronize(0)
    dlbridge.synchronize("cpu")  # nothing to wait for
    with pytest.raises(ValueError):
        dlbridge.metal.synchronize("cpu")


# ---------------------------------------------------------------------------------------------
# PyTorch MPS


@needs_metal
def test_mps_to_dlbridge_is_zero_copy(shared_mps):
    torch = shared_mps
    t = mps_arange(torch, 12).reshape(3, 4)
    a = dlbridge.from_dlpack(t)
    assert a.device == "metal:0"
    assert handle_and_offset(a) == handle_and_offset(t)
    assert a.tolist() == t.cpu().tolist()
    # A PyTorch write is what dlbridge reads next (after PyTorch's queue drained).
    t[1, 2] = -7.0
    torch.mps.synchronize()
    assert a.tolist()[1][2] == -7.0


@needs_metal
def test_mps_slices_keep_the_buffer_and_move_the_offset(shared_mps):
    t = mps_arange(shared_mps, 12)
    s = t[4:]
    a = dlbridge.from_dlpack(s)
    base_handle, _ = handle_and_offset(t)
    handle, offset = handle_and_offset(a)
    assert handle == base_handle
    assert offset == 16
    assert a.tolist() == list(range(4, 12))


@needs_metal
def test_dlbridge_to_mps_is_zero_copy(torch):
    a = dlbridge.arange(12, dtype="float32", device="metal")
    t = torch.from_dlpack(a)  # __dlpack__ waits for dlbridge's GPU work itself
    assert t.device.type == "mps"
    assert handle_and_offset(t) == handle_and_offset(a)
    t[0] = 42.0
    torch.mps.synchronize()
    assert a.tolist()[0] == 42.0


@needs_metal
@pytest.mark.parametrize("copy", [None, True, False])
def test_copy_keyword_from_mps(copy, shared_mps):
    t = mps_arange(shared_mps, 6)
    a = dlbridge.from_dlpack(t, copy=copy)
    same = handle_and_offset(a)[0] == handle_and_offset(t)[0]
    assert same == (copy is not True)
    assert a.tolist() == list(range(6))


@needs_metal
def test_private_producer_is_copied_or_refused():
    # dlbridge's own private array, handed back through DLPack, stands in for a private producer.
    p = dlbridge.full((5,), 3.0, dtype="float32", device="metal", storage="private")
    a = dlbridge.from_dlpack(p.__dlpack__(max_version=(1, 3)))
    assert a.storage == "shared"
    assert handle_and_offset(a)[0] != handle_and_offset(p)[0]
    assert a.tolist() == [3.0] * 5
    with pytest.raises(BufferError, match="private"):
        dlbridge.from_dlpack(p.__dlpack__(max_version=(1, 3)), copy=False)


@needs_metal
def test_private_mps_tensors_are_copied(torch):
    if mps_storage(torch) != "private":
        pytest.skip("this PyTorch allocates MPS tensors in host-visible storage (shared, no copy)")
    t = mps_arange(torch, 8).reshape(2, 4)
    a = dlbridge.from_dlpack(t)
    assert a.storage == "shared"
    assert handle_and_offset(a)[0] != handle_and_offset(t)[0]
    assert a.tolist() == t.cpu().tolist()
    # The copy is complete and independent: later PyTorch writes do not reach it.
    t[0, 0] = 100.0
    torch.mps.synchronize()
    assert a.tolist()[0][0] == 0.0


@needs_metal
def test_mps_tensor_lifetime(shared_mps):
    torch = shared_mps
    t = mps_arange(torch, 1024)
    a = dlbridge.from_dlpack(t)
    del t
    collect()
    assert a.tolist()[1023] == 1023.0, "the import keeps PyTorch's tensor alive"


# ---------------------------------------------------------------------------------------------
# MLX


@needs_metal
def test_mlx_to_dlbridge_is_zero_copy(mx):
    m = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    mx.eval(m)
    a = dlbridge.from_dlpack(m)
    assert a.device == "metal:0"
    assert handle_and_offset(a) == handle_and_offset(m)
    assert a.tolist() == m.tolist()


@needs_metal
def test_dlbridge_to_mlx_is_zero_copy(mx):
    a = dlbridge.arange(8, dtype="float32", device="metal")
    m = mx.from_dlpack(a)
    mx.eval(m)
    assert m.tolist() == list(range(8))
    assert handle_and_offset(m) == handle_and_offset(a)


@needs_metal
def test_mps_through_dlbridge_to_mlx_keeps_one_buffer(shared_mps, mx):
    t = mps_arange(shared_mps, 16)
    a = dlbridge.from_dlpack(t)
    m = mx.from_dlpack(a)
    mx.eval(m)
    assert handle_and_offset(m)[0] == handle_and_offset(t)[0]
    assert m.tolist() == list(range(16))


# ---------------------------------------------------------------------------------------------
# safetensors checkpoints onto Metal: the mapped file wrapped in MTLBuffers, no copy


def _checkpoint(tmp_path):
    """A checkpoint written by ``safetensors`` (pages of weights, small tensors beside them, an
    empty one), and what ``safetensors`` loads from it on the CPU."""
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(11)
    tensors = {"w": rng.standard_normal((300, 129)).astype(np.float32),
               "bias": rng.standard_normal(129).astype(np.float16),
               "idx": np.arange(-5, 12, dtype=np.int64),
               "mask": np.array([True, False, True]),
               "empty": np.zeros((0, 3), np.float32)}
    path = tmp_path / "model.safetensors"
    st.save_file(tensors, str(path))
    return path, st.load_file(str(path))


@needs_metal
def test_load_file_onto_metal_equals_safetensors(tmp_path):
    path, expected = _checkpoint(tmp_path)
    info = dlbridge.metal.device_info()
    loaded = dlbridge.load_file(path, device="metal:0")
    assert sorted(loaded) == sorted(expected)
    checkpoint = dlbridge._dlbridge._Checkpoint(str(path))
    bases = set()
    for name, ref in expected.items():
        a = loaded[name]
        assert (a.device, a.storage) == ("metal:0", info["default_storage"]), name
        np.testing.assert_array_equal(np.asarray(a), ref)
        if info["default_storage"] == "shared" and ref.size:
            # No copy: read-only views of one mapping of the file, each at its file offset.
            start = checkpoint.info(name)[2][0]
            address = np.asarray(a).ctypes.data
            assert a.readonly and a.is_foreign, name
            assert address % info["page_size"] == start % info["page_size"], name
            bases.add(address - start)
    assert len(bases) <= 1, bases
    # copy=True: writable memory of its own.
    copies = dlbridge.load_file(path, device="metal:0", copy=True)
    for name, ref in expected.items():
        a = copies[name]
        assert not a.readonly and not a.is_foreign, name
        np.testing.assert_array_equal(np.asarray(a), ref)
    # A dtype conversion runs on the GPU after the load; integers and booleans stay as they are.
    halves = dlbridge.load_file(path, device="metal:0", dtype="float16")
    assert (halves["w"].dtype, halves["idx"].dtype, halves["mask"].dtype) == (
        "float16", "int64", "bool")
    np.testing.assert_allclose(np.asarray(halves["w"]), expected["w"].astype(np.float16),
                               rtol=1e-3, atol=1e-4)


@needs_metal
def test_load_file_into_private_storage_is_a_gpu_copy(tmp_path):
    """The storage mode is read once per process: a child interpreter loads with private
    storage, and hands the values back in a NumPy file."""
    path, expected = _checkpoint(tmp_path)
    got = tmp_path / "got.npz"
    code = ("import sys, numpy as np, dlbridge\n"
            "w = dlbridge.load_file(sys.argv[1], device='metal')\n"
            "print(sorted({a.storage for a in w.values()}), any(a.readonly for a in w.values()))\n"
            "np.savez(sys.argv[2], **{k: np.asarray(a) for k, a in w.items()})\n")
    env = dict(os.environ, DLBRIDGE_METAL_STORAGE_MODE="private")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(got)], capture_output=True,
                         text=True, env=env, check=True)
    assert out.stdout.split() == ["['private']", "False"], out.stdout
    with np.load(got) as arrays:
        for name, ref in expected.items():
            np.testing.assert_array_equal(arrays[name], ref)


# ---------------------------------------------------------------------------------------------
# Environment switches (read once per process: checked in a child interpreter)


@needs_metal
@pytest.mark.parametrize("value, disabled", [("0", True), ("off", True), ("1", False)])
def test_residency_switch(value, disabled):
    code = "import dlbridge; print(dlbridge.metal.device_info(0)['residency'])"
    env = dict(os.environ, DLBRIDGE_METAL_RESIDENCY=value)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert (out.stdout.strip() == "disabled") == disabled, out.stdout


@needs_metal
@pytest.mark.parametrize("value", ["private", "shared"])
def test_metal_storage_mode_variable(value):
    code = ("import dlbridge; print(dlbridge.storage_mode('metal'), "
            "dlbridge.zeros(2, device='metal').storage)")
    env = dict(os.environ, DLBRIDGE_METAL_STORAGE_MODE=value)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.split() == [f"('{value}',", "'environment')", value], out.stdout


# ---------------------------------------------------------------------------------------------
# Without Metal: typed errors, never a crash.


@without_metal
def test_availability_is_reported():
    assert dlbridge.metal.is_available() is False
    assert dlbridge.metal.device_count() == 0
    assert dlbridge.metal.unavailable_reason().startswith(UNAVAILABLE)
    assert not any(d.startswith("metal") for d in dlbridge.build_info()["devices"])


@without_metal
@pytest.mark.parametrize("call", [
    pytest.param(lambda: dlbridge.empty(3, device="metal"), id="empty"),
    pytest.param(lambda: dlbridge.zeros((2, 2), device="metal:1"), id="zeros-metal:1"),
    pytest.param(lambda: dlbridge.zeros(3, device="metal", storage="private"), id="zeros-private"),
    pytest.param(lambda: dlbridge.full(3, 1.0, device="metal", storage="shared"), id="full"),
    pytest.param(lambda: dlbridge.arange(3, device="metal"), id="arange"),
    pytest.param(lambda: dlbridge.asarray([1.0, 2.0], device="metal"), id="asarray-list"),
    pytest.param(lambda: dlbridge.zeros(3).to("metal"), id="to"),
    pytest.param(lambda: dlbridge.zeros(3).to("metal", storage="managed"), id="to-managed"),
    pytest.param(lambda: dlbridge.synchronize("metal"), id="synchronize"),
    pytest.param(lambda: dlbridge.metal.synchronize(), id="metal.synchronize"),
    pytest.param(lambda: dlbridge.metal.device_info(), id="metal.device_info"),
    pytest.param(lambda: dlbridge.metal.devices(), id="metal.devices"),
    pytest.param(lambda: dlbridge.metal.residency_allocation_count(), id="metal.residency"),
    pytest.param(lambda: dlbridge.memory_stats("metal"), id="memory_stats"),
    pytest.param(lambda: dlbridge.memory_stats("metal", storage="private"),
                 id="memory_stats-private"),
    pytest.param(lambda: dlbridge.empty_cache("metal"), id="empty_cache"),
    pytest.param(lambda: dlbridge.set_cache_limit(0, "metal"), id="set_cache_limit"),
    pytest.param(lambda: dlbridge.storage_mode("metal", requested="private"), id="storage_mode"),
])
def test_metal_calls_raise_runtime_error(call):
    with pytest.raises(RuntimeError, match=UNAVAILABLE):
        call()


@without_metal
def test_moving_existing_data_to_metal_is_a_buffer_error():
    """DLPack imports to a device dlbridge cannot reach raise BufferError (the array API's word
    for an exchange it cannot do), naming the reason."""
    a = dlbridge.arange(3)
    with pytest.raises(BufferError, match=UNAVAILABLE):
        dlbridge.from_dlpack(a, device="metal")
    with pytest.raises(BufferError, match=UNAVAILABLE):
        dlbridge.asarray(np.arange(3.0), device="metal")
    with pytest.raises(BufferError, match="copy=False"):
        dlbridge.from_dlpack(a, device="metal", copy=False)


@without_metal
def test_foreign_metal_tensors_are_held_and_handed_on_untouched():
    """A kDLMetal capsule (as PyTorch MPS or MLX would make) is held by its handle; what needs
    the GPU raises, and the producer's deleter still runs once."""
    owner = np.zeros(16, dtype=np.float32)
    caps = HandMadeCapsule(owner, 0x1000, [2, 4], [4, 1], (2, 32, 1), byte_offset=16,
                           device=(K_DL_METAL, 0))
    a = dlbridge.from_dlpack(caps.capsule)
    assert (a.device, a.shape, a.byte_offset) == ("metal:0", (2, 4), 16)
    info = capsule_info(a[1].__dlpack__(max_version=(1, 3)))
    assert (info["data"], info["byte_offset"], info["device"]) == (0x1000, 32, (K_DL_METAL, 0))
    with pytest.raises(BufferError, match="not host-accessible"):
        a.tolist()
    with pytest.raises(BufferError):
        np.asarray(a)
    with pytest.raises(BufferError):
        a.__dlpack__(dl_device=(K_DL_CPU, 0))
    with pytest.raises(RuntimeError, match=UNAVAILABLE):
        a.copy()
    assert caps.deleted == 0
    del a, info
    collect()
    assert caps.deleted == 1
