"""dlbridge arrays on Ray: the object store (CPU, zero-copy on the receiving side) and the
dlbridge tensor transport (`dlbridge.ray`), on Ray's own local cluster.

The CUDA tests need a CUDA device and run on the GPU machine (two actors sharing one GPU by
fractional GPUs); elsewhere they are skipped with that reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dlbridge

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'dlbridge[ray]')")
import dlbridge.ray as dray  # noqa: E402

needs_cuda = pytest.mark.skipif(not dlbridge.cuda.is_available(), reason="needs a CUDA device")

# dlbridge's element types that NumPy has too (the others cannot be compared through NumPy).
DTYPES = [
    "bool",
    *(name for name in dlbridge._dlbridge.__all__ if isinstance(getattr(np, name, None), type)),
]


@pytest.fixture(scope="module")
def cluster():
    dray.register()  # before any actor exists
    gpus = 1 if dlbridge.cuda.is_available() else 0
    ray.init(
        num_cpus=4,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
    )
    yield
    ray.shutdown()


def _values(dtype: str, shape) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "bool":
        return (np.arange(n) % 3 == 0).reshape(shape)
    v = (np.arange(n) % 101).astype(dtype)
    if dtype.startswith("complex"):
        v = v + 1j * v[::-1]
    return v.reshape(shape)


def _object_store_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of Ray's shared-memory object store."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and ("plasma" in parts[5] or parts[5].startswith("/dev/shm")):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


# ---------------------------------------------------------------------------------------------
# The object store.


@pytest.mark.parametrize("dtype", DTYPES)
def test_put_get_round_trips_every_dtype_read_only(cluster, dtype):
    src = _values(dtype, (3, 5))
    got = ray.get(ray.put(dlbridge.from_dlpack(src)))
    assert isinstance(got, dlbridge.Array)
    assert str(got.dtype) == dtype
    assert got.shape == (3, 5)
    assert got.readonly
    np.testing.assert_array_equal(np.from_dlpack(got), src)


def test_a_large_array_arrives_in_the_object_store_memory_without_a_copy(cluster):
    src = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: stored in shared memory, not inline
    got = ray.get(ray.put(dlbridge.from_dlpack(src)))
    ranges = _object_store_ranges()
    assert ranges, "this process maps no object store memory"
    assert any(lo <= got.data_ptr < hi for lo, hi in ranges), (
        "the received array is not a view of the object store's memory"
    )
    # Its conversion is a view of the same memory too, and read-only.
    host = np.from_dlpack(got)
    assert host.ctypes.data == got.data_ptr
    assert not host.flags.writeable
    import torch

    assert torch.from_dlpack(got).data_ptr() == got.data_ptr
    np.testing.assert_array_equal(host, src)


def test_the_receiver_cannot_write_the_object_store(cluster):
    got = ray.get(ray.put(dlbridge.from_dlpack(np.zeros(1 << 18, dtype=np.int32))))
    with pytest.raises((ValueError, BufferError)):
        got[0] = 1


@ray.remote
def _double(a):
    assert isinstance(a, dlbridge.Array) and a.readonly
    return dlbridge.from_dlpack(np.from_dlpack(a) * 2)


@ray.remote
def _describe(a):
    return (a.shape, str(a.dtype), a.readonly, np.from_dlpack(a).tolist())


def test_task_arguments_and_results_round_trip(cluster):
    src = np.arange(24, dtype=np.int64).reshape(4, 6)
    out = ray.get(_double.remote(dlbridge.from_dlpack(src)))
    np.testing.assert_array_equal(np.from_dlpack(out), src * 2)


def test_views_zero_d_and_empty_arrays_arrive_equal(cluster):
    base = dlbridge.from_dlpack(np.arange(48, dtype=np.float64).reshape(6, 8))
    cases = [
        base[::2, 1::3],  # strided
        base.T,  # transposed
        base[2],  # offset
        dlbridge.from_dlpack(np.array(3.5, dtype=np.float32)),  # 0-d
        dlbridge.from_dlpack(np.zeros((0, 4), dtype=np.int16)),  # empty
    ]
    for a in cases:
        shape, dtype, readonly, values = ray.get(_describe.remote(a))
        assert shape == a.shape
        assert dtype == str(a.dtype)
        assert readonly
        assert values == np.from_dlpack(a).tolist()


# ---------------------------------------------------------------------------------------------
# The dlbridge transport.


class _Holder:
    """Writes and reads an element of the array an actor keeps (`self.kept`)."""

    def write(self, index: int, value: float) -> None:
        self.kept[index] = value
        dlbridge.synchronize(self.kept.device)

    def read(self, index: int) -> float:
        dlbridge.synchronize(self.kept.device)
        return float(np.from_dlpack(dlbridge.asarray(self.kept[index], device="cpu")))


class _ProducerImpl(_Holder):
    def __init__(self):
        self.kept = None

    @ray.method(tensor_transport="dlbridge")
    def arrays(self, n: int, size: int, device: str = "cpu"):
        return [
            dlbridge.asarray(np.full(size, i, dtype=np.float32), device=device) for i in range(n)
        ]

    @ray.method(tensor_transport="dlbridge")
    def shared(self, device: str = "cpu"):
        # An array in shareable memory is sent as the same memory.
        if self.kept is None:
            fresh = dlbridge.asarray(np.zeros(1024, dtype=np.float32), device=device)
            self.kept = dlbridge.open_shared(fresh.share())
        return self.kept

    @ray.method(tensor_transport="dlbridge")
    def views(self):
        self.kept = dlbridge.open_shared(
            dlbridge.from_dlpack(np.arange(64, dtype=np.int32).reshape(8, 8)).share()
        )
        return [self.kept[i] for i in range(8)] + [self.kept.T, self.kept[1::2, ::3]]

    def held(self) -> int:
        from ray.experimental.rdt.util import get_tensor_transport_manager

        return get_tensor_transport_manager(dray.TRANSPORT).held_objects()

    def pid(self) -> int:
        return os.getpid()


class _ConsumerImpl(_Holder):
    def __init__(self):
        self.kept = None

    def sums(self, arrays):
        return [float(np.from_dlpack(dlbridge.asarray(a, device="cpu")).sum()) for a in arrays]

    def keep(self, array):
        self.kept = array
        return (array.shape, str(array.device), array.readonly)

    def views(self, arrays):
        return [np.from_dlpack(a).tolist() for a in arrays]


# Actors that send or receive through a tensor transport need `enable_tensor_transport`: Ray
# then runs the transfers on their own thread, beside the task that waits for the data.
_Producer = ray.remote(enable_tensor_transport=True)(_ProducerImpl)
_Consumer = ray.remote(enable_tensor_transport=True)(_ConsumerImpl)


def test_the_transport_moves_many_arrays_between_actors(cluster):
    p, c = _Producer.remote(), _Consumer.remote()
    sums = ray.get(c.sums.remote(p.arrays.remote(1000, 16)))
    assert sums == [16.0 * i for i in range(1000)]


def test_a_write_on_either_side_is_seen_on_the_other(cluster):
    p, c = _Producer.remote(), _Consumer.remote()
    shape, device, readonly = ray.get(c.keep.remote(p.shared.remote()))
    assert shape == (1024,) and device == "cpu" and not readonly
    ray.get(p.write.remote(5, 7.0))
    assert ray.get(c.read.remote(5)) == 7.0
    ray.get(c.write.remote(9, -3.0))
    assert ray.get(p.read.remote(9)) == -3.0


def test_views_of_one_allocation_arrive_as_views(cluster):
    p, c = _Producer.remote(), _Consumer.remote()
    got = ray.get(c.views.remote(p.views.remote()))
    base = np.arange(64, dtype=np.int32).reshape(8, 8)
    want = [base[i].tolist() for i in range(8)] + [base.T.tolist(), base[1::2, ::3].tolist()]
    assert got == want


def test_the_producer_lets_go_when_the_object_is_freed(cluster):
    p, c = _Producer.remote(), _Consumer.remote()
    ref = p.arrays.remote(3, 8)
    assert ray.get(c.sums.remote(ref)) == [0.0, 8.0, 16.0]
    assert ray.get(p.held.remote()) == 1
    del ref
    deadline = time.monotonic() + 30
    while ray.get(p.held.remote()) != 0:
        assert time.monotonic() < deadline, "the producer still holds the freed object's memory"
        time.sleep(0.2)


def test_an_object_whose_producer_died_raises(cluster):
    p, c = _Producer.remote(), _Consumer.remote()
    ref = p.arrays.remote(2, 4)
    ray.wait([ref])
    ray.kill(p)
    time.sleep(1.0)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(c.sums.remote(ref), timeout=60)


def test_share_many_packs_small_arrays_into_one_handle():
    arrays = [dlbridge.asarray(np.full(4, i, dtype=np.float32)) for i in range(1000)]
    handles, views = dlbridge._dlbridge._share_many(arrays)
    assert len(handles) == 1 and len(views) == 1000
    opened = dlbridge._dlbridge._open_many(handles, views)
    assert [float(np.from_dlpack(a)[0]) for a in opened[:5]] == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(BufferError):
        dlbridge._dlbridge._share_many(arrays, copy=False)
    with pytest.raises(ValueError, match="already opened"):
        dlbridge._dlbridge._open_many(handles, views)


def test_the_transport_refuses_what_it_cannot_carry():
    t = dray.DlbridgeTransport()
    with pytest.raises(TypeError, match="dlbridge.Array"):
        t.extract_tensor_transport_metadata("x", [np.zeros(3)])
    meta = dray.DlbridgeTransportMetadata(tensor_meta=[((1,), "float32")], views=[(0,)])
    meta.node_id = "another-node"
    with pytest.raises(ValueError, match="target buffers|buffers"):
        t.recv_multiple_tensors("x", meta, None, target_buffers=[object()])
    with pytest.raises(NotImplementedError, match="one-sided"):
        t.send_multiple_tensors([], meta, None)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_ray_the_import_error_names_the_extra():
    r = _run(
        """
        import sys
        sys.modules["ray"] = None
        try:
            import dlbridge.ray
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    assert "ImportError:" in r.stdout and "dlbridge[ray]" in r.stdout, r.stdout + r.stderr


def test_the_transport_before_registration_is_refused_by_name():
    r = _run(
        """
        import ray
        try:
            @ray.remote
            class A:
                @ray.method(tensor_transport="dlbridge")
                def f(self):
                    return 1
        except ValueError as e:
            print("ValueError:", e)
        """
    )
    assert "ValueError:" in r.stdout and "DLBRIDGE" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# CUDA: two actors on one GPU (fractional GPUs; each test kills its actors, so the next ones fit).


@ray.remote(num_gpus=0.25, enable_tensor_transport=True)
class _GpuProducer(_ProducerImpl):
    @ray.method(tensor_transport="dlbridge")
    def after_a_long_kernel(self, n: int):
        import torch

        t = torch.zeros(n, device="cuda")
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time queued before the fill
        t.fill_(7.0)
        return dlbridge.from_dlpack(t)


@ray.remote(num_gpus=0.25, enable_tensor_transport=True)
class _GpuConsumer(_ConsumerImpl):
    def torch_sum(self, a):
        import torch

        t = torch.from_dlpack(a)
        assert t.device.type == "cuda"
        return float(t.sum())

    def ptr(self, a):
        import torch

        return (torch.from_dlpack(a).data_ptr(), a.data_ptr)


# An actor that sees no GPU at all (Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for actors without
# GPUs, so such an actor could still use the GPU: this one is denied it).
@ray.remote(
    num_gpus=0,
    enable_tensor_transport=True,
    runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": ""}},
)
class _HostOnly(_ConsumerImpl):
    pass


@pytest.fixture
def actors(cluster):
    """Creates actors for one test and kills them after it (each holds a share of the GPU)."""
    made = []

    def make(cls):
        a = cls.remote()
        made.append(a)
        return a

    yield make
    for a in made:
        ray.kill(a)


@needs_cuda
def test_cuda_arrays_move_between_actors_sharing_a_gpu(actors):
    p, c = actors(_GpuProducer), actors(_GpuConsumer)
    sums = ray.get(c.sums.remote(p.arrays.remote(100, 256, "cuda")), timeout=120)
    assert sums == [256.0 * i for i in range(100)]
    # The consumer's PyTorch tensor is the mapped memory itself.
    torch_ptr, mapped = ray.get(c.ptr.remote(p.shared.remote("cuda")), timeout=120)
    assert torch_ptr == mapped


@needs_cuda
def test_cuda_a_write_on_either_side_is_seen_on_the_other(actors):
    p, c = actors(_GpuProducer), actors(_GpuConsumer)
    shape, device, readonly = ray.get(c.keep.remote(p.shared.remote("cuda")), timeout=120)
    assert shape == (1024,) and device.startswith("cuda") and not readonly
    ray.get(p.write.remote(5, 7.0), timeout=120)
    assert ray.get(c.read.remote(5), timeout=120) == 7.0
    ray.get(c.write.remote(9, -3.0), timeout=120)
    assert ray.get(p.read.remote(9), timeout=120) == -3.0


@needs_cuda
def test_cuda_the_consumer_waits_for_the_producers_queued_work(actors):
    p, c = actors(_GpuProducer), actors(_GpuConsumer)
    n = 1 << 20
    got = ray.get(c.torch_sum.remote(p.after_a_long_kernel.remote(n)), timeout=120)
    assert got == 7.0 * n


@needs_cuda
def test_cuda_an_actor_without_a_gpu_is_refused_clearly(actors):
    p, c = actors(_GpuProducer), actors(_HostOnly)
    with pytest.raises(ray.exceptions.RayTaskError, match="GPU"):
        ray.get(c.sums.remote(p.arrays.remote(1, 4, "cuda")), timeout=120)


def test_the_descriptor_server_serves_held_objects_to_this_user_only(cluster):
    t = dray.DlbridgeTransport()
    arrays = [dlbridge.asarray(np.arange(4, dtype=np.float32))]
    meta = t.extract_tensor_transport_metadata("obj-1", arrays)
    got = t.recv_multiple_tensors("obj-1", meta, None)
    assert np.from_dlpack(got[0]).tolist() == [0.0, 1.0, 2.0, 3.0]
    # An object the producer does not hold (freed, or never made) is refused.
    with pytest.raises(OSError, match="no longer holds"):
        dray._fetch_descriptors(meta.address, "obj-2", 1, os.getpid())
    t.garbage_collect("obj-1", meta, arrays)
    with pytest.raises(OSError, match="no longer holds"):
        t.recv_multiple_tensors("obj-1", meta, None)
    if os.getuid() != 0:
        return  # the other-user half needs root to become another user
    t.extract_tensor_transport_metadata("obj-3", arrays)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.setuid(65534)
            dray._fetch_descriptors(meta.address, "obj-3", 1, os.getppid())
            os.write(w, b"served")
        except PermissionError:
            os.write(w, b"refused")
        except BaseException as e:  # noqa: BLE001
            os.write(w, repr(e).encode()[:200])
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    answer = os.read(r, 300)
    os.close(r)
    assert answer == b"refused", answer


# ---------------------------------------------------------------------------------------------
# Object-store arrays and consumers that ignore read-only; the descriptor server under hostile
# peers.


def test_a_torch_write_to_an_object_store_array_reaches_every_reader_as_with_numpy(cluster):
    """What dlbridge does with a read-only object-store array a PyTorch consumer writes: the
    write lands in the object (PyTorch ignores DLPack's read-only flag), never faults, and every
    reader on the node sees it, exactly as with a NumPy array from Ray. A copy is private."""
    torch = pytest.importorskip("torch")
    n = 1 << 18  # 1 MiB: in the shared-memory store, not inlined
    ref = ray.put(dlbridge.from_dlpack(np.zeros(n, dtype=np.float32)))
    got = ray.get(ref)
    assert got.readonly
    with pytest.raises((ValueError, BufferError)):
        got[0] = 1.0  # dlbridge keeps the promise
    with pytest.raises(ValueError):
        np.from_dlpack(got)[0] = 1.0  # and so does NumPy
    torch.from_dlpack(got)[0] = 5.0  # PyTorch does not: the object's memory
    assert float(np.from_dlpack(ray.get(ref))[0]) == 5.0
    assert float(ray.get(_describe.remote(ref))[3][0]) == 5.0  # another process reads it too
    # The same as NumPy arrays from Ray.
    numpy_ref = ray.put(np.zeros(n, dtype=np.float32))
    with pytest.warns(UserWarning, match="not writable"):
        as_torch = torch.from_numpy(ray.get(numpy_ref))
    as_torch[0] = 5.0
    assert float(ray.get(numpy_ref)[0]) == 5.0
    # A copy is the way to write privately.
    mine = dlbridge.asarray(ray.get(ref), copy=True)
    assert not mine.readonly
    torch.from_dlpack(mine)[1] = 9.0
    assert float(np.from_dlpack(ray.get(ref))[1]) == 0.0


_SILENT_SERVER = r"""
import os, socket, sys
address = f"\0dlbridge-ray-silent-{os.getpid()}"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(address)
s.listen()
print(os.getpid(), address[1:], flush=True)
held = []
while True:
    held.append(s.accept()[0])
"""

_FETCH = r"""
import os, sys, time
import dlbridge.ray as dray
start = time.monotonic()
try:
    dray._fetch_descriptors("\0" + sys.argv[1], "obj", 1, int(sys.argv[2]))
    print("served")
except Exception as e:
    print(type(e).__name__, time.monotonic() - start, e)
"""


def test_the_descriptor_client_waits_a_bounded_time_and_checks_the_server():
    """A consumer of the transport asks a descriptor server that never answers (a stopped
    producer) or that is not the producer's (another process bound the name): a clear error,
    never a hang. The consumer runs in a child with a timeout."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SILENT_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        pid, name = server.stdout.readline().split()
        env = dict(os.environ, DLBRIDGE_SHARE_TIMEOUT="1")
        r = subprocess.run(
            [sys.executable, "-c", _FETCH, name, pid],
            capture_output=True, text=True, timeout=60, env=env,
        )
        kind, took, message = r.stdout.split(" ", 2)
        assert kind == "TimeoutError" and "within 1 s" in message, r.stdout + r.stderr
        assert 1.0 <= float(took) < 20
        r = subprocess.run(
            [sys.executable, "-c", _FETCH, name, str(os.getpid())],
            capture_output=True, text=True, timeout=60, env=env,
        )
        kind, took, message = r.stdout.split(" ", 2)
        assert kind == "PermissionError" and f"held by process {pid}" in message, r.stdout
        assert float(took) < 10
    finally:
        server.kill()
        server.wait(30)


_IDLE_PEER = r"""
import socket, time
import dlbridge.ray as dray
server = dray._DescriptorServer(dray.DlbridgeTransport())
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(server.address)
start = time.monotonic()
c.settimeout(30)
print(repr(c.recv(1)), time.monotonic() - start)
"""


def test_the_descriptor_server_drops_a_peer_that_never_asks():
    r = subprocess.run(
        [sys.executable, "-c", _IDLE_PEER],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, DLBRIDGE_SHARE_TIMEOUT="0.5"),
    )
    got, took = r.stdout.split()
    assert got == "b''", r.stdout + r.stderr
    assert 0.5 <= float(took) < 20
