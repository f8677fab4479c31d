"""Arrays across processes: ``Array.share`` / ``dlbridge.open_shared``, ``dlbridge.multiprocessing``
(Queue, Pipe, Pool with spawn and forkserver), pickle (protocol 5 out of band, by value), the
lifetime rules, and bad handles.

Zero-copy is shown by a write in one process that the other sees. CUDA tests skip here with
"needs a CUDA device" and run for real on a GPU machine.
"""

from __future__ import annotations

import gc
import os
import pickle
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import dlbridge
import dlbridge.multiprocessing as dmp

needs_cuda = pytest.mark.skipif(not dlbridge.cuda.is_available(), reason="needs a CUDA device")


def shmem_bytes() -> int:
    """The kernel's shared memory in use (``Shmem`` of ``/proc/meminfo``): memfd pages count."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def memfd_count(pid: int | str = "self") -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "dlbridge-shared" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


def memfd_settles_to(count: int, timeout: float = 10.0) -> bool:
    """Whether this process's shared files come back to ``count`` within ``timeout`` seconds: a
    receiver's forgo of a lent descriptor is a message the lender's thread handles later."""
    until = time.monotonic() + timeout
    while memfd_count() != count and time.monotonic() < until:
        time.sleep(0.005)
    return memfd_count() == count


# ---------------------------------------------------------------------------------------------
# Child-process bodies (top level, so that spawn can import them).


def _write_first(q_in, q_out) -> None:
    a = q_in.get()
    a[0] = 42.0
    q_out.put(("ok", a.shape, a.strides))


def _write_arg(a, q_out) -> None:
    a[1] = 11.0
    q_out.put("ok")


def _echo_view(q_in, q_out) -> None:
    a = q_in.get()
    q_out.put(np.asarray(a).tolist())
    a[0, 0] = -1


def _produce_then_exit(q, received) -> None:
    a = dlbridge.asarray(np.arange(1000, dtype=np.int64)).share()
    q.put(dlbridge.open_shared(a)[100:200])
    received.wait(30)


def _hold_forever(q, ready) -> None:
    a = q.get()
    float(a[5])  # touch the memory
    ready.set()
    time.sleep(120)


def _sum(a) -> float:
    return float(np.asarray(a).sum())


def _pipe_child(conn) -> None:
    a = conn.recv()
    a[1] = 7
    conn.send("done")


def _read_with_torch_and_jax(q_in, q_out) -> None:
    import jax.numpy as jnp
    import torch

    a = q_in.get()
    t = torch.from_dlpack(a)
    same = t.data_ptr() == a.data_ptr
    j = jnp.asarray(np.from_dlpack(a))
    q_out.put((same, t.tolist(), j.tolist()))


# ---------------------------------------------------------------------------------------------
# In one process.


def test_share_and_open_see_each_others_writes():
    a = dlbridge.asarray(np.arange(8, dtype=np.float32))
    h = a.share()
    assert h.kind == "host_file" and h.device == "cpu" and h.shape == (8,) and not h.opened
    shared = dlbridge.open_shared(h)
    assert h.opened
    shared[3] = 100.0
    # `a` was not shareable: share copied it once; the shares of the copy are one memory.
    again = dlbridge.open_shared(shared.share(copy=False))
    assert float(again[3]) == 100.0
    again[4] = -4.0
    assert float(shared[4]) == -4.0
    assert float(a[3]) == 3.0


def test_copy_false_refuses_memory_that_is_not_shareable():
    a = dlbridge.zeros((4,))
    # The process-shareable property is named apart from the storage mode ("shared" for every
    # host array), and the refusal says how to move the array there.
    assert a.storage == "shared" and not a.is_shared()
    with pytest.raises(BufferError, match="not in process-shareable memory.*share_memory_"):
        a.share(copy=False)


def test_views_travel_with_offsets_and_strides():
    base = dlbridge.open_shared(dlbridge.asarray(np.arange(24, dtype=np.int32).reshape(4, 6)).share())
    v = base[1:, 1::2].T
    h = v.share(copy=False)
    assert h.byte_offset == v.byte_offset
    back = dlbridge.open_shared(h)
    assert back.shape == v.shape and back.strides == v.strides
    assert np.asarray(back).tolist() == np.asarray(v).tolist()


# ---------------------------------------------------------------------------------------------
# multiprocessing.


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_queue_write_in_child_is_seen_by_parent(method):
    ctx = dmp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_write_first, args=(q_in, q_out))
    p.start()
    a = dlbridge.open_shared(dlbridge.zeros((1024,), dtype="float32").share())
    q_in.put(a)
    assert q_out.get(timeout=60) == ("ok", (1024,), (1,))
    p.join(60)
    assert p.exitcode == 0
    assert float(a[0]) == 42.0


def test_queue_view_with_offset_and_strides():
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo_view, args=(q_in, q_out))
    p.start()
    base = dlbridge.open_shared(dlbridge.asarray(np.arange(30, dtype=np.float64).reshape(5, 6)).share())
    view = base[1:4, ::2]
    expect = np.asarray(view).tolist()
    q_in.put(view)
    assert q_out.get(timeout=60) == expect
    p.join(60)
    assert p.exitcode == 0
    assert float(base[1, 0]) == -1.0


def test_process_arguments_and_pipe():
    ctx = dmp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_pipe_child, args=(child,))
    p.start()
    a = dlbridge.open_shared(dlbridge.zeros((3,), dtype="int64").share())
    parent.send(a)
    assert parent.recv() == "done"
    p.join(60)
    assert np.asarray(a).tolist() == [0, 7, 0]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_process_argument_is_passed_by_handle(method):
    ctx = dmp.get_context(method)
    q_out = ctx.Queue()
    a = dlbridge.open_shared(dlbridge.zeros((4,), dtype="float32").share())
    p = ctx.Process(target=_write_arg, args=(a, q_out))
    p.start()
    assert q_out.get(timeout=60) == "ok"
    p.join(60)
    assert np.asarray(a).tolist() == [0.0, 11.0, 0.0, 0.0]


def test_pool_maps_arrays_by_handle():
    arrays = [dlbridge.asarray(np.full((100,), i, dtype=np.float32)) for i in range(4)]
    with dmp.get_context("spawn").Pool(2) as pool:
        assert pool.map(_sum, arrays) == [0.0, 100.0, 200.0, 300.0]


def test_consumer_outlives_producer():
    ctx = dmp.get_context("spawn")
    q, received = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_produce_then_exit, args=(q, received))
    p.start()
    a = q.get(timeout=60)
    received.set()
    p.join(60)
    assert p.exitcode == 0
    assert not os.path.exists(f"/proc/{p.pid}")
    assert np.asarray(a).tolist() == list(range(100, 200))
    a[0] = 1  # still writable memory


def test_killed_consumer_leaks_nothing():
    ctx = dmp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    before = shmem_bytes()
    size = 64 << 20
    a = dlbridge.open_shared(dlbridge.asarray(np.ones(size // 4, dtype=np.float32)).share())
    p = ctx.Process(target=_hold_forever, args=(q, ready))
    p.start()
    q.put(a)
    assert ready.wait(60)
    # The consumer maps the memory and keeps one descriptor beside the mapping (to share it on).
    assert memfd_count(p.pid) == 1
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    # The memory is ours alone again; dropping our array frees the file's pages once the pool lets
    # the block go (the parent here plays the producer: its cache holds at most the block).
    del a
    gc.collect()
    assert not [n for n in os.listdir("/dev/shm") if "dlbridge" in n]
    assert shmem_bytes() - before < size + (32 << 20)


# ---------------------------------------------------------------------------------------------
# pickle.


def test_pickle_protocol_5_is_out_of_band_and_zero_copy():
    a = dlbridge.asarray(np.arange(4096, dtype=np.float32))
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(a, protocol=5, buffer_callback=buffers.append)
    assert len(data) < 300  # the 16 KiB of elements are not in the pickle
    assert len(buffers) == 1
    b = pickle.loads(data, buffers=buffers)
    assert b.data_ptr == a.data_ptr
    b[7] = -1.0
    assert float(a[7]) == -1.0
    del a
    assert float(b[7]) == -1.0  # the buffer keeps the memory


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_pickle_in_band_round_trips(protocol):
    a = dlbridge.asarray(np.arange(12, dtype=np.int16).reshape(3, 4))[:, 1::2]
    b = pickle.loads(pickle.dumps(a, protocol=protocol))
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.asarray(b).tolist() == np.asarray(a).tolist()


def test_pickle_of_a_handle_travels_by_ticket():
    a = dlbridge.open_shared(dlbridge.zeros((5,), dtype="uint8").share())
    h = a.share()
    data = pickle.dumps(h)
    assert h.fd is not None  # pickling lends a duplicate; the handle keeps its own
    b = dlbridge.open_shared(pickle.loads(data))
    b[2] = 9
    assert int(a[2]) == 9


def test_a_pickled_handle_dropped_unopened_returns_its_descriptor():
    a = dlbridge.open_shared(dlbridge.zeros((64,), dtype="float32").share())
    before = memfd_count()
    data = [pickle.dumps(a.share()) for _ in range(5)]
    assert memfd_count() == before + 5  # lent until claimed or forgone
    loaded = [pickle.loads(d) for d in data]
    del loaded
    gc.collect()
    assert memfd_settles_to(before)


def _open_pickled(q_in, q_out) -> None:
    h = pickle.loads(q_in.get())
    a = dlbridge.open_shared(h)
    a[3] = 33.0
    unopened = pickle.loads(q_in.get())
    del unopened  # forgone: the producer closes what it lent
    q_out.put(float(a[0]))


def test_a_handle_pickled_plainly_opens_in_another_process():
    a = dlbridge.open_shared(dlbridge.full((8,), 2.0, "float32").share())
    before = memfd_count()
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_open_pickled, args=(q_in, q_out))
    p.start()
    q_in.put(pickle.dumps(a.share()))  # bytes: no reducer of dlbridge's on the way
    q_in.put(pickle.dumps(a.share()))
    assert q_out.get(timeout=120) == 2.0
    p.join(60)
    assert p.exitcode == 0
    assert float(a[3]) == 33.0
    assert memfd_settles_to(before)  # both lent descriptors were claimed or forgone


def _pickle_and_exit(q) -> None:
    a = dlbridge.asarray(np.arange(4, dtype=np.int32)).share()
    q.put(pickle.dumps(a))


def test_a_handle_whose_producer_exited_is_a_clear_error():
    ctx = dmp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_pickle_and_exit, args=(q,))
    p.start()
    data = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    h = pickle.loads(data)
    with pytest.raises(RuntimeError, match="has exited"):
        dlbridge.open_shared(h)


# ---------------------------------------------------------------------------------------------
# PyTorch and JAX on the other side.


def test_torch_tensor_shared_and_read_by_torch_and_jax():
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    t = torch.arange(6, dtype=torch.float32)
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_read_with_torch_and_jax, args=(q_in, q_out))
    p.start()
    q_in.put(dlbridge.from_dlpack(t))
    same, via_torch, via_jax = q_out.get(timeout=120)
    p.join(60)
    assert same and via_torch == via_jax == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


# ---------------------------------------------------------------------------------------------
# Bad handles.


def test_a_handle_opens_once():
    h = dlbridge.zeros((2,)).share()
    dlbridge.open_shared(h)
    with pytest.raises(ValueError, match="already opened"):
        dlbridge.open_shared(h)
    with pytest.raises(ValueError, match="already opened"):
        h.shape


def test_a_closed_descriptor_is_refused():
    h = dlbridge.zeros((2,)).share()
    state = h._state()
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(ValueError, match="not open"):
        dlbridge._dlbridge.SharedHandle._rebuild(state, r)


def test_a_descriptor_of_another_file_is_refused():
    state = dlbridge.zeros((2,)).share()._state()
    other = dlbridge.zeros((2,)).share()
    fd = os.dup(other.fd)
    h = dlbridge._dlbridge.SharedHandle._rebuild(state, fd)
    with pytest.raises(ValueError, match="not the handle's shared file"):
        dlbridge.open_shared(h)


def test_a_handle_of_another_boot_is_refused():
    h = dlbridge.zeros((2,)).share()
    state = bytearray(h._state())
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip().encode()
    at = bytes(state).index(boot)
    state[at] = ord("0") if state[at] != ord("0") else ord("1")
    other = dlbridge._dlbridge.SharedHandle._rebuild(bytes(state), os.dup(h.fd))
    with pytest.raises(ValueError, match="another boot"):
        dlbridge.open_shared(other)


def test_garbage_and_missing_descriptors_are_refused():
    with pytest.raises(ValueError, match="not a dlbridge shared-memory handle"):
        dlbridge._dlbridge.SharedHandle._rebuild(b"garbage")
    state = dlbridge.zeros((2,)).share()._state()
    with pytest.raises(ValueError, match="needs its file descriptor"):
        dlbridge._dlbridge.SharedHandle._rebuild(state)


def test_a_device_this_process_lacks_is_refused():
    h = dlbridge.zeros((2,)).share()
    state = bytearray(h._state())
    state[6:10] = (2).to_bytes(4, "little")  # kDLCUDA
    state[10:14] = (7).to_bytes(4, "little")  # cuda:7
    other = dlbridge._dlbridge.SharedHandle._rebuild(bytes(state), os.dup(h.fd))
    with pytest.raises((BufferError, RuntimeError, ValueError)):
        dlbridge.open_shared(other)


def test_the_descriptor_limit_is_an_error_not_a_crash():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    kept = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 8, hard))
    try:
        with pytest.raises((RuntimeError, OSError, MemoryError)):
            for _ in range(64):
                kept.append(dlbridge.asarray(np.ones(4, dtype=np.float32)).share())
    finally:
        kept.clear()
        gc.collect()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # Still usable afterwards.
    assert float(dlbridge.open_shared(dlbridge.full((1,), 1.0).share())[0]) == 1.0


# ---------------------------------------------------------------------------------------------
# Hostile consumers and lenders. Whatever could crash or hang runs in a child process with a
# timeout; the hostile side is a process of its own.


def run_python(code: str, *args: str, env=None, input=None, timeout: float = 60):
    """Runs ``code`` in a new interpreter (this one's) and returns its completed process (bytes
    out); a hang past ``timeout`` fails the test (``TimeoutExpired``)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        input=input,
        capture_output=True,
        env=full_env,
        timeout=timeout,
    )


def ticket_of(state: bytes) -> tuple[str, bytes]:
    """The lender's name and the token (8 bytes) of a lent handle's bytes (the ticket ends them:
    a length byte, the name, the token)."""
    at = state.index(b"dlbridge-fds/")
    n = state[at - 1]
    return state[at : at + n].decode(), state[at + n : at + n + 8]


def with_ticket(state: bytes, name: str, token: bytes) -> bytes:
    """``state`` with its ticket's lender renamed ``name`` and its token made ``token``."""
    at = state.index(b"dlbridge-fds/")
    n = state[at - 1]
    return state[: at - 1] + bytes([len(name)]) + name.encode() + token + state[at + n + 8 :]


_FAKE_LENDER = r"""
import os, socket, sys
pid = os.getpid() if sys.argv[1] == "self" else int(sys.argv[1])
if len(sys.argv) > 2:
    os.setuid(int(sys.argv[2]))
name = f"dlbridge-fds/{pid}/{os.getpid():08x}0badf00d"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0" + name)
s.listen()
print(name, flush=True)
held = []
while True:
    c, _ = s.accept()
    held.append(c)
    c.recv(9)
    print("asked", flush=True)
"""


class _FakeLender:
    """A process bound to a lender's name that never answers: a squatter of a dead producer's
    name, or a stand-in for a stopped one. ``pid`` is the process the name gives (``self``: the
    squatter's own); ``uid`` the user it runs as."""

    def __init__(self, pid: str = "self", uid: int | None = None) -> None:
        args = [sys.executable, "-c", _FAKE_LENDER, pid] + ([str(uid)] if uid is not None else [])
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.name = self.proc.stdout.readline().strip()
        assert self.name.startswith("dlbridge-fds/"), self.name

    def __enter__(self) -> "_FakeLender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait(30)


# Opens the handle bytes given in hex; prints "claiming", then how it ended and after how long.
_CLAIM = r"""
import sys, time, dlbridge
h = dlbridge._dlbridge.SharedHandle._rebuild(bytes.fromhex(sys.argv[1]))
kw = {"timeout": float(sys.argv[2])} if len(sys.argv) > 2 else {}
print("claiming", flush=True)
start = time.monotonic()
try:
    dlbridge.open_shared(h, **kw)
    print("opened", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", time.monotonic() - start, flush=True)
except Exception as e:
    print(type(e).__name__, time.monotonic() - start, e, flush=True)
"""


def _claim_result(out: bytes) -> tuple[str, float, str]:
    lines = out.decode().splitlines()
    assert lines[0] == "claiming", lines
    kind, took, *rest = lines[1].split(" ", 2)
    return kind, float(took), " ".join(rest)


_TRUNCATING_CONSUMER = r"""
import os, pickle, sys, dlbridge
a = dlbridge.open_shared(pickle.loads(sys.stdin.buffer.read()))
h = a.share()  # a descriptor of the producer's file, held by this process
try:
    os.ftruncate(h.fd, 0)
    print("truncated", flush=True)
except OSError as e:
    print("refused", e.errno, flush=True)
try:
    import fcntl
    fcntl.fcntl(h.fd, 1033, 0x0008)  # F_ADD_SEALS, F_SEAL_WRITE
    print("sealed", flush=True)
except OSError as e:
    print("refused", e.errno, flush=True)
print(float(a[-1]), flush=True)
"""

_TRUNCATED_PRODUCER = r"""
import pickle, subprocess, sys
import numpy as np
import dlbridge
a = dlbridge.open_shared(dlbridge.full((1 << 18,), 3.0, "float32").share())
consumer = subprocess.run(
    [sys.executable, "-c", sys.argv[1]], input=pickle.dumps(a.share()), capture_output=True,
    timeout=60,
)
sys.stdout.write(consumer.stdout.decode())
# Every page of the memory, after the consumer's attempt (a shrunk file: SIGBUS here).
print(float(np.asarray(a).sum()), flush=True)
"""


def test_a_consumer_cannot_truncate_the_shared_file():
    """The issue's one-liner, with the producer and the hostile consumer in processes of their
    own: the consumer's ftruncate of the descriptor it received is refused (the file is sealed),
    and the producer reads all of its memory afterwards."""
    r = run_python(_TRUNCATED_PRODUCER, _TRUNCATING_CONSUMER, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr.decode()[-2000:])
    lines = r.stdout.decode().split()
    assert lines[:4] == ["refused", str(1), "refused", str(1)], lines  # EPERM twice
    assert float(lines[4]) == 3.0
    assert float(lines[5]) == 3.0 * (1 << 18)


def test_the_issue_one_liner_raises_instead_of_crashing():
    r = run_python(
        "import os, dlbridge\n"
        "a = dlbridge.open_shared(dlbridge.zeros((1024,)).share())\n"
        "h = a.share()\n"
        "try:\n"
        "    os.ftruncate(h.fd, 0)\n"
        "except PermissionError:\n"
        "    print('refused')\n"
        "print(float(a[0]))\n"
    )
    assert r.returncode == 0, (r.returncode, r.stderr.decode()[-2000:])
    assert r.stdout.decode().split() == ["refused", "0.0"]


def test_a_descriptor_without_seals_is_refused():
    h = dlbridge.zeros((16,)).share()
    state = h._state()
    unsealed = os.memfd_create("dlbridge-shared")
    os.ftruncate(unsealed, h.allocation_nbytes)
    real = os.fstat(h.fd).st_ino.to_bytes(8, "little")
    forged = state.replace(real, os.fstat(unsealed).st_ino.to_bytes(8, "little"))
    assert forged != state
    other = dlbridge._dlbridge.SharedHandle._rebuild(forged, unsealed)
    with pytest.raises(ValueError, match="not sealed"):
        dlbridge.open_shared(other)


_TOKENS = r"""
import pickle, sys, dlbridge
states = pickle.loads(sys.stdin.buffer.read())
rebuild = dlbridge._dlbridge.SharedHandle._rebuild
for state in states:
    try:
        a = dlbridge.open_shared(rebuild(state))
    except Exception as e:
        print(f"{type(e).__name__}: {e}", flush=True)
        continue
    a[0] = 7.0
    print("opened", flush=True)
"""


def test_handle_bytes_open_once_and_only_with_their_token():
    """A consumer process tries a zeroed token, a token of another ticket (on this handle's bytes),
    then the real bytes twice; the producer then tries the same bytes: only the first real open
    maps the memory."""
    a = dlbridge.open_shared(dlbridge.full((4,), 1.0, "float32").share())
    b = dlbridge.open_shared(dlbridge.full((4,), 2.0, "float32").share())
    real = a.share()._lend()
    other = b.share()._lend()
    name, _ = ticket_of(real)
    _, other_token = ticket_of(other)
    states = [
        with_ticket(real, name, bytes(8)),
        with_ticket(real, name, other_token),
        real,
        real,
    ]
    r = run_python(_TOKENS, input=pickle.dumps(states))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    zeroed, swapped, first, second = r.stdout.decode().splitlines()
    assert zeroed.startswith("ValueError") and "altered or forged" in zeroed, zeroed
    assert swapped.startswith("ValueError") and "another handle's" in swapped, swapped
    assert first == "opened"
    assert second.startswith("ValueError") and "already opened" in second, second
    assert float(a[0]) == 7.0 and float(b[0]) == 2.0
    # The other ticket, tried with the wrong handle's bytes, is still good for its own.
    assert float(dlbridge.open_shared(dlbridge._dlbridge.SharedHandle._rebuild(other))[0]) == 2.0
    # The same bytes in this (a second) process, plainly and through pickle.
    rebuild = dlbridge._dlbridge.SharedHandle._rebuild
    with pytest.raises(ValueError, match="already opened"):
        dlbridge.open_shared(rebuild(real))
    data = pickle.dumps(a.share())
    dlbridge.open_shared(pickle.loads(data))
    with pytest.raises(ValueError, match="already opened"):
        dlbridge.open_shared(pickle.loads(data))


def test_a_lender_that_never_answers_ends_the_claim_after_the_timeout():
    a = dlbridge.open_shared(dlbridge.zeros((4,)).share())
    state = a.share()._lend()
    with _FakeLender() as lender:
        forged = with_ticket(state, lender.name, ticket_of(state)[1])
        # The default, from the environment.
        r = run_python(_CLAIM, forged.hex(), env={"DLBRIDGE_SHARE_TIMEOUT": "1"})
        kind, took, message = _claim_result(r.stdout)
        assert kind == "RuntimeError" and "did not answer within 1.000 s" in message, message
        assert 1.0 <= took < 20
        # The keyword.
        r = run_python(_CLAIM, forged.hex(), "0.5")
        kind, took, message = _claim_result(r.stdout)
        assert kind == "RuntimeError" and "did not answer within 0.500 s" in message, message
        assert 0.5 <= took < 20


def test_a_lender_of_another_process_is_refused_at_once():
    """The name gives this process's id, but another process holds it."""
    a = dlbridge.open_shared(dlbridge.zeros((4,)).share())
    state = a.share()._lend()
    with _FakeLender(pid=str(os.getpid())) as lender:
        forged = with_ticket(state, lender.name, ticket_of(state)[1])
        r = run_python(_CLAIM, forged.hex())
        kind, took, message = _claim_result(r.stdout)
        assert kind == "RuntimeError" and "held by process" in message, message
        assert took < 10


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the squatter as another user")
def test_a_lender_of_another_user_is_refused_at_once():
    """A process of another user binds the name of a producer (that exited)."""
    a = dlbridge.open_shared(dlbridge.zeros((4,)).share())
    state = a.share()._lend()
    with _FakeLender(uid=65534) as lender:
        forged = with_ticket(state, lender.name, ticket_of(state)[1])
        r = run_python(_CLAIM, forged.hex())
        kind, took, message = _claim_result(r.stdout)
        assert kind == "RuntimeError" and "another user (uid 65534)" in message, message
        assert took < 10


_LEND_AND_WAIT = r"""
import pickle, sys, dlbridge
a = dlbridge.open_shared(dlbridge.full((16,), 1.0).share())
print(pickle.dumps(a.share()).hex(), flush=True)
sys.stdin.read()
"""

_OPEN_PICKLED = r"""
import pickle, sys, time, dlbridge
h = pickle.loads(bytes.fromhex(sys.argv[1]))
print("claiming", flush=True)
start = time.monotonic()
try:
    print("opened", float(dlbridge.open_shared(h)[0]), flush=True)
except Exception as e:
    print(type(e).__name__, time.monotonic() - start, e, flush=True)
"""


def test_a_stopped_producer_ends_the_claim_after_the_timeout():
    producer = subprocess.Popen(
        [sys.executable, "-c", _LEND_AND_WAIT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        data = producer.stdout.readline().decode().strip()
        os.kill(producer.pid, signal.SIGSTOP)
        r = run_python(_OPEN_PICKLED, data, env={"DLBRIDGE_SHARE_TIMEOUT": "1"})
        kind, took, message = _claim_result(r.stdout)
        assert kind == "RuntimeError" and "did not answer" in message, message
        assert 1.0 <= took < 20
    finally:
        os.kill(producer.pid, signal.SIGCONT)
        producer.stdin.close()
        producer.wait(30)


def test_ctrl_c_interrupts_a_claim_promptly():
    """A consumer waiting for a lender that never answers gets SIGINT: open_shared raises
    KeyboardInterrupt at once, long before its 120 s timeout."""
    a = dlbridge.open_shared(dlbridge.zeros((4,)).share())
    state = a.share()._lend()
    with _FakeLender() as lender:
        forged = with_ticket(state, lender.name, ticket_of(state)[1])
        consumer = subprocess.Popen(
            [sys.executable, "-c", _CLAIM, forged.hex()],
            stdout=subprocess.PIPE,
            env=dict(os.environ, DLBRIDGE_SHARE_TIMEOUT="120"),
        )
        try:
            assert consumer.stdout.readline() == b"claiming\n"
            assert lender.proc.stdout.readline() == "asked\n"  # the claim waits for the reply
            time.sleep(0.2)
            consumer.send_signal(signal.SIGINT)
            out, _ = consumer.communicate(timeout=20)
        finally:
            consumer.kill()
            consumer.wait(30)
        kind, took, _ = _claim_result(b"claiming\n" + out)
        assert kind == "KeyboardInterrupt"
        assert took < 10


_EXPIRING = r"""
import os, pickle, sys, time, dlbridge

def memfds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "dlbridge-shared" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n

a = dlbridge.open_shared(dlbridge.zeros((64,)).share())
before = memfds()
data = [pickle.dumps(a.share()) for _ in range(5)]
assert memfds() == before + 5, (memfds(), before)
print(data[0].hex(), flush=True)
until = time.monotonic() + 10
while memfds() != before and time.monotonic() < until:
    time.sleep(0.01)
print("expired" if memfds() == before else f"kept {memfds() - before}", flush=True)
sys.stdin.read()
"""


def test_unclaimed_lent_descriptors_expire_and_a_late_claim_says_so():
    producer = subprocess.Popen(
        [sys.executable, "-c", _EXPIRING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=dict(os.environ, DLBRIDGE_SHARE_TICKET_TTL="0.5"),
    )
    try:
        data = bytes.fromhex(producer.stdout.readline().decode())
        assert producer.stdout.readline() == b"expired\n"
        with pytest.raises(RuntimeError, match="not opened in time"):
            dlbridge.open_shared(pickle.loads(data))
    finally:
        producer.stdin.close()
        producer.wait(30)
    assert producer.returncode == 0


def test_the_shareable_pool_is_in_memory_stats_and_empty_cache_releases_it():
    def shareable() -> dict:
        return dlbridge.memory_stats(shareable=True)

    dlbridge.empty_cache()
    kept = dlbridge.asarray(np.ones(1 << 16, dtype=np.float32)).to_shareable()  # 256 KiB in use
    assert shareable()["active_bytes"] >= kept.nbytes
    # A share copies into the shareable pool; the copy goes back to its cache at once.
    h = dlbridge.zeros((1 << 18,), dtype="float32").share()
    stats = shareable()
    assert stats["cached_bytes"] >= 1 << 20
    assert stats["allocations"] >= 2
    frees = stats["driver_frees"]
    dlbridge.empty_cache()
    stats = shareable()
    assert stats["cached_bytes"] == 0
    assert stats["driver_frees"] > frees
    assert stats["active_bytes"] >= kept.nbytes  # in use: untouched
    assert float(dlbridge.open_shared(h)[5]) == 0.0
    assert float(kept[5]) == 1.0
    with pytest.raises(ValueError, match="no storage"):
        dlbridge.memory_stats(storage="shared", shareable=True)


_TORCH_WRITES_READ_ONLY = r"""
import numpy as np, torch, dlbridge
src = np.arange(8, dtype=np.float32)
src.flags.writeable = False
a = dlbridge.from_dlpack(src).to_shareable()   # a read-only array in shareable memory
h = a.share(copy=False)
assert h.readonly
b = dlbridge.open_shared(h)
assert b.readonly
torch.from_dlpack(b).add_(1)   # PyTorch ignores DLPack's read-only flag
print(float(b[0]), float(a[0]), flush=True)
"""


def test_a_read_only_shared_view_is_writable_memory_for_consumers_that_ignore_the_flag():
    """Nothing dlbridge exports may fault on a write: a read-only handle maps writable pages (the
    flag is for consumers that honour it; PyTorch does not)."""
    pytest.importorskip("torch")
    r = run_python(_TORCH_WRITES_READ_ONLY, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr.decode()[-2000:])
    assert r.stdout.decode().split() == ["1.0", "1.0"]


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a device; the GPU machine runs them).


def _cuda_writer(q_in, q_out) -> None:
    a = q_in.get()
    a[...] = dlbridge.full(a.shape, 5.0, "float32", device=str(a.device))
    dlbridge.synchronize(a.device)
    q_out.put("written")


def _cuda_read(q_in, q_out) -> None:
    a = q_in.get()  # opening makes this process's stream wait for the producer's work
    values = np.asarray(a.to("cpu"))
    q_out.put([float(values[0]), float(values[-1])])


def _cuda_read_cupy_or_jax(reader, q_in, q_out) -> None:
    h = q_in.get()
    a = dlbridge.open_shared(h)
    if reader == "cupy":
        import cupy

        q_out.put(cupy.from_dlpack(a).get().tolist())
    else:
        import jax

        q_out.put(np.asarray(jax.dlpack.from_dlpack(a)).tolist())


def _cuda_produce_then_exit(q, received) -> None:
    a = dlbridge.asarray(np.arange(256, dtype=np.float32), device="cuda:0")
    # An ordinary array would go as itself, by a legacy IPC handle valid while this process
    # lives (PyTorch's rule); a copy in the shareable (VMM) pool outlives it.
    q.put(a.to_shareable())
    received.wait(60)


@needs_cuda
@pytest.mark.parametrize("device", ["cuda:0", "cuda_host:0"])
def test_cuda_write_in_child_is_seen_by_parent(device):
    pytest.importorskip("torch")
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_cuda_writer, args=(q_in, q_out))
    p.start()
    a = dlbridge.open_shared(dlbridge.zeros((1024,), dtype="float32", device=device).share())
    q_in.put(a)
    assert q_out.get(timeout=120) == "written"
    p.join(60)
    assert np.asarray(a.to("cpu")).tolist() == [5.0] * 1024


def _cuda_check_then_write(q_in, q_out) -> None:
    a = q_in.get()
    q_out.put(np.asarray(a.to("cpu")).tolist())  # the parent's write
    a[...] = dlbridge.full(a.shape, 6.0, "float32", device=str(a.device))
    dlbridge.synchronize(a.device)
    q_out.put("written")


@needs_cuda
def test_cuda_opened_array_is_sent_on_as_the_same_memory_both_ways():
    """Parent writes, child reads; child writes, parent reads: one allocation, never a copy."""
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_cuda_check_then_write, args=(q_in, q_out))
    p.start()
    a = dlbridge.open_shared(dlbridge.zeros((1024,), dtype="float32", device="cuda:0").share())
    h = a.share(copy=False)  # an opened array is shareable as it is: VMM, not a legacy handle
    assert h.kind == "cuda_vmm"
    a[...] = dlbridge.full(a.shape, 4.0, "float32", device="cuda:0")
    dlbridge.synchronize("cuda:0")
    q_in.put(a)
    assert q_out.get(timeout=120) == [4.0] * 1024
    assert q_out.get(timeout=120) == "written"
    p.join(60)
    assert np.asarray(a.to("cpu")).tolist() == [6.0] * 1024
    b = dlbridge.open_shared(h)  # the same allocation, already mapped here
    assert np.asarray(b.to("cpu")).tolist() == [6.0] * 1024


def _gpu_reader() -> str:
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        return "cupy"
    jax = pytest.importorskip("jax", reason="needs CuPy or JAX with a GPU backend")
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("needs CuPy or JAX with a GPU backend")
    return "jax"


@needs_cuda
@pytest.mark.parametrize("copy", [False, None])
def test_cuda_torch_tensor_read_by_cupy_or_jax_in_another_process(copy):
    torch = pytest.importorskip("torch")
    reader = _gpu_reader()
    t = torch.arange(64, dtype=torch.float32, device="cuda")
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_cuda_read_cupy_or_jax, args=(reader, q_in, q_out))
    p.start()
    h = dlbridge.from_dlpack(t).share(copy=copy)
    # No copy: a legacy IPC handle of PyTorch's memory; copy allowed: a VMM copy.
    assert h.kind == ("cuda_ipc" if copy is False else "cuda_vmm")
    q_in.put(h)
    assert q_out.get(timeout=120) == list(range(64))
    p.join(60)
    assert p.exitcode == 0


@needs_cuda
def test_cuda_consumer_outlives_producer():
    ctx = dmp.get_context("spawn")
    q, received = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_cuda_produce_then_exit, args=(q, received))
    p.start()
    a = q.get(timeout=120)
    received.set()
    p.join(60)
    assert p.exitcode == 0
    assert np.asarray(a.to("cpu")).tolist() == list(range(256))


@needs_cuda
def test_cuda_killed_consumer_leaks_no_device_memory():
    free_before, _ = dlbridge.cuda.mem_get_info(0)
    ctx = dmp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    size = 256 << 20
    a = dlbridge.open_shared(dlbridge.zeros((size // 4,), dtype="float32", device="cuda:0").share())
    p = ctx.Process(target=_hold_forever, args=(q, ready))
    p.start()
    q.put(a)
    assert ready.wait(120)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    del a
    gc.collect()
    dlbridge.empty_cache("cuda:0")
    time.sleep(1)
    free_after, _ = dlbridge.cuda.mem_get_info(0)
    # The pool may cache the producer's block: at most one block of the size.
    assert free_before - free_after < size + (64 << 20)


@needs_cuda
def test_cuda_consumer_waits_for_the_producers_running_kernel():
    torch = pytest.importorskip("torch")
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_cuda_read, args=(q_in, q_out))
    p.start()
    a = dlbridge.open_shared(dlbridge.zeros((1 << 20,), dtype="float32", device="cuda:0").share())
    t = torch.from_dlpack(a)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a spinning kernel on the current stream
    t.fill_(3.0)  # queued behind it: still pending when the consumer reads
    q_in.put(dlbridge.from_dlpack(t))
    values = q_out.get(timeout=120)
    p.join(60)
    assert values[0] == 3.0 and values[-1] == 3.0


def _legacy_produce_and_exit(q, received) -> None:
    import torch

    t = torch.ones(16, device="cuda")
    h = dlbridge.from_dlpack(t).share(copy=False)
    assert h.kind == "cuda_ipc"
    q.put(h)
    received.wait(60)


@needs_cuda
def test_cuda_stale_legacy_handle_is_an_error():
    pytest.importorskip("torch")
    ctx = dmp.get_context("spawn")
    q, received = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_legacy_produce_and_exit, args=(q, received))
    p.start()
    h = q.get(timeout=120)
    received.set()
    p.join(60)
    assert p.exitcode == 0
    # The producer is gone, and with it the memory: a clear error, not a crash.
    with pytest.raises(RuntimeError, match="has exited"):
        dlbridge.open_shared(h)


@needs_cuda
def _cuda_open_pickled(q_in, q_out) -> None:
    a = dlbridge.open_shared(pickle.loads(q_in.get()))
    b = dlbridge.open_shared(pickle.loads(q_in.get()))  # the same allocation: mapped once
    q_out.put((a.data_ptr == b.data_ptr, np.asarray(b.to("cpu")).tolist()))


@needs_cuda
def test_cuda_vmm_handle_travels_by_plain_pickle():
    """The exporter's VMM descriptor itself is lent and claimed (a reopening of its path would not
    do for the driver); a second handle of the same allocation needs no descriptor."""
    shared = dlbridge.asarray(np.arange(16, dtype=np.float32)).to("cuda:0").to_shareable()
    assert shared.share().kind == "cuda_vmm"
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_cuda_open_pickled, args=(q_in, q_out))
    p.start()
    q_in.put(pickle.dumps(shared.share()))
    q_in.put(pickle.dumps(shared.share()))
    same, values = q_out.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert same and values == list(range(16))


# ---------------------------------------------------------------------------------------------
# CUDA handles against hostile consumers and lenders (VMM and legacy IPC).

_CUDA_TOKENS = r"""
import pickle, sys
import numpy as np
import dlbridge
states = pickle.loads(sys.stdin.buffer.read())
rebuild = dlbridge._dlbridge.SharedHandle._rebuild
kept = []  # opened arrays stay alive: a VMM allocation stays mapped here
for state in states:
    try:
        a = dlbridge.open_shared(rebuild(state))
    except Exception as e:
        print(f"{type(e).__name__}: {e}", flush=True)
        continue
    kept.append(a)
    print("opened", float(np.asarray(a.to("cpu"))[0]), flush=True)
"""


def _cuda_lent(kind: str):
    """An array on cuda:0 (kept by the caller) and its handle's lent bytes, of ``kind``."""
    if kind == "cuda_vmm":
        a = dlbridge.full((1024,), 1.0, "float32", device="cuda:0").to_shareable()
    else:
        torch = pytest.importorskip("torch")
        a = dlbridge.from_dlpack(torch.full((1024,), 1.0, device="cuda"))
    h = a.share(copy=False)
    assert h.kind == kind
    return a, h._lend()


@needs_cuda
@pytest.mark.parametrize("kind", ["cuda_vmm", "cuda_ipc"])
def test_cuda_handle_bytes_open_once_and_only_with_their_token(kind):
    """A consumer process tries a zeroed token, then the real bytes twice (a VMM allocation is
    mapped there by then: no descriptor is needed, but the ticket is proved all the same)."""
    a, real = _cuda_lent(kind)
    name, _ = ticket_of(real)
    states = [with_ticket(real, name, bytes(8)), real, real]
    r = run_python(_CUDA_TOKENS, input=pickle.dumps(states), timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    zeroed, first, second = r.stdout.decode().splitlines()
    assert zeroed.startswith("ValueError") and "altered or forged" in zeroed, zeroed
    assert first == "opened 1.0"
    assert second.startswith("ValueError") and "already opened" in second, second
    with pytest.raises(ValueError):
        dlbridge.open_shared(dlbridge._dlbridge.SharedHandle._rebuild(real))
    del a


@needs_cuda
@pytest.mark.parametrize("kind", ["cuda_vmm", "cuda_ipc"])
def test_cuda_a_lender_that_never_answers_or_is_not_the_producer_is_refused(kind):
    a, state = _cuda_lent(kind)
    with _FakeLender() as silent, _FakeLender(pid=str(os.getpid())) as impostor:
        token = ticket_of(state)[1]
        r = run_python(_CLAIM, with_ticket(state, silent.name, token).hex(), "0.5", timeout=120)
        kind_, took, message = _claim_result(r.stdout)
        assert kind_ == "RuntimeError" and "did not answer within 0.500 s" in message, message
        assert 0.5 <= took < 30
        r = run_python(_CLAIM, with_ticket(state, impostor.name, token).hex(), timeout=120)
        kind_, took, message = _claim_result(r.stdout)
        assert kind_ == "RuntimeError" and "held by process" in message, message
    del a


_CLOSED_DESCRIPTOR = r"""
import os, sys, dlbridge
a = dlbridge.zeros((1024,), dtype="float32", device=sys.argv[1]).to_shareable()
h = a.share(copy=False)
os.close(h.fd)  # the handle's own descriptor, closed behind its back
try:
    dlbridge.open_shared(h)
    print("opened")
except Exception as e:
    print(type(e).__name__, e)
a[0] = 1.0
print(float(a[0]))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_cuda)])
def test_a_handle_whose_descriptor_was_closed_is_refused(device):
    r = run_python(_CLOSED_DESCRIPTOR, device, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr.decode()[-2000:])
    refused, value = r.stdout.decode().splitlines()
    assert refused.startswith("ValueError") and "closed by someone else" in refused, refused
    assert value == "1.0"


def _cuda_spin_then_hold(q, ready) -> None:
    import torch

    a = q.get()
    t = torch.from_dlpack(a)
    torch.cuda._sleep(4_000_000_000)  # about 2 s of a spinning kernel on the current stream
    t.sum()  # a read of the shared memory queued behind it
    ready.set()
    time.sleep(120)


@needs_cuda
def test_cuda_a_consumer_killed_mid_kernel_leaves_the_producer_whole():
    pytest.importorskip("torch")
    free_before, _ = dlbridge.cuda.mem_get_info(0)
    ctx = dmp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    size = 64 << 20
    a = dlbridge.open_shared(dlbridge.full((size // 4,), 1.0, "float32", device="cuda:0").share())
    p = ctx.Process(target=_cuda_spin_then_hold, args=(q, ready))
    p.start()
    q.put(a)
    assert ready.wait(120)
    os.kill(p.pid, signal.SIGKILL)  # its kernel still spins
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    a[...] = dlbridge.full(a.shape, 3.0, "float32", device="cuda:0")
    dlbridge.synchronize("cuda:0")
    values = np.asarray(a.to("cpu"))
    assert float(values[0]) == 3.0 and float(values[-1]) == 3.0
    del a
    gc.collect()
    dlbridge.empty_cache("cuda:0")
    time.sleep(1)
    free_after, _ = dlbridge.cuda.mem_get_info(0)
    assert free_before - free_after < size + (64 << 20)
