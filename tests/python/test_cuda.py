"""CUDA: creation in each storage kind, copies, zero-copy exchange with PyTorch, CuPy and JAX in
both directions, stream handoff, lifetimes and bad input.

Every test here needs a CUDA GPU and skips (with the reason) where there is none, as on CI.
"""

import gc
import threading

import numpy as np
import pytest

import dlbridge
from conftest import HandMadeCapsule, collect

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not dlbridge.cuda.is_available(),
        reason=f"no CUDA GPU: {dlbridge.cuda.unavailable_reason()}",
    ),
]

KINDS = {"device": "cuda:0", "pinned": "cuda_host:0", "managed": "cuda_managed:0"}


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here")
    return torch


@pytest.fixture(scope="module")
def cupy():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any CuPy start-up failure means no CuPy GPU
        pytest.skip(f"CuPy cannot use the GPU: {e}")
    return cupy


@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    import jax.dlpack  # noqa: F401

    return jax


def host(a) -> np.ndarray:
    """A NumPy copy of a dlbridge array on any device."""
    return np.asarray(a.to("cpu"))


# ---------------------------------------------------------------------------------------------
# Creation, host access and copies.


@pytest.mark.parametrize("storage", list(KINDS))
def test_creation_in_each_storage(storage):
    a = dlbridge.arange(10, dtype="float32", device="cuda:0", storage=storage)
    assert a.device == KINDS[storage]
    assert a.tolist() == list(range(10))
    z = dlbridge.zeros((3, 5), dtype="int32", device="cuda:0", storage=storage)
    assert host(z).tolist() == [[0] * 5] * 3
    f = dlbridge.full((4,), 2.5, dtype="float64", device="cuda:0", storage=storage)
    assert f.tolist() == [2.5] * 4
    assert dlbridge.empty((0, 3), device="cuda:0", storage=storage).size == 0


def test_storage_aliases_and_conflicts():
    assert dlbridge.zeros(2, device="cuda:0", storage="private").device == "cuda:0"
    assert dlbridge.zeros(2, device="cuda:0", storage="shared").device == "cuda_host:0"
    assert dlbridge.zeros(2, device="cuda_managed:0").device == "cuda_managed:0"
    with pytest.raises(ValueError, match="conflicts"):
        dlbridge.zeros(2, device="cuda_host:0", storage="managed")


@pytest.mark.parametrize("storage", ["pinned", "managed"])
def test_host_visible_kinds_share_memory_with_numpy(storage):
    a = dlbridge.arange(6, dtype="float32", device="cuda:0", storage=storage)
    view = np.asarray(a)
    assert view.ctypes.data == a.data_ptr  # no copy: the host reads the same memory
    view[2] = 42.0
    assert a.tolist()[2] == 42.0


def test_device_memory_refuses_host_views():
    a = dlbridge.zeros(4, device="cuda:0")
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(a, copy=False)
    assert np.asarray(a).tolist() == [0.0] * 4  # a host copy is allowed


DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
          "complex64", "complex128"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype(dtype, rng):
    x = (rng.standard_normal((7, 33)) * 10).astype(dtype)
    a = dlbridge.asarray(x, device="cuda:0")
    assert a.device == "cuda:0" and a.dtype == dtype
    np.testing.assert_array_equal(host(a), x)


VIEWS = {
    "transpose": lambda x: x.T,
    "negative step": lambda x: x[::-1, ::-2],
    "offset slice": lambda x: x[3:, 5:40],
    "column": lambda x: x[:, 7],
    "broadcast": lambda x: np.broadcast_to(x[:1], x.shape),
    "every third row": lambda x: x[::3],
    "0-d": lambda x: x[2, 3],
}
VIEWS_DL = {
    "transpose": lambda a: a.T,
    "negative step": lambda a: a[::-1, ::-2],
    "offset slice": lambda a: a[3:, 5:40],
    "column": lambda a: a[:, 7],
    "broadcast": lambda a: a[:1].broadcast_to(a.shape),
    "every third row": lambda a: a[::3],
    "0-d": lambda a: a[2, 3],
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("dtype", ["uint8", "float16", "float32", "complex128"])
def test_strided_copies_on_the_device(view, dtype, rng):
    x = (rng.standard_normal((64, 96)) * 100).astype(dtype)
    a = dlbridge.asarray(x, device="cuda:0")
    v = VIEWS_DL[view](a)
    expected = VIEWS[view](x)
    c = v.copy()  # strided -> compact on the GPU
    assert c.device == "cuda:0" and c.shape == expected.shape
    np.testing.assert_array_equal(host(c), expected)
    np.testing.assert_array_equal(host(v), expected)  # device view -> host directly
    # host view -> device, then back
    back = dlbridge.asarray(np.ascontiguousarray(expected)).to("cuda:0")
    np.testing.assert_array_equal(host(back), expected)


def test_copies_between_every_pair_of_kinds(rng):
    x = rng.standard_normal((31, 17)).astype(np.float32)
    for src_storage in KINDS:
        a = dlbridge.asarray(x, device="cuda:0", storage=src_storage)
        for dst in [*KINDS.values(), "cpu"]:
            b = a[:, ::2].to(dst)
            assert b.device == dst
            np.testing.assert_array_equal(host(b), x[:, ::2])


def test_strided_destinations_across_host_and_device(rng):
    x = rng.standard_normal((40, 30)).astype(np.float32)
    a = dlbridge.asarray(x, device="cuda:0")
    h = np.zeros((40, 30), np.float32)
    dlbridge.asarray(h)[:, ::2] = a[:, ::2]  # device -> strided host view (zero-copy over h)
    expected = np.zeros_like(x)
    expected[:, ::2] = x[:, ::2]
    np.testing.assert_array_equal(h, expected)
    d = dlbridge.zeros((30, 40), dtype="float32", device="cuda:0")
    d[::3] = dlbridge.asarray(np.ascontiguousarray(x.T[::3]))  # host -> strided device view
    expected = np.zeros((30, 40), np.float32)
    expected[::3] = x.T[::3]
    np.testing.assert_array_equal(host(d), expected)


def test_setitem_writes_device_memory(rng):
    a = dlbridge.zeros((4, 6), dtype="float32", device="cuda:0")
    a[1] = 3.0
    a[:, 2] = np.arange(4, dtype=np.float32)
    expected = np.zeros((4, 6), np.float32)
    expected[1] = 3.0
    expected[:, 2] = np.arange(4)
    np.testing.assert_array_equal(host(a), expected)


def test_large_transpose_matches_numpy(rng):
    x = rng.standard_normal((1023, 2049)).astype(np.float32)
    a = dlbridge.asarray(x, device="cuda:0")
    np.testing.assert_array_equal(host(a.T.copy()), x.T)
    b = dlbridge.asarray(x.reshape(3, 341, 2049), device="cuda:0")
    np.testing.assert_array_equal(host(b.permute(0, 2, 1).copy()),
                                  x.reshape(3, 341, 2049).transpose(0, 2, 1))


# ---------------------------------------------------------------------------------------------
# PyTorch.


def test_torch_to_dlbridge_zero_copy_both_ways(torch):
    t = torch.arange(12.0, device="cuda").reshape(3, 4)
    a = dlbridge.from_dlpack(t)
    assert a.device == "cuda:0" and a.data_ptr == t.data_ptr()
    t[0, 0] = 42.0
    assert a.tolist()[0][0] == 42.0
    a[2, 3] = -1.0
    torch.cuda.synchronize()
    assert t[2, 3].item() == -1.0


@pytest.mark.parametrize("view", ["t", "cols", "offset", "row", "0-d", "empty"])
def test_torch_views(torch, view):
    base = torch.arange(48.0, device="cuda").reshape(6, 8)
    t = {"t": base.T, "cols": base[:, ::3], "offset": base[2:, 3:], "row": base[4],
         "0-d": base[1, 1], "empty": base[:0]}[view]
    a = dlbridge.from_dlpack(t)
    assert a.shape == tuple(t.shape)
    assert a.strides == tuple(t.stride())
    if t.numel():
        assert a.data_ptr == t.data_ptr()
    np.testing.assert_array_equal(host(a), t.cpu().numpy())


def test_dlbridge_to_torch_zero_copy(torch):
    a = dlbridge.arange(20, dtype="float32", device="cuda:0")
    t = torch.from_dlpack(a)
    assert t.device.type == "cuda" and t.data_ptr() == a.data_ptr
    t[3] = 99.0
    torch.cuda.synchronize()
    assert a.tolist()[3] == 99.0
    a[4] = -5.0
    assert t[4].item() == -5.0
    v = torch.from_dlpack(a.reshape((4, 5))[1:, ::2])
    assert v.data_ptr() == a.data_ptr + 5 * 4
    assert v.cpu().tolist() == [[5.0, 7.0, 9.0], [10.0, 12.0, 14.0], [15.0, 17.0, 19.0]]


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                                   "bfloat16", "float32", "float64", "complex64", "complex128"])
def test_torch_dtypes_both_ways(torch, dtype):
    tdtype = getattr(torch, dtype)
    t = (torch.arange(10, device="cuda") % 3).to(tdtype)
    a = dlbridge.from_dlpack(t)
    assert a.dtype == dtype and a.data_ptr == t.data_ptr()
    back = torch.from_dlpack(a)
    assert back.dtype == tdtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)


@pytest.mark.parametrize("nbytes", [4096, 3 << 20, 64 << 20])
def test_pinned_memory_is_copied_from_and_read_in_a_forked_child(nbytes):
    """Pinned blocks of 2 MiB and more are pages of dlbridge's own registered with the driver
    (huge pages where the kernel has them), smaller ones the driver's: both copy both ways at
    every offset, and a forked child reads what the parent wrote, as it reads the driver's."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import ctypes, os
        import numpy as np
        import dlbridge
        n = {nbytes}
        a = dlbridge.asarray(np.arange(n, dtype=np.uint8) ^ 0x5A, device="cuda_host:0")
        assert a.device == "cuda_host:0"
        d = a.to("cuda:0")
        back = np.asarray(d.to("cuda_host:0").to("cpu"))
        assert (back == (np.arange(n, dtype=np.uint8) ^ 0x5A)).all(), "round trip"
        view = (ctypes.c_ubyte * n).from_address(a.data_ptr)
        pid = os.fork()
        if pid == 0:
            ok = view[n - 1] == ((n - 1) & 0xFF) ^ 0x5A and view[0] == 0x5A
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("child", status)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_pinned_memory_as_cuda_host(torch):
    t = torch.arange(8.0).pin_memory()
    # PyTorch exports pinned memory as kDLCPU; a producer that says kDLCUDAHost is checked against
    # the driver (the memory must be pinned) and imported zero-copy as such.
    b = dlbridge.from_dlpack(t)
    assert b.data_ptr == t.data_ptr() and b.device == "cpu"
    cap = HandMadeCapsule(t, t.data_ptr(), [8], [1], (2, 32, 1), device=(3, 0))
    a = dlbridge.from_dlpack(cap.capsule)
    assert a.device == "cuda_host:0" and a.data_ptr == t.data_ptr()
    assert a.tolist() == list(map(float, range(8)))
    t[1] = 11.0
    assert a[1].item() == 11.0
    del a
    collect()
    assert cap.deleted == 1


def test_torch_producer_lifetime_and_deleter(torch):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    t = torch.arange(float(1 << 20), device="cuda")
    held = torch.cuda.memory_allocated() - base
    assert held >= 4 << 20
    a = dlbridge.from_dlpack(t)
    del t
    collect()
    assert torch.cuda.memory_allocated() - base == held  # dlbridge keeps the producer alive
    assert a[(1 << 20) - 1].item() == float((1 << 20) - 1)
    del a
    collect()
    assert torch.cuda.memory_allocated() == base  # released (exactly once: no double free)


def test_dlbridge_producer_lifetime_and_deleter(torch):
    a = dlbridge.arange(100, dtype="int64", device="cuda:0")
    refs = a._buffer_ref_count
    t = torch.from_dlpack(a)
    assert a._buffer_ref_count == refs + 1
    view = a[10:]
    del a
    collect()
    assert t[99].item() == 99
    del t
    collect()
    assert view._buffer_ref_count == refs  # the export's reference was released once


def test_copy_semantics_with_torch(torch):
    t = torch.arange(6.0, device="cuda")
    same = dlbridge.from_dlpack(t, copy=False)
    assert same.data_ptr == t.data_ptr()
    other = dlbridge.from_dlpack(t, copy=True)
    assert other.data_ptr != t.data_ptr() and other.device == "cuda:0"
    t[0] = 7.0
    assert other.tolist()[0] == 0.0 and same.tolist()[0] == 7.0
    on_host = dlbridge.from_dlpack(t, device="cpu")
    assert on_host.device == "cpu" and on_host.tolist()[0] == 7.0
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(t, device="cpu", copy=False)


def test_export_to_host_when_asked():
    a = dlbridge.arange(5, dtype="float32", device="cuda:0")
    x = np.from_dlpack(a, device="cpu")
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(BufferError):
        a.__dlpack__(dl_device=(1, 0), copy=False, max_version=(1, 3))


# ---------------------------------------------------------------------------------------------
# CuPy.


def test_cupy_both_ways(cupy):
    c = cupy.arange(24, dtype=cupy.float32).reshape(4, 6)
    a = dlbridge.from_dlpack(c)
    assert a.data_ptr == c.data.ptr and a.device == "cuda:0"
    c[1, 1] = 50
    assert a[1, 1].item() == 50.0
    v = a[1:, ::2]
    cv = cupy.from_dlpack(v)
    assert cv.data.ptr == v.data_ptr
    assert cv.get().tolist() == c[1:, ::2].get().tolist()
    b = dlbridge.zeros(3, dtype="int32", device="cuda:0")
    cb = cupy.from_dlpack(b)
    cb += 4
    assert b.tolist() == [4, 4, 4]


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int16", "int64", "float16", "float32",
                                   "float64", "complex64", "complex128"])
def test_cupy_dtypes(cupy, dtype):
    c = (cupy.arange(9) % 4).astype(dtype)
    a = dlbridge.from_dlpack(c)
    assert a.dtype == dtype and a.data_ptr == c.data.ptr
    assert cupy.from_dlpack(a).data.ptr == c.data.ptr


def test_cupy_lifetime(cupy):
    c = cupy.arange(1 << 20, dtype=cupy.float32)
    a = dlbridge.from_dlpack(c)
    del c
    collect()
    cupy.get_default_memory_pool().free_all_blocks()
    assert a[(1 << 20) - 1].item() == float((1 << 20) - 1)


# ---------------------------------------------------------------------------------------------
# JAX.


def test_jax_both_ways(jax):
    jnp = jax.numpy
    j = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4)
    a = dlbridge.from_dlpack(j)
    assert a.device == "cuda:0"
    assert a.data_ptr == j.unsafe_buffer_pointer()  # zero-copy (JAX arrays are read-only)
    np.testing.assert_array_equal(host(a), np.asarray(j))
    b = dlbridge.arange(64, dtype="float32", device="cuda:0")  # 256-byte aligned by the driver
    jb = jax.dlpack.from_dlpack(b)
    assert jb.unsafe_buffer_pointer() == b.data_ptr
    np.testing.assert_array_equal(np.asarray(jb), np.arange(64, dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# Streams: a consumer reading at once must see the producer's final values.

N = 1 << 24
SLEEP_CYCLES = 40_000_000  # tens of milliseconds on a GPU clocked near 2 GHz


@pytest.mark.parametrize("round_", range(5))
def test_torch_side_stream_to_dlbridge(torch, round_):
    x = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(round_ + 1.0)
        a = dlbridge.from_dlpack(x)  # dlbridge's stream must wait for s
    h = host(a[N - 1000:])  # copies on dlbridge's (legacy) stream
    assert (h == round_ + 1.0).all()


@pytest.mark.parametrize("round_", range(3))
def test_cupy_stream_to_dlbridge(cupy, torch, round_):
    c = cupy.zeros(N, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
            torch.cuda._sleep(SLEEP_CYCLES)
        c.fill(round_ + 2.0)
        a = dlbridge.from_dlpack(c)  # the __dlpack__ path: CuPy orders its stream before ours
    assert (host(a[-1000:]) == round_ + 2.0).all()


def _dlbridge_write_on_slow_stream(torch, value):
    """A dlbridge array whose final values are written on a dlbridge stream behind a long kernel,
    and the stream (kept alive by the caller)."""
    src = dlbridge.full((N,), value, dtype="float32", device="cuda:0")
    dst = dlbridge.zeros((N,), dtype="float32", device="cuda:0")
    dlbridge.cuda.synchronize()
    s = dlbridge.cuda.Stream()
    with dlbridge.cuda.stream(s):
        with torch.cuda.stream(torch.cuda.ExternalStream(s.handle)):
            torch.cuda._sleep(SLEEP_CYCLES)
        dst[...] = src  # enqueued on s, after the sleep
    return dst, s


@pytest.mark.parametrize("round_", range(5))
def test_dlbridge_stream_to_torch(torch, round_):
    dst, s = _dlbridge_write_on_slow_stream(torch, round_ + 3.0)
    with dlbridge.cuda.stream(s):
        t = torch.from_dlpack(dst)  # torch passes its (legacy) stream; we hand off from s
    assert bool((t[-1000:] == round_ + 3.0).all())


@pytest.mark.parametrize("round_", range(3))
def test_dlbridge_stream_to_cupy(cupy, torch, round_):
    dst, s = _dlbridge_write_on_slow_stream(torch, round_ + 4.0)
    with dlbridge.cuda.stream(s):
        c = cupy.from_dlpack(dst)
    assert bool((c[-1000:] == round_ + 4.0).all())


def test_dlbridge_stream_to_jax(jax, torch):
    dst, s = _dlbridge_write_on_slow_stream(torch, 6.0)
    with dlbridge.cuda.stream(s):
        j = jax.dlpack.from_dlpack(dst)
    assert bool((j[-1000:] == 6.0).all())


def test_stream_objects_and_events(torch):
    s = dlbridge.cuda.Stream()
    assert s.handle != 0 and s.cuda_stream == s.handle
    e = dlbridge.cuda.Event(enable_timing=True)
    e2 = dlbridge.cuda.Event(enable_timing=True)
    with dlbridge.cuda.stream(s):
        assert dlbridge.cuda.current_stream().handle == s.handle
        e.record()
        dlbridge.zeros(1 << 20, device="cuda:0")
        e2.record()
    assert dlbridge.cuda.current_stream().handle in (0, 1)
    e2.synchronize()
    assert e.query() and e2.query()
    assert e.elapsed_time(e2) >= 0.0
    s.synchronize()
    assert s.query()
    with dlbridge.cuda.stream(torch.cuda.current_stream()):
        pass


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_bad_device_index():
    with pytest.raises(ValueError, match="does not exist"):
        dlbridge.zeros(3, device=f"cuda:{dlbridge.cuda.device_count()}")


def test_stream_zero_is_refused():
    a = dlbridge.zeros(3, device="cuda:0")
    with pytest.raises(ValueError, match="ambiguous"):
        a.__dlpack__(stream=0)
    with pytest.raises(ValueError):
        with dlbridge.cuda.stream(0):
            pass
    with pytest.raises(TypeError):
        a.__dlpack__(stream="fast")


def test_allocation_larger_than_the_card():
    free, total = dlbridge.cuda.mem_get_info()
    with pytest.raises(MemoryError, match="bytes"):
        dlbridge.empty((total * 4,), dtype="uint8", device="cuda:0")


@pytest.mark.parametrize("device_type", [2, 3, 13])  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
def test_unknown_pointer_is_refused_and_deleter_runs(device_type):
    owner = np.zeros(16, np.float32)  # host memory the driver has never seen
    cap = HandMadeCapsule(owner, owner.ctypes.data, [16], [1], (2, 32, 1),
                          device=(device_type, 0))
    with pytest.raises(BufferError, match="not memory the CUDA driver knows"):
        dlbridge.from_dlpack(cap.capsule)
    assert cap.deleted == 1


def test_range_outside_the_allocation_is_refused(torch):
    t = torch.zeros(16, device="cuda")
    cap = HandMadeCapsule(t, t.data_ptr(), [1 << 30], [1], (2, 32, 1), device=(2, 0))
    with pytest.raises(BufferError, match="outside the CUDA allocation"):
        dlbridge.from_dlpack(cap.capsule)
    assert cap.deleted == 1


def test_wrong_device_ordinal_is_refused(torch):
    t = torch.zeros(16, device="cuda")
    n = dlbridge.cuda.device_count()
    cap = HandMadeCapsule(t, t.data_ptr(), [16], [1], (2, 32, 1), device=(2, n))
    with pytest.raises(ValueError, match="does not exist"):
        dlbridge.from_dlpack(cap.capsule)
    assert cap.deleted == 1
    gc.collect()


# ---------------------------------------------------------------------------------------------
# The caching pool on CUDA.


@pytest.mark.parametrize("storage", list(KINDS))
def test_pool_reuses_blocks_without_the_driver(storage):
    dev = KINDS[storage]
    dlbridge.empty_cache(dev)
    first = dlbridge.empty((3 << 20,), dtype="uint8", device=dev)
    ptr = first.data_ptr
    before = dlbridge.memory_stats(dev)
    assert before["active_bytes"] >= 3 << 20 and before["active_blocks"] >= 1
    del first
    collect()
    cached = dlbridge.memory_stats(dev)
    assert cached["cached_bytes"] >= 3 << 20
    again = dlbridge.empty((3 << 20,), dtype="uint8", device=dev)
    after = dlbridge.memory_stats(dev)
    assert again.data_ptr == ptr
    assert after["driver_allocations"] == before["driver_allocations"]
    assert after["cache_hits"] == before["cache_hits"] + 1
    del again
    collect()
    dlbridge.empty_cache(dev)
    cleared = dlbridge.memory_stats(dev)
    assert cleared["cached_bytes"] == 0
    assert cleared["driver_frees"] > after["driver_frees"]


def test_pool_zeroes_reused_blocks():
    dlbridge.empty_cache("cuda:0")
    a = dlbridge.full((1 << 16,), 7, dtype="int32", device="cuda:0")
    ptr = a.data_ptr
    del a
    collect()
    z = dlbridge.zeros((1 << 16,), dtype="int32", device="cuda:0")
    assert z.data_ptr == ptr
    assert not host(z).any()


def test_pool_memory_limit_on_cuda():
    try:
        dlbridge.set_memory_limit(1 << 20, device="cuda:0")
        active = dlbridge.memory_stats("cuda:0")["active_bytes"]
        with pytest.raises(MemoryError, match="limit"):
            dlbridge.empty((active + (2 << 20),), dtype="uint8", device="cuda:0")
    finally:
        dlbridge.set_memory_limit(None, device="cuda:0")
    assert dlbridge.empty((2 << 20,), dtype="uint8", device="cuda:0").nbytes == 2 << 20


@pytest.mark.parametrize("round_", range(3))
def test_pool_orders_reuse_across_streams(torch, round_):
    """A block freed while a kernel on stream A still reads it, then reallocated (same address)
    for stream B and overwritten there, must not change what A's kernel reads."""
    n = 1 << 22
    dlbridge.empty_cache("cuda:0")
    # Stream A is PyTorch's (it allocates `seen` there, so PyTorch must own A's lifetime).
    ta, b_stream = torch.cuda.Stream(), dlbridge.cuda.Stream()
    with dlbridge.cuda.stream(ta):
        x = dlbridge.full((n,), 5.0 + round_, dtype="float32", device="cuda:0")
        ptr = x.data_ptr
        xt = torch.from_dlpack(x)
        with torch.cuda.stream(ta):
            torch.cuda._sleep(SLEEP_CYCLES)
            seen = xt.clone()  # reads the block long after the host moves on
        del xt, x  # the block goes back to the pool while A's kernel is queued
        collect()
    with dlbridge.cuda.stream(b_stream):
        y = dlbridge.zeros((n,), dtype="float32", device="cuda:0")  # memset on B
    assert y.data_ptr == ptr  # the same block, reused
    torch.cuda.synchronize()
    assert bool((seen == 5.0 + round_).all())  # A read the old values, not B's zeros
    assert not host(y).any()
    del seen
    torch.cuda.empty_cache()


@pytest.mark.parametrize("round_", range(3))
def test_pool_orders_reuse_after_the_legacy_stream(torch, round_):
    """As above, with stream A the legacy default stream, whose releases record no event (the
    pool orders stream B behind the legacy stream only when B takes the block)."""
    if torch.cuda.current_stream().cuda_stream != 0:
        pytest.skip("this PyTorch build's default stream is not the legacy default stream")
    n = 1 << 22
    dlbridge.empty_cache("cuda:0")
    b_stream = dlbridge.cuda.Stream()
    x = dlbridge.full((n,), 5.0 + round_, dtype="float32", device="cuda:0")  # legacy stream
    ptr = x.data_ptr
    xt = torch.from_dlpack(x)
    torch.cuda._sleep(SLEEP_CYCLES)  # on the legacy stream too
    seen = xt.clone()  # reads the block long after the host moves on
    del xt, x  # back to the pool while the legacy stream's kernels are queued
    collect()
    with dlbridge.cuda.stream(b_stream):
        y = dlbridge.zeros((n,), dtype="float32", device="cuda:0")  # memset on B
    assert y.data_ptr == ptr  # the same block, reused
    torch.cuda.synchronize()
    assert bool((seen == 5.0 + round_).all())  # the legacy stream read the old values
    assert not host(y).any()
    # Reused again on the legacy stream: stream order alone protects it.
    del y
    collect()
    z = dlbridge.zeros((n,), dtype="float32", device="cuda:0")
    assert not host(z).any()
    del seen
    torch.cuda.empty_cache()


@pytest.mark.parametrize("round_", range(3))
def test_pool_keeps_per_thread_default_streams_apart(torch, round_):
    """Handle 2 (the per-thread default stream) names a different stream on every thread: a block
    freed while thread A's per-thread stream still reads it, then reallocated (same address) on
    thread B's per-thread stream and zeroed there, must not change what A's kernel reads."""
    n = 1 << 22
    dlbridge.empty_cache("cuda:0")
    got = {}

    def thread_a():
        with dlbridge.cuda.stream(2):
            x = dlbridge.full((n,), 5.0 + round_, dtype="float32", device="cuda:0")
            got["ptr"] = x.data_ptr
            xt = torch.from_dlpack(x)
            with torch.cuda.stream(torch.cuda.ExternalStream(2)):
                torch.cuda._sleep(SLEEP_CYCLES * 10)  # about 200 ms
                got["seen"] = xt.clone()  # reads the block long after the host moves on
            del xt, x  # back to the pool while A's kernels are queued
            collect()

    def thread_b():
        with dlbridge.cuda.stream(2):
            got["y"] = dlbridge.zeros((n,), dtype="float32", device="cuda:0")  # memset on B

    for body in (thread_a, thread_b):
        t = threading.Thread(target=body)
        t.start()
        t.join()
    assert got["y"].data_ptr == got["ptr"]  # the same block, reused
    torch.cuda.synchronize()
    assert bool((got["seen"] == 5.0 + round_).all())  # A read the old values, not B's zeros
    assert not host(got["y"]).any()
    del got
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# More interop cases: read-only memory, JAX dtypes and lifetime, several GPUs.


def test_read_only_cuda_tensor(torch):
    t = torch.arange(8.0, device="cuda")
    cap = HandMadeCapsule(t, t.data_ptr(), [8], [1], (2, 32, 1), device=(2, 0), flags=1)
    a = dlbridge.from_dlpack(cap.capsule)
    assert a.readonly and a.data_ptr == t.data_ptr()
    with pytest.raises(BufferError, match="read-only"):
        a[0] = 5.0
    b = a.copy()  # a copy is the caller's own, writable memory
    assert not b.readonly and b.device == "cuda:0"
    b[0] = 5.0
    assert b.tolist()[0] == 5.0 and t[0].item() == 0.0
    with pytest.raises(BufferError):
        a.__dlpack__()  # a legacy capsule cannot say read-only
    del a
    collect()
    assert cap.deleted == 1


@pytest.mark.parametrize("dtype", ["int8", "int32", "uint8", "float16", "bfloat16", "float32",
                                   "complex64"])
def test_jax_dtypes_and_lifetime(jax, dtype):
    jnp = jax.numpy
    j = (jnp.arange(64) % 3).astype(dtype)
    a = dlbridge.from_dlpack(j)
    assert a.dtype == dtype and a.data_ptr == j.unsafe_buffer_pointer()
    expected = np.real(np.asarray(j.astype("float32") if dtype == "bfloat16" else j))
    expected = expected.astype(np.float32).tolist()
    del j
    collect()
    assert host(a.astype("float32")).tolist() == expected


def test_jax_consumes_views_and_offsets(jax):
    a = dlbridge.arange(4 * 64, dtype="float32", device="cuda:0").reshape((4, 64))
    row = a[2]  # a view 512 bytes into the buffer
    j = jax.dlpack.from_dlpack(row)
    np.testing.assert_array_equal(np.asarray(j), np.arange(128, 192, dtype=np.float32))


@pytest.mark.skipif(dlbridge.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_peer_copies(rng):
    x = rng.standard_normal((257, 129)).astype(np.float32)
    a = dlbridge.asarray(x, device="cuda:0")
    b = a.to("cuda:1")  # compact: one peer copy
    assert b.device == "cuda:1"
    np.testing.assert_array_equal(host(b), x)
    c = a.T.to("cuda:1")  # strided: made compact on cuda:0, then copied across
    np.testing.assert_array_equal(host(c), x.T)
    d = dlbridge.zeros((129, 257), dtype="float32", device="cuda:1")
    d[:, ::2] = a.T[:, ::2]  # strided on both sides, across devices
    expected = np.zeros((129, 257), np.float32)
    expected[:, ::2] = x.T[:, ::2]
    np.testing.assert_array_equal(host(d), expected)
    with dlbridge.cuda.stream(dlbridge.cuda.Stream(1), device=1):
        e = b.copy()
    np.testing.assert_array_equal(host(e), x)
