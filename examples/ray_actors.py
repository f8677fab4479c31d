"""Ray actors passing arrays through the `dlbridge` tensor transport, without copies.

    python examples/ray_actors.py        (needs Ray: pip install '.[ray]')

A producer actor returns arrays of any framework from a method marked
`@ray.method(tensor_transport="dlbridge")`; a consumer actor on the same node receives them as
`dlbridge.Array`s over the producer's own memory and hands them to PyTorch without a copy. A
write on either side is seen on the other. With a CUDA device, the same with GPU memory (the
two actors share the GPU). Without Ray, prints that it was skipped.
"""

import sys

import numpy as np

import dlbridge

try:
    import ray
except ImportError:
    print("ray_actors: skipped, Ray is not installed (pip install '.[ray]')")
    sys.exit(0)

import dlbridge.ray  # registers the "dlbridge" transport (before the actors are defined)


@ray.remote(enable_tensor_transport=True)
class Producer:
    def __init__(self, device: str):
        self.device = device
        # Kept in process-shareable memory, so that every send is this same memory.
        self.weights = dlbridge.zeros((1024,), device=device).to_shareable()

    @ray.method(tensor_transport="dlbridge")
    def layers(self):
        # Any framework's arrays: arrays not in shareable memory are packed into one block.
        return [dlbridge.asarray(np.full(256, i, dtype=np.float32), device=self.device)
                for i in range(100)]

    @ray.method(tensor_transport="dlbridge")
    def shared(self):
        return self.weights

    def read(self, i: int) -> float:
        dlbridge.synchronize(self.device)
        return float(self.weights[i].to("cpu").item())


@ray.remote(enable_tensor_transport=True)
class Consumer:
    def total(self, arrays) -> float:
        import torch

        return float(sum(torch.from_dlpack(a).sum() for a in arrays))  # no copies

    def write(self, array, i: int, value: float) -> None:
        import torch

        torch.from_dlpack(array)[i] = value  # the producer's memory
        dlbridge.synchronize(array.device)


def run(device: str, share_of_gpu: float) -> None:
    options = {"num_gpus": share_of_gpu} if share_of_gpu else {}
    p = Producer.options(**options).remote(device)
    c = Consumer.options(**options).remote()
    total = ray.get(c.total.remote(p.layers.remote()))
    assert total == 256.0 * sum(range(100)), total
    ray.get(c.write.remote(p.shared.remote(), 7, 42.0))
    assert ray.get(p.read.remote(7)) == 42.0
    print(f"{device}: 100 arrays summed by the consumer; its write seen by the producer")


def main() -> None:
    gpus = 1 if dlbridge.cuda.is_available() else 0
    ray.init(num_cpus=2, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    try:
        run("cpu", 0)
        if gpus:
            run("cuda:0", 0.5)
        else:
            print(f"cuda: skipped, no CUDA device: {dlbridge.cuda.unavailable_reason()}")
    finally:
        ray.shutdown()
    print("ray_actors: ok")


if __name__ == "__main__":
    main()
