"""Bad input and hostile conditions: impossible sizes, tensor states DLPack cannot express, fork(),
looping exchange tables, wrapped addresses. Each case ends in a clear Python exception or a
correct result, never an abort, a hang, a panic or wrong data.

Sizes here are *impossible*: at least 4 TiB, which no machine this suite runs on can allocate, so
a ``MemoryError`` is the only right answer (and an abort is what an infallible allocation gives).
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dlbridge
from dlbridge import ops

from conftest import make_capsule

# 2**40 float32 elements: 4 TiB.
HUGE = 2**40


def huge_view(dtype=dlbridge.float32, shape=(HUGE,), device="cpu"):
    """A zero-copy view with ``shape`` over one element: any copy of it is impossible."""
    one = dlbridge.zeros(1, dtype=dtype, device=device)
    return one.reshape(*([1] * len(shape))).broadcast_to(list(shape))


# ---------------------------------------------------------------------------------------------
# Impossible sizes: every creation function, op and copy path gives MemoryError.


@pytest.mark.parametrize(
    "make",
    [
        lambda: dlbridge.arange(2**42),
        lambda: dlbridge.arange(0.0, 2.0**50, 1.0),
        lambda: dlbridge.arange(0, 2**42, 1, dtype=dlbridge.int8),
        lambda: dlbridge.arange(2**42, 0, -1),
        lambda: dlbridge.empty(HUGE),
        lambda: dlbridge.zeros(HUGE),
        lambda: dlbridge.full(HUGE, 1.5),
        lambda: dlbridge.empty((2**21, 2**21)),
        lambda: dlbridge.Backend("cpu").allocate((HUGE,)),
        lambda: dlbridge.Backend("cpu").allocate_zeros((HUGE,)),
        lambda: dlbridge.UnifiedBuffer((HUGE,)),
    ],
    ids=[
        "arange-int",
        "arange-float",
        "arange-int8",
        "arange-down",
        "empty",
        "zeros",
        "full",
        "empty-2d",
        "Backend.allocate",
        "Backend.allocate_zeros",
        "UnifiedBuffer",
    ],
)
def test_creation_of_an_impossible_size_is_a_memory_error(make):
    with pytest.raises(MemoryError, match=r"\d{13,}|cannot allocate"):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: dlbridge.arange(2**62),
        lambda: dlbridge.arange(0, 2**62, 1),
        lambda: dlbridge.arange(0.0, 1e300, 1e-300),
        lambda: dlbridge.arange(-(2**100), 2**100),
    ],
    ids=["arange-2**62", "arange-2**62-step", "arange-float-huge", "arange-2**101"],
)
def test_arange_beyond_the_address_space_is_a_clear_error(make):
    # Byte counts that overflow the address space: the same error `empty` gives for such sizes
    # (no PanicException, which is a BaseException, and no abort).
    with pytest.raises((MemoryError, ValueError)) as err:
        make()
    assert "panic" not in str(err.value).lower()


def test_empty_and_arange_agree_on_sizes_beyond_the_address_space():
    with pytest.raises(Exception) as empty_err:
        dlbridge.empty(2**62, dtype=dlbridge.int64)
    with pytest.raises(Exception) as arange_err:
        dlbridge.arange(2**62)
    assert type(empty_err.value) is type(arange_err.value)
    assert isinstance(arange_err.value, (MemoryError, ValueError))


def test_arange_still_builds_ordinary_ranges():
    assert dlbridge.arange(5).tolist() == [0, 1, 2, 3, 4]
    assert dlbridge.arange(10, 0, -3).tolist() == [10, 7, 4, 1]
    assert dlbridge.arange(0, 1, 0.25).tolist() == [0.0, 0.25, 0.5, 0.75]
    assert dlbridge.arange(3, dtype=dlbridge.float64).tolist() == [0.0, 1.0, 2.0]
    assert dlbridge.arange(-(2**63), -(2**63) + 2).tolist() == [-(2**63), -(2**63) + 1]
    assert dlbridge.arange(5, 5).tolist() == []
    assert dlbridge.arange(5, 0).tolist() == []
    with pytest.raises(OverflowError):
        dlbridge.arange(250, 260, dtype=dlbridge.uint8)
    with pytest.raises(ValueError, match="zero"):
        dlbridge.arange(0, 5, 0)


@pytest.mark.parametrize(
    "copy",
    [
        lambda x: x.copy(),
        lambda x: x.astype(dlbridge.float64),
        lambda x: x.to("cpu", copy=True),
        lambda x: x.tolist(),
        lambda x: dlbridge.asarray(x, copy=True),
        lambda x: dlbridge.asarray(x, dtype=dlbridge.int32),
        lambda x: dlbridge.from_dlpack(x, copy=True),
        lambda x: dlbridge.Backend("cpu").copy_to_device(x),
        lambda x: ops.add(x, 1),
        lambda x: ops.add(x, x),
        lambda x: x * 2.0,
        lambda x: -x,
        lambda x: ops.sqrt(x),
        lambda x: ops.exp(x),
        lambda x: x.reshape(2**20, 2**20) @ huge_view(shape=(2**20, 2**20)),
        lambda x: ops.matmul(huge_view(dlbridge.bfloat16, (2**20, 2**20)), huge_view(dlbridge.bfloat16, (2**20, 4))),
        lambda x: huge_view(shape=(HUGE, 1)).sum(axis=1),
    ],
    ids=[
        "copy",
        "astype",
        "to-copy",
        "tolist",
        "asarray-copy",
        "asarray-dtype",
        "from_dlpack-copy",
        "Backend.copy_to_device",
        "add-scalar",
        "add",
        "mul-operator",
        "neg",
        "sqrt",
        "exp",
        "matmul",
        "matmul-bf16-widened",
        "sum-keeping-an-impossible-axis",
    ],
)
def test_ops_and_copies_of_an_impossible_size_are_memory_errors(copy):
    x = huge_view()
    with pytest.raises(MemoryError):
        copy(x)


def test_memory_errors_name_the_size_and_the_device():
    with pytest.raises(MemoryError) as err:
        dlbridge.empty(HUGE)
    assert str(HUGE * 4) in str(err.value)
    assert "cpu" in str(err.value)


def test_nothing_is_left_allocated_after_memory_errors():
    gc.collect()
    before = dlbridge.memory_stats("cpu")["active_bytes"]
    for make in (
        lambda: dlbridge.arange(2**42),
        lambda: huge_view().copy(),
        lambda: ops.add(huge_view(), 1),
    ):
        with pytest.raises(MemoryError):
            make()
    gc.collect()
    assert dlbridge.memory_stats("cpu")["active_bytes"] == before


# ---------------------------------------------------------------------------------------------
# Tensor states DLPack cannot express: one BufferError on every import path.


def _torch():
    return pytest.importorskip("torch")


def _torch_states():
    torch = _torch()
    base = torch.tensor([1.0, 2.0, 3.0])
    states = {
        "requires_grad": torch.zeros(3, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.zeros(3)),
        "neg_view": torch._neg_view(base),
        "conj_view": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        # A real tensor with the negative bit, from a complex conjugate's imaginary part: PyTorch's
        # exchange table hands it out; the check after the table's export must catch it.
        "imag_of_conj": torch.tensor([1 + 2j, 3 - 1j]).conj().imag.detach(),
        "sparse_coo": torch.eye(3).to_sparse(),
        "sparse_csr": torch.eye(3).to_sparse_csr(),
        "meta": torch.empty(3, device="meta"),
        "quantized": torch.quantize_per_tensor(base, 0.1, 0, torch.quint8),
        "zerotensor": torch._efficientzerotensor(3),
    }
    return states


STATES = [
    "requires_grad",
    "parameter",
    "neg_view",
    "conj_view",
    "imag_of_conj",
    "sparse_coo",
    "sparse_csr",
    "meta",
    "quantized",
    "zerotensor",
]


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize(
    "path",
    [
        lambda x: dlbridge.from_dlpack(x),
        lambda x: dlbridge.from_dlpack(x, copy=True),
        lambda x: dlbridge.from_dlpack(x, device="cpu"),
        lambda x: dlbridge.asarray(x),
        lambda x: dlbridge.asarray(x, dtype=dlbridge.float64),
        lambda x: ops.add(x, 1),
    ],
    ids=["from_dlpack", "from_dlpack-copy", "from_dlpack-device", "asarray", "asarray-dtype", "ops"],
)
def test_inexpressible_torch_states_are_refused_on_every_path(state, path):
    x = _torch_states()[state]
    with pytest.raises(BufferError) as err:
        path(x)
    assert "through DLPack" in str(err.value) or "DLPack" in str(err.value)


def test_a_tensor_that_requires_grad_is_not_written_behind_autograds_back():
    torch = _torch()
    t = torch.zeros(10, requires_grad=True)
    with pytest.raises(BufferError, match="requires grad"):
        dlbridge.from_dlpack(t)
    assert t.tolist() == [0.0] * 10
    # The documented way out works, and shares memory.
    a = dlbridge.from_dlpack(t.detach())
    a[0] = 5
    assert t[0].item() == 5.0


def test_a_negative_view_is_refused_not_imported_with_wrong_values():
    torch = _torch()
    neg = torch._neg_view(torch.tensor([1.0, 2.0]))
    assert neg.tolist() == [-1.0, -2.0]
    with pytest.raises(BufferError, match="negative bit"):
        dlbridge.from_dlpack(neg)
    assert dlbridge.from_dlpack(neg.resolve_neg()).tolist() == [-1.0, -2.0]


def test_a_refused_export_goes_back_to_its_producer():
    # The table exports before the tensor's states are asked (the element type decides which):
    # a refused export is released at once, holding none of the storage.
    torch = _torch()
    neg = torch._neg_view(torch.tensor([1.0, 2.0]))
    uses = neg._use_count()  # references to the tensor's C++ object; an export holds one
    for _ in range(3):
        with pytest.raises(BufferError, match="negative bit"):
            dlbridge.from_dlpack(neg)
    assert neg._use_count() == uses
    held = dlbridge.from_dlpack(neg.resolve_neg())  # another tensor: `neg` is not held
    assert neg._use_count() == uses
    plain = torch.ones(2)
    held = dlbridge.from_dlpack(plain)
    assert plain._use_count() == 2  # the export this array holds, until it goes
    del held
    assert plain._use_count() == 1


def test_plain_tensors_still_import_zero_copy():
    torch = _torch()
    t = torch.arange(6, dtype=torch.float32)
    a = dlbridge.from_dlpack(t)
    assert a.data_ptr == t.data_ptr()
    a[1] = 42
    assert t[1].item() == 42.0
    # no_grad results and detached views are fine too.
    with torch.no_grad():
        u = torch.ones(3, requires_grad=True) * 2
    assert dlbridge.from_dlpack(u).tolist() == [2.0, 2.0, 2.0]


# ---------------------------------------------------------------------------------------------
# fork()


def _child_parallel_sum(queue):
    a = dlbridge.arange(1 << 22, dtype=dlbridge.float64)
    queue.put(float(a.sum()) == float((1 << 22) * ((1 << 22) - 1) // 2))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_a_forked_child_runs_parallel_ops_after_the_parent_did():
    # The parent runs parallel work first, so its worker threads exist before the fork.
    a = dlbridge.arange(1 << 22, dtype=dlbridge.float64)
    assert float((a * 2.0).sum()) == float((1 << 22) * ((1 << 22) - 1))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_parallel_sum, args=(queue,))
    proc.start()
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail("the forked child hung in a parallel op")
    assert proc.exitcode == 0
    assert queue.get(timeout=5) is True


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_a_forked_child_gets_a_clear_cuda_error_not_a_hang():
    if not dlbridge.cuda.is_available():
        pytest.skip("needs a CUDA device (the parent must initialise CUDA before forking)")
    script = textwrap.dedent(
        """
        import os, sys, dlbridge
        x = dlbridge.zeros(4, device="cuda")      # the parent initialises CUDA
        pid = os.fork()
        if pid == 0:
            try:
                dlbridge.zeros(4, device="cuda")
            except RuntimeError as e:
                ok = "fork" in str(e) and "spawn" in str(e)
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
            os._exit(5)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == 0


# ---------------------------------------------------------------------------------------------
# Foreign links and counts are bounded; addresses are checked.


def _exchange_table_type(chain_loops: bool):
    """A type whose ``__dlpack_c_exchange_api__`` is a chain of version-0 headers; looping back to
    itself when ``chain_loops``."""

    class Header(ctypes.Structure):
        pass

    Header._fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev", ctypes.POINTER(Header))]
    a, b = Header(0, 1), Header(0, 0)
    a.prev = ctypes.pointer(b)
    b.prev = ctypes.pointer(a) if chain_loops else ctypes.POINTER(Header)()
    PyCapsule_New = ctypes.pythonapi.PyCapsule_New
    PyCapsule_New.restype = ctypes.py_object
    PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = PyCapsule_New(ctypes.addressof(a), b"dlpack_exchange_api", None)
    host = np.arange(3, dtype=np.float32)

    class Producer:
        __dlpack_c_exchange_api__ = capsule
        _keep = (a, b, host)

        def __dlpack__(self, **kwargs):
            return host.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return host.__dlpack_device__()

    return Producer


@pytest.mark.parametrize("loops", [True, False], ids=["looping-chain", "ending-chain"])
def test_an_exchange_table_chain_is_followed_a_bounded_number_of_links(loops):
    # Before the fix a looping chain made from_dlpack spin forever; run it in a child with a
    # timeout so a regression fails instead of hanging the suite.
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_reliability import _exchange_table_type
        import dlbridge
        a = dlbridge.from_dlpack(_exchange_table_type({loops})())
        assert a.tolist() == [0.0, 1.0, 2.0], a.tolist()
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_cpu_device_index_other_than_zero_is_refused_on_export():
    a = dlbridge.arange(3)
    with pytest.raises(ValueError, match="device 0"):
        a.__dlpack__(dl_device=(1, 1))
    # (1, 0) is the CPU itself: a plain export.
    assert dlbridge.from_dlpack(a.__dlpack__(dl_device=(1, 0))).tolist() == [0, 1, 2]


@pytest.mark.parametrize("byte_offset", [2**63 - 1, 2**63 - 4096])
def test_a_descriptor_reaching_past_user_space_is_refused(byte_offset):
    host = np.zeros(4, dtype=np.float32)
    # `data` is a real address; `data + byte_offset` lies in the kernel's half of the address
    # space (or wraps), where no user-space pointer can be.
    hand = make_capsule(host, byte_offset=byte_offset, data=host.ctypes.data)
    with pytest.raises((BufferError, ValueError), match="address space"):
        dlbridge.from_dlpack(hand.capsule)
    gc.collect()
    assert hand.deleted == 1
