"""The compute-backend API: ``dlbridge.Backend`` (memory, copies, synchronization, kernels),
``KernelExecutionResult``, run-time CUDA kernels on memory from PyTorch and CuPy (zero-copy), and
``UnifiedBuffer``'s states and copy counts.

CUDA cases run on a machine with an NVIDIA GPU and skip elsewhere with the reason.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dlbridge

CUDA = dlbridge.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason=f"no CUDA GPU: {dlbridge.cuda.unavailable_reason() or 'no device'}"
)


def _import(name):
    try:
        return __import__(name)
    except Exception:
        return None


torch = _import("torch")
cupy = _import("cupy") if CUDA else None

VECTOR_ADD = r"""
extern "C" __global__ void vadd(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
"""

# A block-wise sum through dynamic shared memory; a C++ (mangled) entry point on purpose.
BLOCK_SUM = r"""
__global__ void block_sum(const double* x, double* out, long long n) {
    extern __shared__ double tile[];
    unsigned t = threadIdx.x;
    long long i = (long long)blockIdx.x * blockDim.x + t;
    tile[t] = i < n ? x[i] : 0.0;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) tile[t] += tile[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = tile[0];
}
"""

SCALE = r"""
extern "C" __global__ void scale(float* x, float alpha, double beta, int n, unsigned short h) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * alpha + (float)beta + (float)h;
}
"""


# ---------------------------------------------------------------------------------------------
# The Backend object.


def test_default_backend_is_the_best_available():
    be = dlbridge.Backend()
    assert be.backend_type == ("cuda" if CUDA else be.backend_type)
    assert be.is_available and be.device_count >= 1
    assert repr(be).startswith("dlbridge.Backend(")


def test_cpu_backend_memory_and_copies():
    be = dlbridge.Backend("cpu")
    assert (be.backend_type, be.device_id, be.device_count) == ("cpu", 0, 1)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = be.copy_to_device(x)
    assert a.data_ptr != x.ctypes.data  # a copy, as the name says
    x[0, 0] = 100
    back = be.copy_to_host(a)
    assert isinstance(back, np.ndarray) and back[0, 0] == 0 and back.shape == (3, 4)
    z = be.allocate_zeros((5,), "int16")
    assert z.tolist() == [0] * 5 and str(z.dtype) == "int16"
    e = be.allocate((2, 2))
    assert str(e.dtype) == "float32"
    be.synchronize()
    info = be.get_memory_info()
    assert info["active_bytes"] >= a.nbytes and info["cache_hits"] >= 0


def test_free_releases_now_and_later_use_raises():
    be = dlbridge.Backend("cpu")
    gc.collect()
    before = dlbridge.memory_stats("cpu")["active_bytes"]
    a = be.allocate((1 << 20,), "float32")
    assert dlbridge.memory_stats("cpu")["active_bytes"] >= before + (4 << 20)
    be.free(a)
    assert dlbridge.memory_stats("cpu")["active_bytes"] == before
    for use in (lambda: a.shape, lambda: a + 1, lambda: np.from_dlpack(a), lambda: a.__dlpack__()):
        with pytest.raises(ValueError, match="freed"):
            use()
    with pytest.raises(ValueError, match="already freed"):
        be.free(a)
    # Memory still shared with a view or an export is not freed (no dangling pointers).
    b = be.allocate((8,))
    view = b[2:]
    with pytest.raises(BufferError, match="share"):
        be.free(b)
    del view
    gc.collect()
    be.free(b)
    # Foreign memory belongs to its producer.
    imported = dlbridge.from_dlpack(np.ones(3))
    with pytest.raises(BufferError, match="another library"):
        be.free(imported)
    with pytest.raises(TypeError):
        be.free(np.ones(3))


def test_unknown_backends_are_refused():
    with pytest.raises(ValueError):
        dlbridge.Backend("tpu")
    if not CUDA:
        with pytest.raises(dlbridge.BackendUnavailableError, match="CUDA"):
            dlbridge.Backend("cuda")
    if "metal:0" not in dlbridge.build_info()["devices"]:
        with pytest.raises(dlbridge.BackendUnavailableError, match="Metal"):
            dlbridge.Backend("metal")


# ---------------------------------------------------------------------------------------------
# Ready-made kernels.


def test_ready_made_kernels():
    a = dlbridge.asarray([1.0, 4.0, 9.0])
    assert dlbridge.get_vector_add_kernel()(a, a).tolist() == [2.0, 8.0, 18.0]
    assert dlbridge.get_elementwise_kernel("sqrt")(a).tolist() == [1.0, 2.0, 3.0]
    assert dlbridge.get_elementwise_kernel("sub")(a, 1).tolist() == [0.0, 3.0, 8.0]
    for name in ("add", "sub", "mul", "div", "sqrt", "exp", "log", "sin", "cos", "abs", "square", "negative"):
        assert callable(dlbridge.get_elementwise_kernel(name))
    assert dlbridge.get_elementwise_kernel("tanh") is None
    m = dlbridge.asarray([[1.0, 2.0], [3.0, 4.0]])
    assert dlbridge.get_matrix_multiply_kernel()(m, m).tolist() == [[7.0, 10.0], [15.0, 22.0]]


# ---------------------------------------------------------------------------------------------
# CPU kernels: Python callables on NumPy views.


def test_cpu_callable_kernels_get_numpy_views_of_the_same_memory():
    be = dlbridge.Backend("cpu")
    a = be.allocate_zeros((6,))
    seen = {}

    def kernel(x, alpha):
        seen["ptr"] = x.ctypes.data
        x += alpha
        return x.sum()

    res = be.execute_kernel(kernel, (1,), (1,), a, 2.0)
    assert isinstance(res, dlbridge.KernelExecutionResult)
    assert res.success and res.error is None and res.execution_time_ms > 0
    assert seen["ptr"] == a.data_ptr  # zero-copy
    assert a.tolist() == [2.0] * 6 and float(res.output) == 12.0

    with pytest.raises(ValueError, match="positive"):
        be.execute_kernel(kernel, (0,), (1,), a, 1.0)
    with pytest.raises(TypeError):
        be.compile_kernel(VECTOR_ADD, "vadd")
    assert be.compile_kernel(kernel) is kernel


def _devices():
    """Every backend this machine runs, each a parameter (the GPU ones skip elsewhere)."""
    return [
        "cpu",
        pytest.param("cuda:0", marks=needs_cuda),
        pytest.param("metal", marks=pytest.mark.skipif(
            not dlbridge.metal.is_available(), reason="no Metal device")),
    ]


@pytest.mark.parametrize("device", _devices())
def test_a_raising_callable_is_a_failed_result(device):
    """The Backend contract: `result = be.execute_kernel(...)`, then `result.success` or
    `result.error`. A Python callable that raises is a failed result with its traceback's text."""
    be = dlbridge.Backend(device)
    a = be.allocate_zeros((4,))

    def failing(x):
        return 1 / 0  # the line the traceback must name

    result = be.execute_kernel(failing, 1, 1, a)
    assert isinstance(result, dlbridge.KernelExecutionResult)
    assert not result.success and result.output is None and result.execution_time_ms >= 0
    assert result.error.startswith("Traceback (most recent call last):")
    assert "in failing" in result.error and "1 / 0" in result.error
    assert result.error.rstrip().endswith("ZeroDivisionError: division by zero")
    # Every kind of exception the callable raises, not only arithmetic ones.
    for exc in (ValueError("bad value"), RuntimeError("kernel gave up"), KeyError("k")):
        def raising(x, exc=exc):
            raise exc

        result = be.execute_kernel(raising, 1, 1, a)
        assert not result.success and type(exc).__name__ in result.error
    # The backend still works afterwards.
    assert be.execute_kernel(lambda x: None, 1, 1, a).success


@pytest.mark.parametrize("device", _devices())
def test_raise_errors_re_raises_the_callables_exception(device):
    be = dlbridge.Backend(device)
    a = be.allocate_zeros((4,))

    def failing(x):
        return 1 / 0  # the line the traceback must reach

    with pytest.raises(ZeroDivisionError) as raised:
        be.execute_kernel(failing, 1, 1, a, raise_errors=True)
    # The original exception, with the callable's own frame in its traceback.
    assert raised.traceback[-1].name == "failing"
    assert "1 / 0" in str(raised.traceback[-1].statement)


def test_keyboard_interrupt_in_a_callable_propagates():
    """Ctrl-C is not a kernel failure: it is never turned into a result."""
    be = dlbridge.Backend("cpu")

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        be.execute_kernel(interrupted, 1, 1)


def test_bad_arguments_still_raise_whatever_raise_errors_says():
    """Arguments are checked before anything runs: the caller's mistake raises."""
    be = dlbridge.Backend("cpu")
    for raise_errors in (False, True):
        with pytest.raises(ValueError, match="positive"):
            be.execute_kernel(lambda: None, 0, 1, raise_errors=raise_errors)
        with pytest.raises(TypeError):
            be.execute_kernel(7, 1, 1, raise_errors=raise_errors)


# ---------------------------------------------------------------------------------------------
# CUDA kernels.


@needs_cuda
def test_cuda_vector_add_kernel_on_dlbridge_memory():
    be = dlbridge.Backend("cuda:0")
    k = be.compile_kernel(VECTOR_ADD)  # the entry point found in the source
    assert k.name == "vadd" and k.param_sizes in (None, [8, 8, 8, 4])
    assert be.compile_kernel(VECTOR_ADD, "vadd") is not None  # cached, same result
    n = 100_003
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    a, b = be.copy_to_device(x), be.copy_to_device(2 * x)
    out = be.allocate((n,))
    res = be.execute_kernel(k, ((n + 255) // 256,), (256,), a, b, out, n)
    assert res.success, res.error
    assert res.execution_time_ms > 0
    np.testing.assert_allclose(be.copy_to_host(out), 3 * x, rtol=1e-6)


@needs_cuda
@pytest.mark.skipif(torch is None, reason="PyTorch is not installed")
def test_cuda_kernels_run_on_torch_memory_in_place():
    be = dlbridge.Backend("cuda:0")
    k = be.compile_kernel(VECTOR_ADD, "vadd")
    a = torch.arange(1000, dtype=torch.float32, device="cuda")
    b = torch.ones(1000, dtype=torch.float32, device="cuda")
    out = torch.empty(1000, dtype=torch.float32, device="cuda")
    res = be.execute_kernel(k, (4,), (256,), a, b, out, 1000)
    assert res.success, res.error
    assert torch.equal(out, a + 1)  # written in place: the kernel got torch's own pointer
    # Scalars of several types, matched to the parameters' sizes.
    s = be.compile_kernel(SCALE, "scale")
    x = torch.ones(10, device="cuda")
    res = be.execute_kernel(s, 1, 32, x, 2.0, 0.5, 10, np.uint16(3))
    assert res.success, res.error
    assert x.tolist() == [5.5] * 10


@needs_cuda
@pytest.mark.skipif(cupy is None, reason="CuPy is not installed")
def test_cuda_shared_memory_kernel_on_cupy_memory():
    be = dlbridge.Backend("cuda:0")
    k = be.compile_kernel(BLOCK_SUM, "block_sum")  # C++ name: lowered by NVRTC
    n, threads = 1 << 16, 256
    x = cupy.random.default_rng(3).standard_normal(n)
    partial = cupy.zeros(n // threads)
    res = be.execute_kernel(k, n // threads, threads, x, partial, n, shared_mem=threads * 8)
    assert res.success, res.error
    assert abs(float(partial.sum()) - float(x.sum())) < 1e-9 * n


@needs_cuda
def test_cuda_kernel_errors_are_clear_and_the_backend_survives():
    be = dlbridge.Backend("cuda:0")
    with pytest.raises(RuntimeError, match="(?s)compilation.*error") as info:
        be.compile_kernel('extern "C" __global__ void bad(float* x) { x[0] = undefined_name; }', "bad")
    assert "undefined_name" in str(info.value)  # NVRTC's log is in the message
    with pytest.raises(ValueError):
        be.compile_kernel(VECTOR_ADD, "no_such_kernel")
    k = be.compile_kernel(VECTOR_ADD, "vadd")
    a = be.allocate_zeros((8,))
    too_big = be.execute_kernel(k, 1, 4096, a, a, a, 8)  # more threads than a block may have
    assert not too_big.success and too_big.error
    with pytest.raises(RuntimeError, match=re.escape(too_big.error[:40])):  # the same failure, raised
        be.execute_kernel(k, 1, 4096, a, a, a, 8, raise_errors=True)
    with pytest.raises(ValueError):
        be.execute_kernel(k, (1, 0), 32, a, a, a, 8)
    with pytest.raises(ValueError, match="arguments"):
        be.execute_kernel(k, 1, 32, a, a)
    with pytest.raises(ValueError, match="cpu"):
        be.execute_kernel(k, 1, 32, a, a, dlbridge.zeros((8,)), 8)
    freed = be.allocate((8,))
    be.free(freed)
    with pytest.raises(ValueError, match="freed"):
        be.execute_kernel(k, 1, 32, a, a, freed, 8)
    ok = be.execute_kernel(k, 1, 32, a, a, a, 8)
    assert ok.success, ok.error


@needs_cuda
def test_sticky_cuda_faults_are_reported_as_such():
    # An illegal address poisons the CUDA context for the whole process, so it runs in a child.
    code = textwrap.dedent(
        """
        import dlbridge
        be = dlbridge.Backend("cuda:0")
        k = be.compile_kernel('extern "C" __global__ void f(float* p) { p[threadIdx.x] = 1.0f; }', "f")
        res = be.execute_kernel(k, 1, 32, 16)  # an integer where a pointer goes: address 16
        print("SUCCESS" if res.success else "ERROR:" + res.error)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert "ERROR:" in text, text
    assert "restart" in text.lower(), text


@needs_cuda
def test_cuda_backend_memory_info_and_cache():
    be = dlbridge.Backend("cuda:0")
    a = be.allocate((1 << 20,))
    info = be.get_memory_info()
    assert info["active_bytes"] >= 4 << 20 and 0 < info["free_bytes"] <= info["total_bytes"]
    del a
    gc.collect()
    be.clear_cache()
    assert be.get_memory_info()["cached_bytes"] == 0
    be.synchronize()


@needs_cuda
def test_cuda_python_callable_kernels_are_timed_by_events():
    be = dlbridge.Backend("cuda:0")
    a = be.copy_to_device(np.ones(1 << 20, dtype=np.float32))
    res = be.execute_kernel(lambda x: x * 2, 1, 1, a)
    assert res.success and res.execution_time_ms > 0
    assert float(res.output.sum()) == 2 * (1 << 20)


# ---------------------------------------------------------------------------------------------
# UnifiedBuffer.


def test_unified_buffer_on_cpu_shares_memory():
    ub = dlbridge.UnifiedBuffer((4, 3), "float32", device="cpu")
    assert ub.is_shared and ub.state == "uninitialized"
    assert ub.host.ctypes.data == ub.device.data_ptr
    ub.host[:] = 7
    ub.mark_host_dirty()
    assert ub.state == "host_dirty"
    assert ub.device.tolist() == [[7.0] * 3] * 4
    assert ub.state == "synchronized"
    assert ub.transfers == {"host_to_device": 0, "device_to_host": 0}


@needs_cuda
@pytest.mark.parametrize("pinned", [False, True])
def test_unified_buffer_on_cuda_copies_only_when_stale(pinned):
    ub = dlbridge.UnifiedBuffer((1000,), "float32", device="cuda:0", pinned=pinned)
    assert not ub.is_shared and ub.state == "uninitialized"
    ub.host[:] = np.arange(1000)
    assert ub.state == "host_only"
    ub.mark_host_dirty()
    dev = ub.device
    assert ub.state == "synchronized" and ub.transfers == {"host_to_device": 1, "device_to_host": 0}
    _ = ub.device  # up to date: no copy
    _ = ub.host
    assert ub.transfers == {"host_to_device": 1, "device_to_host": 0}
    doubled = dev * 2
    dev[...] = doubled
    ub.mark_device_dirty()
    assert ub.state == "device_dirty"
    np.testing.assert_array_equal(ub.host, 2 * np.arange(1000))
    assert ub.transfers == {"host_to_device": 1, "device_to_host": 1} and ub.state == "synchronized"
    ub.mark_host_dirty()
    ub.sync_to_device()
    ub.sync_to_device()  # nothing newer: no second copy
    assert ub.transfers["host_to_device"] == 2
    if pinned:
        assert "cuda_host" in str(ub._host_backing.device)


@needs_cuda
def test_unified_buffer_in_managed_memory_is_one_allocation():
    ub = dlbridge.UnifiedBuffer((256,), "float32", device="cuda:0", storage="managed")
    assert ub.is_shared and str(ub.device.device).startswith("cuda_managed")
    assert ub.host.ctypes.data == ub.device.data_ptr
    ub.host[:] = 1.5
    ub.mark_host_dirty()
    total = float(ub.device.sum())
    assert total == 1.5 * 256
    assert ub.transfers == {"host_to_device": 0, "device_to_host": 0}


# Long enough that the host's steps after enqueuing the read (a garbage collection among them,
# which takes milliseconds with PyTorch loaded) end well before the read can start.
LONG_SLEEP_CYCLES = 400_000_000  # about 200 ms on a GPU clocked near 2 GHz


@needs_cuda
@pytest.mark.skipif(torch is None, reason="PyTorch is not installed (its _sleep kernel delays a stream)")
@pytest.mark.parametrize("round_", range(3))
def test_inputs_read_on_another_stream_are_not_reused_too_early(round_):
    # `a` is allocated on stream s1 and read by an op on stream s2 (behind a ~200 ms kernel);
    # freed, its block goes back to s1's cache. The next allocation on s1 takes that block and
    # fills it: the fill must wait for s2's read.
    s1, s2 = dlbridge.cuda.Stream(), dlbridge.cuda.Stream()
    n = 1 << 20
    with dlbridge.cuda.stream(s1):
        a = dlbridge.full((n,), 1.0, dtype="float32", device="cuda:0")
    s1.synchronize()
    ptr = a.data_ptr
    with dlbridge.cuda.stream(s2):
        with torch.cuda.stream(torch.cuda.ExternalStream(s2.handle)):
            torch.cuda._sleep(LONG_SLEEP_CYCLES)
        out = a + a
    del a
    gc.collect()
    with dlbridge.cuda.stream(s1):
        b = dlbridge.full((n,), 7.0 + round_, dtype="float32", device="cuda:0")
    assert b.data_ptr == ptr  # the block was reused (the case this test is about)
    s1.synchronize()
    s2.synchronize()
    assert float(out.min()) == 2.0 and float(out.max()) == 2.0


@needs_cuda
@pytest.mark.skipif(torch is None, reason="PyTorch is not installed (its _sleep kernel delays a stream)")
@pytest.mark.parametrize("round_", range(3))
def test_copy_sources_read_on_another_stream_are_not_reused_too_early(round_):
    # As above, with a copy instead of an op: `a` (stream s1's block) is copied on stream s2
    # behind a ~200 ms kernel; the refill of its reused block on s1 must wait for that copy.
    s1, s2 = dlbridge.cuda.Stream(), dlbridge.cuda.Stream()
    n = 1 << 22
    value = 3.0 + round_
    with dlbridge.cuda.stream(s1):
        a = dlbridge.full((n,), value, dtype="float32", device="cuda:0")
    s1.synchronize()
    ptr = a.data_ptr
    with dlbridge.cuda.stream(s2):
        with torch.cuda.stream(torch.cuda.ExternalStream(s2.handle)):
            torch.cuda._sleep(LONG_SLEEP_CYCLES)
        out = a.copy()  # read on s2
    del a
    gc.collect()
    with dlbridge.cuda.stream(s1):
        b = dlbridge.full((n,), -1.0, dtype="float32", device="cuda:0")
    assert b.data_ptr == ptr  # the block was reused
    s1.synchronize()
    s2.synchronize()
    assert float(out.min()) == value and float(out.max()) == value


@needs_cuda
def test_unified_buffer_refuses_writes_on_both_sides():
    ub = dlbridge.UnifiedBuffer((4,), "float32", device="cuda:0")
    ub.host[:] = 1
    ub.mark_host_dirty()
    _ = ub.device
    ub.mark_device_dirty()
    with pytest.raises(RuntimeError, match="both sides"):
        ub.mark_host_dirty()
    ub.sync_to_host()
    ub.mark_host_dirty()


@needs_cuda
def test_kernels_take_pinned_and_managed_memory():
    be = dlbridge.Backend("cuda:0")
    k = be.compile_kernel(VECTOR_ADD, "vadd")
    m = dlbridge.full((64,), 2.0, dtype="float32", device="cuda:0", storage="managed")
    p = dlbridge.full((64,), 3.0, dtype="float32", device="cuda:0", storage="pinned")
    out = be.allocate((64,))
    res = be.execute_kernel(k, 1, 64, m, p, out, 64)
    assert res.success, res.error
    assert be.copy_to_host(out).tolist() == [5.0] * 64
