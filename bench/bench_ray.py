"""dlbridge arrays on Ray beside Ray's own paths, in one run on Ray's local cluster.

1. **Object store, CPU**: ``ray.put`` + ``ray.get`` of a large array (1 GiB by default) for a
   dlbridge array, a NumPy array (Ray's zero-copy path) and a PyTorch CPU tensor; and the same
   array as a task argument (the worker reads one element and answers).
2. **Between two actors, one large array**: the dlbridge transport (an array kept in shareable
   memory, as ``Array.to_shareable`` gives it) beside Ray's ``cuda_ipc`` transport for a PyTorch
   CUDA tensor (the actors share one GPU, ``num_gpus=0.25``); on a machine without a GPU, the CPU
   dlbridge transport beside a NumPy array through the object store.
3. **1,000 small arrays in one call** (4 KiB each): the dlbridge transport beside Ray's
   ``cuda_ipc`` transport for 1,000 PyTorch tensors (CPU: beside 1,000 NumPy arrays through the
   object store).

4. With ``--nccl`` (a machine of two GPUs or more), instead: between two actors on two GPUs, the
   ``dlbridge_nccl`` transport (NCCL, arrays merged into runs) beside Ray's own ``nccl``
   transport for PyTorch tensors (``ray.experimental.collective``), for the large array and for
   the small ones.

Each figure is the median of ``--repeat`` round trips, timed in the driver from the call to the
consumer's answer (the consumer reads one element, of the last array for the small ones, so the data is
there).
Run: ``python bench/bench_ray.py [--mib 1024] [--small 1000] [--repeat 7] [--nccl]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray

import dlbridge
import dlbridge.ray  # noqa: F401  (registers the transport before the actors are defined)


def _median(f, repeat: int, label: str = "") -> float:
    f()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    m = statistics.median(times)
    if label:
        print(f"  measured {label}: {m * 1e3:.2f} ms", flush=True)
    return m


def _first(x) -> float:
    import torch

    if isinstance(x, np.ndarray):
        return float(x.reshape(-1)[0])
    if isinstance(x, dlbridge.Array) and x.device.type == "cpu":
        return float(np.from_dlpack(x).reshape(-1)[0])
    t = torch.from_dlpack(x) if not isinstance(x, torch.Tensor) else x
    return float(t.reshape(-1)[0])


@ray.remote
def _read(x) -> float:
    return _first(x)


class _Producer:
    def __init__(self, kind: str, nbytes: int, n_small: int, device: str):
        import torch

        n = nbytes // 4
        if kind == "dlbridge":
            self.big = dlbridge.full((n,), 1.0, dtype="float32", device=device).to_shareable()
            self.small = [
                dlbridge.full((1024,), float(i), dtype="float32", device=device)
                for i in range(n_small)
            ]
        elif kind == "torch":
            self.big = torch.ones(n, dtype=torch.float32, device=device)
            self.small = [
                torch.full((1024,), float(i), dtype=torch.float32, device=device)
                for i in range(n_small)
            ]
        else:
            self.big = np.ones(n, dtype=np.float32)
            self.small = [np.full(1024, float(i), dtype=np.float32) for i in range(n_small)]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            dlbridge.synchronize(device)

    def ready(self) -> bool:
        return True

    @ray.method(tensor_transport="dlbridge")
    def big_dlbridge(self):
        return self.big

    @ray.method(tensor_transport="dlbridge")
    def small_dlbridge(self):
        return self.small

    @ray.method(tensor_transport="cuda_ipc")
    def big_cuda_ipc(self):
        return self.big

    @ray.method(tensor_transport="cuda_ipc")
    def small_cuda_ipc(self):
        return self.small

    def big_store(self):
        return self.big

    def small_store(self):
        return self.small


class _NcclProducer:
    """Both kinds of arrays in one actor, so that one pair of actors serves both transports."""

    def __init__(self, nbytes: int, n_small: int):
        import torch

        n = nbytes // 4
        self.big_d = dlbridge.full((n,), 1.0, dtype="float32", device="cuda")
        self.small_d = [dlbridge.full((1024,), float(i), dtype="float32", device="cuda") for i in range(n_small)]
        self.big_t = torch.ones(n, dtype=torch.float32, device="cuda")
        self.small_t = [torch.full((1024,), float(i), dtype=torch.float32, device="cuda") for i in range(n_small)]
        torch.cuda.synchronize()
        dlbridge.synchronize("cuda")

    def ready(self) -> bool:
        return True

    @ray.method(tensor_transport="dlbridge_nccl")
    def big_dlbridge(self):
        return [self.big_d]

    @ray.method(tensor_transport="dlbridge_nccl")
    def small_dlbridge(self):
        return self.small_d

    @ray.method(tensor_transport="nccl")
    def big_ray(self):
        return [self.big_t]

    @ray.method(tensor_transport="nccl")
    def small_ray(self):
        return self.small_t


class _Consumer:
    def ready(self) -> bool:
        return True

    def read(self, x) -> float:
        return _first(x)

    def read_one(self, xs) -> float:
        return _first(xs[0])

    def read_all(self, xs) -> float:
        # Every array arrived (their count), and the data is there (one element of the last):
        # reading one element of each would time a thousand device-to-host copies instead.
        return len(xs) + _first(xs[-1])


def nccl_main(args) -> None:
    """Section 4: two actors on two GPUs, NCCL both ways."""
    nbytes = args.mib << 20
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    import torch
    from ray.experimental.collective import create_collective_group

    import dlbridge.nccl

    print(f"Ray {ray.__version__}, dlbridge {dlbridge.__version__}, PyTorch {torch.__version__}, "
          f"NCCL {'.'.join(map(str, dlbridge.nccl.version()))}")
    print(f"two actors on two GPUs; large array {args.mib} MiB, {args.small} small arrays of 4 KiB, "
          f"median of {args.repeat}")
    opts = {"enable_tensor_transport": True, "num_gpus": 1}
    p = ray.remote(**opts)(_NcclProducer).remote(nbytes, args.small)
    c = ray.remote(**opts)(_Consumer).remote()
    ray.get([p.ready.remote(), c.ready.remote()])
    dlbridge.ray.create_nccl_group([p, c])
    create_collective_group([p, c], backend="nccl")
    rows = [
        ("large", "dlbridge_nccl", _median(lambda: ray.get(c.read_one.remote(p.big_dlbridge.remote())), args.repeat, "big dlbridge_nccl")),
        ("large", "Ray nccl, torch", _median(lambda: ray.get(c.read_one.remote(p.big_ray.remote())), args.repeat, "big Ray nccl")),
        ("small", "dlbridge_nccl", _median(lambda: ray.get(c.read_all.remote(p.small_dlbridge.remote())), args.repeat, "small dlbridge_nccl")),
        ("small", "Ray nccl, torch", _median(lambda: ray.get(c.read_all.remote(p.small_ray.remote())), args.repeat, "small Ray nccl")),
    ]
    print()
    print("| case | path | time (ms) | GB/s |")
    print("| --- | --- | ---: | ---: |")
    for case, path, t in rows:
        size = nbytes if case == "large" else args.small * 4096
        label = f"{args.mib} MiB" if case == "large" else f"{args.small} x 4 KiB"
        print(f"| GPU 0 to GPU 1, {label} | {path} | {t * 1e3:.2f} | {size / t / 1e9:.2f} |")
    by = {(case, path): t for case, path, t in rows}
    print()
    print("ratios (Ray's time / dlbridge's; above 1 means dlbridge is faster):")
    print(f"  large: {by[('large', 'Ray nccl, torch')] / by[('large', 'dlbridge_nccl')]:.2f}")
    print(f"  {args.small} small: {by[('small', 'Ray nccl, torch')] / by[('small', 'dlbridge_nccl')]:.2f}")
    ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="size of the large array in MiB")
    ap.add_argument("--small", type=int, default=1000, help="how many small arrays in one call")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--nccl", action="store_true", help="two actors on two GPUs over NCCL instead")
    args = ap.parse_args()
    if args.nccl:
        return nccl_main(args)
    nbytes = args.mib << 20
    gpu = dlbridge.cuda.is_available()
    ray.init(
        num_cpus=4,
        num_gpus=1 if gpu else 0,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=max(3 * nbytes, 512 << 20),
    )
    import torch

    print(f"Ray {ray.__version__}, dlbridge {dlbridge.__version__}, PyTorch {torch.__version__}")
    print(f"large array {args.mib} MiB, {args.small} small arrays of 4 KiB, median of {args.repeat}")
    rows: list[tuple[str, str, float]] = []

    # 1. The object store, CPU.
    n = nbytes // 4
    inputs = {
        "dlbridge": dlbridge.full((n,), 1.0, dtype="float32"),
        "numpy": np.ones(n, dtype=np.float32),
        "torch": torch.ones(n, dtype=torch.float32),
    }
    for name, x in inputs.items():
        rows.append(("put+get (CPU)", name, _median(lambda: ray.get(ray.put(x)), args.repeat, f"put+get {name}")))
    for name, x in inputs.items():
        rows.append(("task argument (CPU)", name, _median(lambda: ray.get(_read.remote(x)), args.repeat, f"task {name}")))
    del inputs

    # 2 and 3. Between two actors.
    device = "cuda" if gpu else "cpu"
    opts: dict = {"enable_tensor_transport": True}
    if gpu:
        opts["num_gpus"] = 0.25  # three actors share the one GPU
    Producer = ray.remote(**opts)(_Producer)
    Consumer = ray.remote(**opts)(_Consumer)
    c = Consumer.remote()
    pd = Producer.remote("dlbridge", nbytes, args.small, device)
    if gpu:
        peer_kind, peer_name = "torch", "Ray cuda_ipc, torch"
    else:
        peer_kind, peer_name = "numpy", "object store, numpy"
    pp = Producer.remote(peer_kind, nbytes, args.small, device)
    ray.get([c.ready.remote(), pd.ready.remote(), pp.ready.remote()])

    big_d = _median(lambda: ray.get(c.read.remote(pd.big_dlbridge.remote())), args.repeat, "big dlbridge")
    small_d = _median(lambda: ray.get(c.read_all.remote(pd.small_dlbridge.remote())), args.repeat, "small dlbridge")
    if gpu:
        big_p = _median(lambda: ray.get(c.read.remote(pp.big_cuda_ipc.remote())), args.repeat, "big cuda_ipc")
        small_p = _median(lambda: ray.get(c.read_all.remote(pp.small_cuda_ipc.remote())), args.repeat, "small cuda_ipc")
    else:
        big_p = _median(lambda: ray.get(c.read.remote(pp.big_store.remote())), args.repeat, "big store")
        small_p = _median(lambda: ray.get(c.read_all.remote(pp.small_store.remote())), args.repeat, "small store")
    where = "CUDA" if gpu else "CPU"
    rows += [
        (f"actor to actor, {args.mib} MiB ({where})", "dlbridge transport", big_d),
        (f"actor to actor, {args.mib} MiB ({where})", peer_name, big_p),
        (f"actor to actor, {args.small} x 4 KiB ({where})", "dlbridge transport", small_d),
        (f"actor to actor, {args.small} x 4 KiB ({where})", peer_name, small_p),
    ]

    print()
    print(f"| case | path | time (ms) | vs first row of the case |")
    print("| --- | --- | ---: | ---: |")
    first: dict[str, float] = {}
    for case, path, t in rows:
        base = first.setdefault(case, t)
        print(f"| {case} | {path} | {t * 1e3:.2f} | {t / base:.2f}x |")
    print()
    print("ratios (peer time / dlbridge time; above 1 means dlbridge is faster):")
    by = {(case, path): t for case, path, t in rows}
    print(f"  put+get CPU vs numpy:            {by[('put+get (CPU)', 'numpy')] / by[('put+get (CPU)', 'dlbridge')]:.2f}")
    print(f"  put+get CPU vs torch:            {by[('put+get (CPU)', 'torch')] / by[('put+get (CPU)', 'dlbridge')]:.2f}")
    print(f"  task argument CPU vs numpy:      {by[('task argument (CPU)', 'numpy')] / by[('task argument (CPU)', 'dlbridge')]:.2f}")
    print(f"  actor to actor large vs peer:    {big_p / big_d:.2f}")
    print(f"  actor to actor {args.small} small vs peer: {small_p / small_d:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
