"""``dlbridge.multiprocessing`` as a drop-in for ``torch.multiprocessing``: ``Array.share_memory_``
moves an array into process-shareable memory in place (the same address where dlbridge owns whole
pages, a shared copy otherwise), ``Array.is_shared``, arrays sent through every channel with
every start method seen and written both ways, ``spawn`` / ``start_processes`` with PyTorch's
semantics, the sharing strategies, and the module's docstring example run as written.

Where PyTorch is installed, the same steps run against ``torch.multiprocessing`` and the results
are compared. CUDA cases skip here with "needs a CUDA device" and run for real on a GPU machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dlbridge
import dlbridge.multiprocessing as dmp

needs_cuda = pytest.mark.skipif(not dlbridge.cuda.is_available(), reason="needs a CUDA device")

METHODS = ["spawn", "forkserver", "fork"]
# A small array shares its pages with other allocations (moved by a copy); a large one fills
# whole pages of its own (moved in place).
SIZES = {"small": 4, "whole_pages": 1 << 16}


def mapped_from(addr: int) -> str:
    """The ``/proc/self/maps`` line of the mapping holding ``addr`` (its last field names a shared
    file: ``/memfd:dlbridge-shared``)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.strip()
    raise AssertionError(f"{addr:#x} is not mapped")


def in_shared_file(addr: int) -> bool:
    return "dlbridge-shared" in mapped_from(addr)


# ---------------------------------------------------------------------------------------------
# share_memory_ and is_shared, in one process.


def test_share_memory_moves_whole_pages_in_place_and_earlier_views_and_exports_follow():
    torch = pytest.importorskip("torch")
    a = dlbridge.zeros((1 << 16,), dtype="float32")  # 256 KiB: a pool block of whole pages
    view = a[8:16]
    t = torch.from_dlpack(a)  # exports made before the move
    n = np.from_dlpack(a)
    ptr = a.data_ptr
    assert a.storage == "shared" and not a.is_shared() and not in_shared_file(ptr)

    assert a.share_memory_() is a
    assert a.is_shared() and view.is_shared()
    assert a.data_ptr == ptr == t.data_ptr() == n.ctypes.data and view.data_ptr == ptr + 32
    assert in_shared_file(ptr)
    assert a.share_memory_() is a and a.data_ptr == ptr  # moving again changes nothing

    # Another mapping of the same shared file: every earlier export sees its writes, and back.
    other = dlbridge.open_shared(a.share(copy=False))
    assert other.data_ptr != ptr
    other[0], other[9] = 5.0, 3.0
    assert float(a[0]) == t[0].item() == n[0] == 5.0 and float(view[1]) == 3.0
    t[1] = 7.0
    assert float(other[1]) == 7.0


def test_a_moved_block_gets_private_pages_back_before_the_pool_reuses_it():
    a = dlbridge.zeros((1 << 16,), dtype="float32")
    ptr = a.data_ptr
    a.share_memory_()
    other = dlbridge.open_shared(a.share(copy=False))  # holds the file, as a consumer would
    other[0] = 1.0
    del a
    b = dlbridge.zeros((1 << 16,), dtype="float32")  # the cached block again
    assert b.data_ptr == ptr
    assert not b.is_shared() and not in_shared_file(ptr)
    b[0] = 2.0
    assert float(other[0]) == 1.0  # the consumer's memory and the new array's are apart
    other[1] = 3.0
    assert float(b[1]) == 0.0


@pytest.mark.parametrize("kind", ["small", "foreign", "view_of_small"])
def test_share_memory_replaces_what_cannot_move_in_place_by_a_shared_copy(kind):
    base = None
    if kind == "small":
        a = dlbridge.asarray([1.0, 2.0, 3.0, 4.0], dtype="float32")
    elif kind == "foreign":
        base = np.arange(1 << 16, dtype=np.float32)
        a = dlbridge.from_dlpack(base)  # NumPy's memory
        assert a.is_foreign
    else:
        a = dlbridge.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))[1:, ::2]
    before = np.asarray(a).copy()
    earlier_view = a[0:]  # made before: keeps the old memory
    ptr = a.data_ptr
    assert not a.is_shared()
    assert a.share_memory_() is a
    assert a.is_shared() and a.data_ptr != ptr and in_shared_file(a.data_ptr)
    assert a.shape == before.shape and np.array_equal(np.asarray(a), before)
    assert not earlier_view.is_shared() and earlier_view.data_ptr == ptr
    a[0] = -1.0  # the new memory: the earlier view and the producer do not see it
    assert float(np.asarray(earlier_view).flat[0]) == before.flat[0]
    if base is not None:
        assert base[0] == 0.0
    later_view = a[0:]
    assert later_view.is_shared() and later_view.data_ptr == a.data_ptr


def test_a_foreign_array_is_disconnected_from_its_producer_as_with_torch():
    torch = pytest.importorskip("torch")
    x = np.zeros(1 << 16, dtype=np.float32)
    t = torch.from_numpy(x).share_memory_()
    y = np.zeros(1 << 16, dtype=np.float32)
    a = dlbridge.from_dlpack(y).share_memory_()
    t[0], a[0] = 1.0, 1.0
    # Neither producer sees the write; both moved arrays are shared.
    assert (x[0], y[0]) == (0.0, 0.0)
    assert t.is_shared() and a.is_shared()
    assert (t.data_ptr() == x.ctypes.data) == (a.data_ptr == y.ctypes.data) == False  # noqa: E712


def test_a_view_of_whole_pages_moves_its_whole_block_in_place():
    base = dlbridge.asarray(np.arange(1 << 16, dtype=np.float32)).copy()
    view = base[100:200:3]
    ptr = base.data_ptr
    view.share_memory_()
    assert view.byte_offset == 400 and view.strides == (3,)
    assert base.is_shared() and base.data_ptr == ptr
    assert float(view[0]) == 100.0


def test_read_only_and_empty_arrays():
    ro = np.arange(8, dtype=np.int32)
    ro.flags.writeable = False
    a = dlbridge.asarray(ro)
    assert a.readonly
    a.share_memory_()
    assert a.is_shared() and a.readonly and a.tolist() == list(range(8))
    empty = dlbridge.zeros((0, 3))
    assert empty.share_memory_() is empty and empty.is_shared() and empty.shape == (0, 3)


def test_opened_and_shareable_arrays_are_shared_already():
    a = dlbridge.zeros((16,)).to_shareable()
    assert a.is_shared()
    ptr = a.data_ptr
    a.share_memory_()
    assert a.data_ptr == ptr
    b = dlbridge.open_shared(a.share(copy=False))
    assert b.is_shared()


def test_is_shared_matches_torch_for_the_same_steps():
    torch = pytest.importorskip("torch")
    t = torch.zeros(1 << 16)
    a = dlbridge.zeros((1 << 16,))
    assert (t.is_shared(), a.is_shared()) == (False, False)
    t.share_memory_()
    a.share_memory_()
    assert (t.is_shared(), a.is_shared()) == (True, True)
    assert t[1:].is_shared() and a[1:].is_shared()


# ---------------------------------------------------------------------------------------------
# Child-process bodies (top level, so that spawn and forkserver can import them).


def _both_ways(q_in, q_out) -> None:
    """Reads the parent's write, writes, then reads the parent's later write; sends an array of
    its own and reads the parent's write to it."""
    a = q_in.get()
    q_out.put((float(a[1]), a.is_shared()))
    a[0] = 42.0
    q_out.put("written")
    assert q_in.get() == "check"
    q_out.put(float(a[2]))
    mine = dlbridge.zeros((a.shape[0],))
    mine[0] = 1.0
    q_out.put(mine)
    assert q_in.get() == "check mine"
    q_out.put(float(mine[1]))


def _pipe_both_ways(conn) -> None:
    a = conn.recv()
    conn.send(float(a[1]))
    a[0] = 42.0
    conn.send("written")
    assert conn.recv() == "check"
    conn.send(float(a[2]))


def _write_argument(a, q_out) -> None:
    q_out.put(float(a[1]))
    a[0] = 9.0
    q_out.put("written")


_KEPT: list = []


def _pool_task(arg):
    """A Pool task: writes its argument; keeps an array of its own, returns it, and reports what
    the parent wrote to it (the pool has one worker, so every task runs in the same process)."""
    op, value = arg
    if op == "write":
        value[0] = 11.0
        return None
    if op == "make":
        _KEPT.append(dlbridge.zeros((value,)))
        return _KEPT[-1]
    return float(_KEPT[-1][1])


# ---------------------------------------------------------------------------------------------
# Every channel, every start method: an ordinary array, moved on its first send.


def _finish(*processes) -> None:
    for p in processes:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
        assert p.exitcode == 0, p.exitcode


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", METHODS)
def test_queue_writes_are_seen_both_ways(method, size):
    ctx = dmp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_both_ways, args=(q_in, q_out))
    p.start()
    try:
        a = dlbridge.zeros((SIZES[size],))
        a[1] = 7.0
        ptr = a.data_ptr
        q_in.put(a)
        assert q_out.get(timeout=60) == (7.0, True)
        assert q_out.get(timeout=60) == "written"
        assert float(a[0]) == 42.0 and a.is_shared()
        # In place where the array fills whole pages; a shared copy in place of a small one.
        assert (a.data_ptr == ptr) == (size == "whole_pages")
        a[2] = 5.0
        q_in.put("check")
        assert q_out.get(timeout=60) == 5.0
        theirs = q_out.get(timeout=60)  # the child's own array, sent back: its memory too
        assert float(theirs[0]) == 1.0
        theirs[1] = 3.0
        q_in.put("check mine")
        assert q_out.get(timeout=60) == 3.0
    finally:
        _finish(p)


@pytest.mark.parametrize("method", METHODS)
def test_pipe_writes_are_seen_both_ways(method):
    ctx = dmp.get_context(method)
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_pipe_both_ways, args=(child,))
    p.start()
    try:
        a = dlbridge.zeros((1 << 16,))
        a[1] = 7.0
        parent.send(a)
        assert parent.recv() == 7.0
        assert parent.recv() == "written"
        assert float(a[0]) == 42.0
        a[2] = 5.0
        parent.send("check")
        assert parent.recv() == 5.0
    finally:
        _finish(p)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", METHODS)
def test_process_arguments_are_shared(method, size):
    """With fork nothing is pickled: this module's Process moves the arguments before it starts
    the child (an array fork copies is the child's own, as PyTorch's tensors are)."""
    ctx = dmp.get_context(method)
    q_out = ctx.Queue()
    a = dlbridge.zeros((SIZES[size],))
    a[1] = 2.0
    p = ctx.Process(target=_write_argument, args=(a, q_out))
    p.start()
    try:
        assert q_out.get(timeout=60) == 2.0
        assert q_out.get(timeout=60) == "written"
    finally:
        _finish(p)
    assert float(a[0]) == 9.0 and a.is_shared()


def test_the_module_level_process_shares_its_arguments():
    """``dmp.Process`` runs with the default start method (``fork`` on Linux before Python
    3.14)."""
    q_out = dmp.Queue()
    a = dlbridge.zeros((4,))
    p = dmp.Process(target=_write_argument, args=(a, q_out))
    p.start()
    assert q_out.get(timeout=60) == 0.0 and q_out.get(timeout=60) == "written"
    _finish(p)
    assert float(a[0]) == 9.0


@pytest.mark.parametrize("method", METHODS)
def test_pool_arguments_and_results_are_shared_both_ways(method):
    with dmp.get_context(method).Pool(1) as pool:
        args = [dlbridge.zeros((n,)) for n in (4, 1 << 16)]
        assert pool.map_async(_pool_task, [("write", a) for a in args]).get(60) == [None, None]
        assert [float(a[0]) for a in args] == [11.0, 11.0]
        result = pool.apply_async(_pool_task, (("make", 1 << 16),)).get(60)
        result[1] = 6.0
        assert pool.apply_async(_pool_task, (("read", None),)).get(60) == 6.0


def test_the_module_pool_of_the_default_start_method():
    with dmp.Pool(1) as pool:
        a = dlbridge.zeros((1 << 16,))
        pool.map_async(_pool_task, [("write", a)]).get(60)
    assert float(a[0]) == 11.0


def _torch_sees(q_in, q_out) -> None:
    a = q_in.get()
    a[3] = 4.0
    q_out.put("written")


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_torch_tensor_made_before_the_send_sees_the_childs_write(method):
    torch = pytest.importorskip("torch")
    a = dlbridge.zeros((1 << 16,))
    t = torch.from_dlpack(a)  # before the array moves
    ctx = dmp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_torch_sees, args=(q_in, q_out))
    p.start()
    q_in.put(a)
    assert q_out.get(timeout=60) == "written"
    _finish(p)
    assert t[3].item() == 4.0 and t.data_ptr() == a.data_ptr


def _torch_writer(q_in, q_out) -> None:
    import torch  # noqa: F401 (registers torch's reducers)

    t = q_in.get()
    t[3] = 4.0
    q_out.put("written")


@pytest.mark.parametrize("framework", ["torch", "dlbridge"])
def test_the_same_script_against_torch_and_dlbridge(framework):
    """The switch-over: one script, each library's multiprocessing; the parent sees the child's
    write either way."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
        import torch.multiprocessing as mp

        x = torch.zeros(1 << 16)
        body = _torch_writer
    else:
        mp = dmp
        x = dlbridge.zeros((1 << 16,))
        body = _torch_sees
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=body, args=(q_in, q_out))
    p.start()
    q_in.put(x)
    assert q_out.get(timeout=60) == "written"
    _finish(p)
    assert float(x[3]) == 4.0 and x.is_shared()


# ---------------------------------------------------------------------------------------------
# spawn / start_processes.


def _fill(i, a, fail_at=None) -> None:
    if i == fail_at:
        raise ValueError(f"process {i} was told to fail")
    a[i] = float(i + 1)


def _exit_with(i, code) -> None:
    if i == 0:
        sys.exit(code)


def _kill_self(i) -> None:
    import signal

    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0 if i == 0 else 120)


def _sleep_or_fail(i, pids) -> None:
    pids[i] = os.getpid()
    if i == 0:
        time.sleep(0.5)
        raise RuntimeError("failing while the other sleeps")
    time.sleep(120)


@pytest.mark.parametrize("start_method", METHODS)
def test_start_processes_runs_fn_of_i_and_args_and_shares_arrays(start_method):
    a = dlbridge.zeros((3,))
    assert dmp.start_processes(_fill, args=(a,), nprocs=3, start_method=start_method) is None
    assert a.tolist() == [1.0, 2.0, 3.0]


def test_spawn_raises_the_childs_exception_with_its_traceback():
    a = dlbridge.zeros((3,))
    with pytest.raises(dmp.ProcessRaisedException) as info:
        dmp.spawn(_fill, args=(a, 1), nprocs=3)
    e = info.value
    assert e.error_index == 1 and isinstance(e.error_pid, int)
    assert "-- Process 1 terminated with the following error:" in str(e)
    assert "Traceback (most recent call last)" in str(e)
    assert "ValueError: process 1 was told to fail" in str(e)
    assert isinstance(e, dmp.ProcessException) and isinstance(e, Exception)


def test_spawn_reports_an_exit_status_and_a_signal():
    with pytest.raises(dmp.ProcessExitedException) as info:
        dmp.spawn(_exit_with, args=(3,), nprocs=2)
    assert info.value.exit_code == 3 and info.value.error_index == 0
    assert "process 0 terminated with exit code 3" in str(info.value)
    with pytest.raises(dmp.ProcessExitedException) as info:
        dmp.spawn(_kill_self, nprocs=2)
    assert info.value.signal_name == "SIGKILL" and info.value.exit_code == -9
    assert info.value.error_index == 1


def test_join_false_returns_a_context_and_a_failure_stops_the_others():
    pids = dlbridge.zeros((2,), dtype="int64")
    ctx = dmp.spawn(_sleep_or_fail, args=(pids,), nprocs=2, join=False)
    assert isinstance(ctx, dmp.ProcessContext) and len(ctx.pids()) == 2
    assert ctx.join(timeout=0.01) is False  # both still run
    t0 = time.monotonic()
    with pytest.raises(dmp.ProcessRaisedException, match="failing while the other sleeps"):
        while not ctx.join(grace_period=1):
            pass
    assert time.monotonic() - t0 < 30
    assert pids.tolist() == ctx.pids()
    assert not any(p.is_alive() for p in ctx.processes)  # the sleeper was stopped


def test_join_false_then_join_until_done():
    a = dlbridge.zeros((2,))
    ctx = dmp.spawn(_fill, args=(a,), nprocs=2, join=False)
    while not ctx.join():
        pass
    assert ctx.join() is True and a.tolist() == [1.0, 2.0]


def test_spawn_with_another_start_method_warns_as_torch_does():
    a = dlbridge.zeros((1,))
    with pytest.warns(FutureWarning, match="start_processes"):
        dmp.spawn(_fill, args=(a,), nprocs=1, start_method="fork")
    assert a.tolist() == [1.0]


def test_spawn_failures_match_torch():
    """The same failing function under torch.multiprocessing.spawn and dlbridge's: the same
    exception types, indices and message forms."""
    tmp = pytest.importorskip("torch.multiprocessing")
    a = dlbridge.zeros((2,))
    results = []
    for mp in (tmp, dmp):
        with pytest.raises(Exception) as info:
            mp.spawn(_fill, args=(a, 1), nprocs=2)
        e = info.value
        text = str(e)
        results.append((
            type(e).__name__,
            e.error_index,
            text.splitlines()[2] if text.startswith("\n\n") else text,
            "ValueError: process 1 was told to fail" in text,
        ))
        with pytest.raises(Exception) as info:
            mp.spawn(_exit_with, args=(3,), nprocs=1)
        results.append((type(info.value).__name__, info.value.exit_code, str(info.value)))
    assert results[:2] == results[2:]


def test_sharing_strategies_are_torchs_names_and_change_nothing():
    assert dmp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert dmp.get_sharing_strategy() == "file_descriptor"
    try:
        dmp.set_sharing_strategy("file_system")
        assert dmp.get_sharing_strategy() == "file_system"
    finally:
        dmp.set_sharing_strategy("file_descriptor")
    with pytest.raises(ValueError, match="file_descriptor"):
        dmp.set_sharing_strategy("shm")
    torch_mp = pytest.importorskip("torch.multiprocessing")
    assert dmp.get_all_sharing_strategies() == torch_mp.get_all_sharing_strategies()


def test_the_standard_names_are_all_there():
    import multiprocessing

    missing = [n for n in multiprocessing.__all__ if not hasattr(dmp, n)]
    assert missing == []
    for name in ("spawn", "start_processes", "ProcessContext", "ProcessRaisedException",
                 "ProcessExitedException", "set_sharing_strategy", "get_sharing_strategy",
                 "get_all_sharing_strategies", "init_reductions"):
        assert hasattr(dmp, name), name
    assert dmp.Array is multiprocessing.Array  # the shared ctypes array, as in torch
    assert issubclass(dmp.Process, multiprocessing.Process)


# ---------------------------------------------------------------------------------------------
# The module's docstring example, as written.


def test_the_docstring_example_runs_as_written(tmp_path):
    doc = dmp.__doc__
    assert doc is not None
    block = re.search(r"::\n\n((?:    .*\n|\n)+)", doc)
    assert block is not None
    code = textwrap.dedent(block.group(1))
    assert "import dlbridge\n" in code and "is_shared()" in code and "a[0] = 42.0" in code
    script = tmp_path / "example.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a device; the GPU machine runs them).


def _cuda_both_ways(q_in, q_out) -> None:
    a = q_in.get()
    q_out.put(np.asarray(a.to("cpu")).tolist()[:2])
    a[...] = dlbridge.full(a.shape, 6.0, "float32", device=str(a.device))
    dlbridge.synchronize(a.device)
    q_out.put("written")


@needs_cuda
def test_cuda_memory_is_shared_as_it_is_as_torch_does():
    """share_memory_ is a no-op for CUDA memory (PyTorch's rule): an ordinary array is shareable
    without a copy, and the child's write is seen through the array and through a PyTorch tensor
    made before it was sent."""
    torch = pytest.importorskip("torch")
    a = dlbridge.zeros((1024,), dtype="float32", device="cuda:0")
    t = torch.from_dlpack(a)
    ptr = a.data_ptr
    assert a.is_shared() and a.share_memory_() is a and a.data_ptr == ptr
    assert torch.zeros(4, device="cuda").is_shared()
    ctx = dmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_cuda_both_ways, args=(q_in, q_out))
    p.start()
    a[...] = dlbridge.full(a.shape, 4.0, "float32", device="cuda:0")
    dlbridge.synchronize("cuda:0")
    q_in.put(a)
    assert q_out.get(timeout=120) == [4.0, 4.0]
    assert q_out.get(timeout=120) == "written"
    _finish(p)
    assert np.asarray(a.to("cpu")).tolist() == [6.0] * 1024
    assert t.cpu().tolist() == [6.0] * 1024 and a.data_ptr == ptr


@needs_cuda
def test_cuda_an_ordinary_array_through_a_queue_in_one_process():
    """A legacy IPC handle opened by the process that made it: the same memory, not an error."""
    a = dlbridge.asarray(np.arange(8, dtype=np.float32), device="cuda:0")
    q = dmp.get_context("spawn").Queue()
    q.put(a[2:6])
    b = q.get(timeout=60)
    assert b.data_ptr == a.data_ptr + 8
    b[...] = dlbridge.full((4,), -1.0, "float32", device="cuda:0")
    dlbridge.synchronize("cuda:0")
    assert np.asarray(a.to("cpu")).tolist() == [0, 1, -1, -1, -1, -1, 6, 7]


@needs_cuda
def test_cuda_pinned_memory_is_replaced_by_a_shared_copy():
    a = dlbridge.zeros((16,), dtype="float32", device="cuda_host:0")
    ptr = a.data_ptr
    assert not a.is_shared()
    a.share_memory_()
    assert a.is_shared() and a.data_ptr != ptr and str(a.device) == "cuda_host:0"
    h = a.share(copy=False)
    assert h.kind == "host_file"
