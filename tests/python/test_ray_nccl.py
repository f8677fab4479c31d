"""The dlbridge_nccl transport of `dlbridge.ray`: CUDA arrays copied between two actors' GPUs over
NCCL, on Ray's own local cluster.

The transfers need two CUDA devices (one per actor: NCCL refuses two ranks on one GPU) and run on
a machine of several GPUs; elsewhere they are skipped with that reason. The checks that need no
GPU run everywhere. (A module of its own: its cluster has every GPU of the machine, where
`test_ray.py`'s has one, shared by fractional actors.)
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dlbridge
import dlbridge.nccl as nccl

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'dlbridge[ray]')")
import dlbridge.ray as dray  # noqa: E402

gpus = dlbridge.cuda.device_count() if dlbridge.cuda.is_available() else 0
needs_two_gpus = pytest.mark.skipif(
    gpus < 2 or not nccl.is_available(),
    reason=f"needs two CUDA devices and NCCL (this machine: {gpus} GPU(s))",
)


@pytest.fixture(scope="module")
def cluster():
    dray.register()
    ray.init(
        num_cpus=4,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
    )
    yield
    ray.shutdown()


def _expected(n_small: int) -> list[np.ndarray]:
    big = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    out = [big, big[::2, 1::3], big[5], np.array(7, dtype=np.int64), np.zeros((0, 3), np.float16)]
    out += [np.full(256, i, dtype=np.int32) for i in range(n_small)]
    return out


@ray.remote(num_gpus=1, enable_tensor_transport=True)
class Producer:
    def device(self) -> str:
        return str(dlbridge.Device("cuda:0"))

    @ray.method(tensor_transport="dlbridge_nccl")
    def arrays(self, n_small: int):
        big = dlbridge.asarray(_expected(0)[0], device="cuda")
        rest = [dlbridge.asarray(e, device="cuda") for e in _expected(n_small)[3:]]
        return [big, big[::2, 1::3], big[5], *rest]

    @ray.method(tensor_transport="dlbridge_nccl")
    def host_array(self):
        return [dlbridge.zeros((4,), device="cpu")]


@ray.remote(num_gpus=1, enable_tensor_transport=True)
class Consumer:
    def check(self, arrays, n_small: int):
        import torch

        expected = _expected(n_small)
        assert len(arrays) == len(expected)
        for a, e in zip(arrays, expected):
            assert isinstance(a, dlbridge.Array)
            assert a.device.type == "cuda"
            assert a.shape == e.shape and str(a.dtype) == str(e.dtype)
            np.testing.assert_array_equal(np.from_dlpack(a.to("cpu")), e)
        # The arrays are this actor's own GPU memory, and go to PyTorch without a copy.
        t = torch.from_dlpack(arrays[0])
        assert t.data_ptr() == arrays[0].data_ptr
        t[0, 0] = -1.0
        torch.cuda.synchronize()
        assert float(np.from_dlpack(arrays[0].to("cpu"))[0, 0]) == -1.0
        return str(ray.get_gpu_ids())


@pytest.fixture(scope="module")
def pair(cluster):
    """One producer and one consumer, a GPU each, in one NCCL group (the machine's two GPUs serve
    one pair at a time: the tests share it)."""
    p, c = Producer.remote(), Consumer.remote()
    group = dray.create_nccl_group([p, c])
    yield p, c, group
    try:
        dray.destroy_nccl_group(group)
    except ValueError:
        pass  # a test destroyed it
    ray.kill(p)
    ray.kill(c)


@needs_two_gpus
def test_arrays_move_between_two_gpus_over_nccl(pair):
    p, c, _ = pair
    for n_small in (0, 1000):
        gpu_of_consumer = ray.get(c.check.remote(p.arrays.remote(n_small), n_small))
    assert gpu_of_consumer != ray.get(p.__ray_call__.remote(lambda self: str(ray.get_gpu_ids())))


@needs_two_gpus
def test_host_arrays_are_refused_by_the_nccl_transport(pair):
    p, c, _ = pair
    with pytest.raises(Exception, match="CUDA device memory"):
        ray.get(c.check.remote(p.host_array.remote(), 0), timeout=120)


@needs_two_gpus
def test_actors_outside_a_group_are_told_to_make_one(pair):
    p, c, group = pair
    dray.destroy_nccl_group(group)
    with pytest.raises(Exception, match="create_nccl_group"):
        ray.get(c.check.remote(p.arrays.remote(0), 0), timeout=120)


def test_group_arguments_are_checked(cluster):
    @ray.remote
    class A:
        pass

    a = A.remote()
    with pytest.raises(ValueError, match="at least two"):
        dray.create_nccl_group([a])
    with pytest.raises(ValueError, match="different actor"):
        dray.create_nccl_group([a, a])
    with pytest.raises(ValueError, match="no NCCL group"):
        dray.destroy_nccl_group("never-made")


def test_the_nccl_transport_is_registered_by_name(cluster):
    assert dray.NCCL_TRANSPORT == "DLBRIDGE_NCCL"
    from ray.experimental.rdt.util import transport_manager_info

    info = transport_manager_info["DLBRIDGE_NCCL"]
    assert info.transport_manager_class is dray.DlbridgeNcclTransport


def test_the_nccl_transport_refuses_what_it_cannot_carry():
    t = dray.DlbridgeNcclTransport()
    with pytest.raises(TypeError, match="dlbridge.Array"):
        t.extract_tensor_transport_metadata("x", [np.zeros(3)])
    with pytest.raises(ValueError, match="CUDA device memory"):
        t.extract_tensor_transport_metadata("x", [dlbridge.zeros((3,), device="cpu")])
    # Without a common group the owner's metadata carries the reason, which both sides raise.
    no_group = dray.DlbridgeNcclCommunicatorMetadata(error="no group here")
    meta = dray.DlbridgeNcclMetadata(
        tensor_meta=[((64,), "uint8")],
        tensor_device="cuda",
        runs=[(64, 0)],
        views=[(0, "uint8", [64], [1], 0, False)],
    )
    with pytest.raises(ValueError, match="no group here"):
        t.send_multiple_tensors([], meta, no_group)
    with pytest.raises(ValueError, match="no group here"):
        t.recv_multiple_tensors("x", meta, no_group)
    with pytest.raises(ValueError, match="buffers"):
        t.recv_multiple_tensors("x", meta, no_group, target_buffers=[object()])
    assert t.is_one_sided() is False and t.can_abort_transport() is True


def test_an_abort_reaches_only_its_own_object():
    t = dray.DlbridgeNcclTransport()
    meta = dray.DlbridgeNcclCommunicatorMetadata(group="not-here")

    class Comm:
        interrupted = 0

        def interrupt(self):
            self.interrupted += 1

    comm = Comm()
    # Aborted before its transfer began here: that transfer is refused, others run.
    t.abort_transport("a", meta)
    with pytest.raises(RuntimeError, match="aborted"):
        t._transfer("a", comm, lambda: "sent")
    assert t._transfer("b", comm, lambda: "sent") == "sent"
    # Aborted while another object's transfer waits: that one is not interrupted.
    seen = []

    def waiting():
        with dray._groups_lock:
            dray._communicators["g"] = comm
        try:
            t.abort_transport("c", dray.DlbridgeNcclCommunicatorMetadata(group="g"))
            seen.append(comm.interrupted)
            t.abort_transport("d", dray.DlbridgeNcclCommunicatorMetadata(group="g"))
            seen.append(comm.interrupted)
        finally:
            with dray._groups_lock:
                dray._communicators.pop("g")

    t._transfer("d", comm, waiting)
    assert seen == [0, 1]
    with pytest.raises(RuntimeError, match="aborted"):
        t._transfer("c", comm, lambda: "sent")
