"""A producer and consumers sharing arrays through ``dlbridge.multiprocessing``, the way
``torch.multiprocessing`` shares tensors: writes are seen both ways, nothing is copied per message.

    python examples/multiprocessing_shared.py

The producer puts ordinary arrays on a queue. The first send moves each into process-shareable
memory in place (``Array.share_memory_()``): the producer's array, its views and a PyTorch tensor
made of it before keep their address and see what the consumers write. Each consumer sends an
array of its own back, which the producer writes and the consumer reads. Then ``mp.spawn`` runs
``fn(i, *args)`` in four processes writing one shared array. The CUDA part (an ordinary device
array, shared as PyTorch shares CUDA tensors: no copy, valid while the producer lives) says it
was skipped where there is no CUDA device.
"""

import time

import dlbridge
import dlbridge.multiprocessing as mp


def consumer(rank: int, jobs, replies) -> None:
    weights, results = jobs.get()  # the producer's memory, mapped here: no copy
    results[rank] = float(weights.sum())  # the producer sees this write
    mine = dlbridge.zeros((4,))
    replies.put((rank, mine))  # an array of this consumer's, for the producer to write
    assert jobs.get() == "written"
    assert float(mine[rank]) == 100.0 + rank  # the producer's write to it
    assert float(weights[0]) == -1.0  # the producer's write after the send


def fill(i: int, out) -> None:
    out[i] = float(i * i)


def cuda_consumer(jobs, replies) -> None:
    a = jobs.get()
    a[...] = dlbridge.full(a.shape, 3.0, "float32", device=str(a.device))
    dlbridge.synchronize(a.device)
    replies.put("written")


def main() -> None:
    ctx = mp.get_context("spawn")
    jobs, replies = ctx.Queue(), ctx.Queue()
    consumers = [ctx.Process(target=consumer, args=(r, jobs, replies)) for r in range(2)]
    for p in consumers:
        p.start()

    weights = dlbridge.full((1 << 16,), 1.0, "float32")  # 256 KiB: moved in place when first sent
    results = dlbridge.zeros((2,))  # 8 bytes: shares pages with others, moved by a copy
    address = weights.data_ptr
    try:
        import torch

        seen_by_torch = torch.from_dlpack(weights)  # made before the move
    except ImportError:
        seen_by_torch = None
    t0 = time.perf_counter()
    for _ in consumers:
        jobs.put((weights, results))
    theirs = dict(replies.get(timeout=60) for _ in consumers)
    weights[0] = -1.0  # every consumer sees this write
    for rank, a in theirs.items():
        a[rank] = 100.0 + rank  # and this one, in its own array
    for _ in consumers:
        jobs.put("written")
    for p in consumers:
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    elapsed = time.perf_counter() - t0
    assert results.tolist() == [float(1 << 16)] * 2, results.tolist()
    assert weights.is_shared() and results.is_shared() and weights.data_ptr == address
    if seen_by_torch is not None:
        assert seen_by_torch.data_ptr() == address and seen_by_torch[0].item() == -1.0
    print(f"cpu: 2 consumers summed 256 KiB of shared memory in {elapsed * 1e3:.0f} ms; "
          f"each saw the producer's writes and the producer saw theirs (storage mode "
          f"{weights.storage!r}, is_shared() {weights.is_shared()})")

    squares = dlbridge.zeros((4,))
    mp.spawn(fill, args=(squares,), nprocs=4)
    assert squares.tolist() == [0.0, 1.0, 4.0, 9.0]
    print(f"spawn: 4 processes wrote {squares.tolist()}")

    if dlbridge.cuda.is_available():
        a = dlbridge.zeros((1024,), device="cuda:0")  # ordinary device memory
        p = ctx.Process(target=cuda_consumer, args=(jobs, replies))
        p.start()
        jobs.put(a)
        assert replies.get(timeout=120) == "written"
        p.join(60)
        assert a.to("cpu").tolist() == [3.0] * 1024 and a.is_shared()
        print("cuda:0: the consumer's write to an ordinary device array is seen here")
    else:
        print(f"cuda: skipped, no CUDA device: {dlbridge.cuda.unavailable_reason()}")
    print("multiprocessing_shared: ok")


if __name__ == "__main__":
    main()
