"""NCCL point-to-point transfers of dlbridge arrays (`dlbridge.nccl`).

The transfers need two CUDA devices and NCCL (two processes, one GPU each: NCCL refuses two ranks
on one GPU) and run on a machine of several GPUs; the plan of runs needs one GPU; the checks of
bad input run everywhere.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

import dlbridge
import dlbridge.nccl as nccl

cuda = dlbridge.cuda.is_available()
gpus = dlbridge.cuda.device_count() if cuda else 0
needs_cuda = pytest.mark.skipif(not cuda, reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(
    gpus < 2 or not nccl.is_available(),
    reason=f"needs two CUDA devices and NCCL (this machine: {gpus} GPU(s), NCCL "
    f"{'found' if nccl.is_available() else 'not found'})",
)

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "uint64", "float16", "bfloat16",
          "float32", "float64", "complex64"]


def _host(dtype: str, shape, seed: int) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "bool":
        return ((np.arange(n) + seed) % 3 == 0).reshape(shape)
    if dtype == "bfloat16":
        import ml_dtypes

        return ((np.arange(n) + seed) % 101).astype(ml_dtypes.bfloat16).reshape(shape)
    v = ((np.arange(n) + seed) % 101).astype(dtype)
    if dtype.startswith("complex"):
        v = v + 1j * v[::-1]
    return v.reshape(shape)


def _arrays(device: str) -> "tuple[list, list[np.ndarray]]":
    """The arrays rank 0 sends and what rank 1 must receive: every dtype, views with strides and
    negative steps, 0-d, empty, views that share bytes, and 1,000 small arrays."""
    arrays, expected = [], []
    for i, dtype in enumerate(DTYPES):
        h = _host(dtype, (4, 6), i)
        arrays.append(dlbridge.asarray(h, device=device))
        expected.append(h)
    base_h = _host("float32", (8, 8), 7)
    base = dlbridge.asarray(base_h, device=device)
    views = [
        (base[:, 2], base_h[:, 2]),
        (base[::-1, ::2], base_h[::-1, ::2]),
        (base[3], base_h[3]),
        (base[2:4], base_h[2:4]),  # overlaps base[3]
        (base[2:2], base_h[2:2]),
        (base.T, base_h.T),
    ]
    for a, h in views:
        arrays.append(a)
        expected.append(h)
    zero_d = np.array(3.5, dtype="float64")
    arrays.append(dlbridge.asarray(zero_d, device=device))
    expected.append(zero_d)
    for i in range(1000):
        h = np.full(16, i, dtype="int32")
        arrays.append(dlbridge.asarray(h, device=device))
        expected.append(h)
    return arrays, expected


def _to_host(a) -> np.ndarray:
    return np.asarray(a.to("cpu"))  # NumPy's DLPack import has no bfloat16


def _rank(rank: int, uid: bytes, q, mode: str) -> None:
    """One rank's process: rank 0 sends, rank 1 receives and checks."""
    try:
        comm = nccl.Communicator(uid, 2, rank, device=rank)
        if mode == "transfer":
            if rank == 0:
                arrays, _ = _arrays("cuda:0")
                runs, views = comm.plan(arrays)
                q.put(("plan", runs, views))
                comm.send(arrays, peer=1, runs=runs, timeout=60)
                q.put(("sent", len(runs)))
            else:
                runs, views = q.get(timeout=60)
                got = comm.recv(runs, views, peer=0, timeout=60)
                _, expected = _arrays("cpu")
                assert len(got) == len(expected)
                for g, e in zip(got, expected):
                    assert g.device == dlbridge.Device("cuda:1"), g.device
                    assert g.shape == e.shape and str(g.dtype) == str(e.dtype), (g, e.dtype)
                    np.testing.assert_array_equal(_to_host(g), e)
                # Views that shared bytes on the sender share them here: base[3] is row 1 of
                # base[2:4], 8 float32 further on.
                row3, rows23 = got[len(DTYPES) + 2], got[len(DTYPES) + 3]
                # One block for everything: every array lies in it.
                ptrs = [g.data_ptr for g in got if g.size]
                q.put(("received", len(got), row3.data_ptr, rows23.data_ptr + 8 * 4,
                       max(ptrs) - min(ptrs)))
        elif mode == "timeout":
            if rank == 1:
                try:
                    comm.recv([(64, 0)], [(0, "uint8", [64], [1], 0, False)], peer=0, timeout=2)
                except RuntimeError as e:
                    q.put(("error", str(e), comm.aborted))
                else:
                    q.put(("no error",))
            else:
                q.put(("idle",))  # rank 0 never sends, and stays until rank 1 has given up
                time.sleep(8)
    except BaseException:
        q.put(("failed", rank, traceback.format_exc()))


def _run_pair(mode: str) -> list:
    ctx = mp.get_context("spawn")
    uid = nccl.unique_id()  # this process serves the bootstrap while the ranks join
    q0, q1 = ctx.Queue(), ctx.Queue()
    p0 = ctx.Process(target=_rank, args=(0, uid, q0, mode))
    p1 = ctx.Process(target=_rank, args=(1, uid, q1, mode))
    p0.start()
    p1.start()
    out = []
    try:
        if mode == "transfer":
            first = q0.get(timeout=90)
            assert first[0] == "plan", first
            q1.put((first[1], first[2]))
            out.append(("plan", first[1], first[2]))
            out.append(q0.get(timeout=90))
            out.append(q1.get(timeout=90))
        else:
            out.append(q0.get(timeout=90))
            out.append(q1.get(timeout=90))
    finally:
        for p in (p0, p1):
            p.join(60)
            if p.is_alive():
                p.kill()
    for item in out:
        assert item[0] != "failed", item[2]
    return out


@needs_two_gpus
def test_arrays_of_every_kind_arrive_equal_on_the_other_gpu_in_one_block():
    (_, runs, views), sent, received = _run_pair("transfer")
    assert sent[0] == "sent"
    # The views of one matrix travel as one run.
    matrix_runs = {views[len(DTYPES) + k][0] for k in (0, 1, 2, 3, 5)}
    assert len(matrix_runs) == 1, matrix_runs
    assert views[len(DTYPES) + 4][0] == -1  # the empty view needs no bytes
    _, count, row3_ptr, expected_ptr, spread = received
    assert count == len(DTYPES) + 6 + 1 + 1000
    assert row3_ptr == expected_ptr  # the overlapping views still overlap
    total = sum(length for length, _ in runs)
    assert spread < total + 256 * len(runs)  # one block


@needs_two_gpus
def test_a_peer_that_never_sends_times_out_and_aborts_the_communicator():
    _, received = _run_pair("timeout")
    assert received[0] == "error", received
    assert "did not finish" in received[1]
    assert received[2] is True  # aborted


needs_nccl_and_cuda = pytest.mark.skipif(
    not cuda or not nccl.is_available(),
    reason=f"needs a CUDA device and NCCL (CUDA {'found' if cuda else 'not found'}, NCCL "
    f"{'found' if nccl.is_available() else 'not found'})",
)


@needs_nccl_and_cuda
def test_a_rank_that_never_joins_ends_the_join_by_its_timeout():
    import time

    if nccl.version() < (2, 14, 0):
        pytest.skip(f"NCCL {nccl.version()} joins blocking (non-blocking joins need 2.14)")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within 2.0 s"):
        nccl.Communicator(nccl.unique_id(), 2, 0, device=0, timeout=2.0)
    assert time.monotonic() - began < 30
    # The half-made communicator was aborted; a later join of a whole group still works.
    uid = nccl.unique_id()
    comm = nccl.Communicator(uid, 1, 0, device=0, timeout=30.0)
    assert comm.size == 1 and not comm.aborted


@needs_cuda
def test_a_thousand_small_arrays_of_the_pool_plan_as_few_runs():
    arrays = [dlbridge.full((1024,), float(i), dtype="float32", device="cuda") for i in range(1000)]
    runs, views = nccl.plan(arrays)
    assert len(views) == 1000
    assert len(runs) <= 10, len(runs)
    assert sum(length for length, _ in runs) >= 1000 * 4096
    # Every view lies inside the run it names.
    for (run, dtype, shape, strides, offset, read_only) in views:
        assert dtype == "float32" and shape == [1024] and strides == [1] and not read_only
        assert 0 <= offset and offset + 4096 <= runs[run][0]


def test_arrays_off_the_gpu_are_refused_by_the_plan():
    with pytest.raises(ValueError, match="CUDA device memory"):
        nccl.plan([dlbridge.zeros((4,), device="cpu")])


def test_bad_communicator_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.Communicator(b"short", 2, 0)
    with pytest.raises(ValueError, match="not a rank"):
        nccl.Communicator(bytes(128), 2, 2)
    with pytest.raises(ValueError, match="CUDA devices"):
        nccl.Communicator(bytes(128), 2, 0, device="cpu")


def test_without_nccl_the_error_says_how_to_get_it():
    # In a fresh process, so that no NCCL is loaded yet.
    code = (
        "import dlbridge.nccl as n\n"
        "assert not n.is_available()\n"
        "try:\n"
        "    n.unique_id()\n"
        "except RuntimeError as e:\n"
        "    assert 'libnccl' in str(e) and 'DLBRIDGE_NCCL_LIBRARY' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = dict(os.environ, DLBRIDGE_NCCL_LIBRARY="/nonexistent/libnccl.so.2")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_timeout_setting_is_checked(monkeypatch):
    monkeypatch.setenv("DLBRIDGE_NCCL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DLBRIDGE_NCCL_TIMEOUT"):
        nccl._timeout()
    monkeypatch.setenv("DLBRIDGE_NCCL_TIMEOUT", "0")
    assert nccl._timeout() is None
    monkeypatch.setenv("DLBRIDGE_NCCL_TIMEOUT", "12.5")
    assert nccl._timeout() == 12.5
    for bad in ("-1", "inf", "nan"):
        monkeypatch.setenv("DLBRIDGE_NCCL_TIMEOUT", bad)
        with pytest.raises(ValueError, match="positive"):
            nccl._timeout()
