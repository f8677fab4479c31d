"""Arrays across processes: dlbridge.multiprocessing beside torch.multiprocessing, in one run.

For each side (CPU; CUDA where a device is present) and each framework:

* the first send of an ordinary tensor (``torch.ones``, ``dlbridge.full``), which moves it into
  shared memory (``share_memory_()``: torch copies it into a new shared file; dlbridge moves a
  tensor of whole pages in place, writing its bytes into a shared file mapped at the same
  address), for a 4 KiB and a 1 GiB tensor;
* latency: one message through a ``Queue`` to a spawned consumer that reads one element and
  answers with it (a round trip; the median of many sends of the same tensor, after the first);
* with ``--pre-shared``, the same latencies for tensors made in shared memory beforehand
  (``share_memory_()`` / ``open_shared(share())``, the figures of earlier versions);
* throughput: messages per second of small (256 B) tensors, pipelined (64 ordinary tensors sent
  round robin: each moves on its first send);
* bytes pickled per message (the handle, not the data), and a write by the consumer that the
  producer sees through the tensor it sent (zero bytes copied).

Then a consumer that outlives its producer. Run: ``python bench/bench_ipc.py [--big-mib N]``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np


def multiprocessing_of(framework: str):
    """``torch.multiprocessing`` or ``dlbridge.multiprocessing``: importing it registers the
    framework's reducers with ``ForkingPickler``."""
    if framework == "torch":
        import torch.multiprocessing as mp
    else:
        import dlbridge.multiprocessing as mp
    return mp


def _consumer(framework: str, q_in, q_out) -> None:
    """Reads one element of each tensor received and answers with it; ``None`` stops."""
    multiprocessing_of(framework)
    while True:
        msg = q_in.get()
        if msg is None:
            return
        kind, x = msg
        if kind == "write":
            x[0] = 123  # the producer checks that it sees this: no copy on the way
            # A CUDA write is queued on this process's stream: finish it before saying so (no
            # event travels with a plain reply).
            if framework == "torch":
                if x.is_cuda:
                    import torch

                    torch.cuda.synchronize(x.device)
            elif x.device.type == "cuda":
                import dlbridge

                dlbridge.synchronize(x.device)
            q_out.put("written")
        elif kind == "count":
            q_out.put(x)
        else:
            q_out.put(float(x[0]))


def _producer_then_exit(q, received) -> None:
    import dlbridge
    import dlbridge.multiprocessing  # noqa: F401

    q.put(dlbridge.asarray(np.arange(1 << 20, dtype=np.float32)))  # an ordinary array
    received.wait(60)


def _make(framework: str, nbytes: int, device: str, pre_shared: bool = False):
    """An ordinary tensor of ``nbytes`` (the first send moves it into shared memory), or with
    ``pre_shared`` one made in shared memory beforehand."""
    n = nbytes // 4
    if framework == "torch":
        import torch

        t = torch.ones(n, dtype=torch.float32, device=device)
        return t.share_memory_() if pre_shared and device == "cpu" else t
    import dlbridge

    a = dlbridge.full((n,), 1.0, "float32", device=device)
    return dlbridge.open_shared(a.share()) if pre_shared else a


def _pickled_bytes(x) -> int:
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, 5).dump(x)
    return len(buf.getvalue())


def run_framework(
    framework: str, device: str, big: int, reps: int, small_msgs: int, pre_shared: bool
) -> dict[str, float]:
    ctx = multiprocessing_of(framework).get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consumer, args=(framework, q_in, q_out))
    p.start()
    out: dict[str, float] = {}
    try:
        q_in.put(("read", _make(framework, 4096, device)))  # warm up both sides
        q_out.get(timeout=120)
        for label, nbytes in (("4 KiB", 4096), (f"{big >> 20} MiB", big)):
            x = _make(framework, nbytes, device)
            t0 = time.perf_counter()
            q_in.put(("read", x))  # the first send moves it into shared memory
            assert q_out.get(timeout=300) == 1.0
            out[f"first send {label} (us)"] = (time.perf_counter() - t0) * 1e6
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                q_in.put(("read", x))
                assert q_out.get(timeout=300) == 1.0
                times.append(time.perf_counter() - t0)
            out[f"latency {label} (us)"] = statistics.median(times) * 1e6
            if pre_shared:
                y = _make(framework, nbytes, device, pre_shared=True)
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    q_in.put(("read", y))
                    assert q_out.get(timeout=300) == 1.0
                    times.append(time.perf_counter() - t0)
                out[f"latency {label} pre-shared (us)"] = statistics.median(times) * 1e6
                del y
            out[f"pickled bytes {label}"] = _pickled_bytes(x)
            if nbytes == big:
                q_in.put(("write", x))
                assert q_out.get(timeout=300) == "written"
                seen = float(x[0].item() if framework == "torch" else x[0])
                out["consumer's write seen"] = float(seen == 123)
            del x
        smalls = [_make(framework, 256, device) for _ in range(64)]
        t0 = time.perf_counter()
        for i in range(small_msgs):
            q_in.put(("read", smalls[i % len(smalls)]))
        for _ in range(small_msgs):
            q_out.get(timeout=300)
        out["small msgs/s"] = small_msgs / (time.perf_counter() - t0)
    finally:
        q_in.put(None)
        p.join(60)
    return out


def outlives_producer() -> str:
    import dlbridge.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, received = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_producer_then_exit, args=(q, received))
    p.start()
    a = q.get(timeout=120)
    received.set()
    p.join(60)
    total = float(np.asarray(a).sum())
    expect = float(np.arange(1 << 20, dtype=np.float64).sum())
    return (
        f"producer pid {p.pid} exited with {p.exitcode}; the consumer still reads its 4 MiB: "
        f"sum {total:.0f} (expected {expect:.0f}) -> {'ok' if total == expect else 'WRONG'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the large tensor (MiB)")
    ap.add_argument("--reps", type=int, default=50, help="round trips per size")
    ap.add_argument("--small-msgs", type=int, default=2000, help="messages in the throughput run")
    ap.add_argument("--cpu-only", action="store_true", help="skip CUDA even where present")
    ap.add_argument("--pre-shared", action="store_true",
                    help="also time tensors made in shared memory beforehand")
    args = ap.parse_args()
    import dlbridge

    devices = ["cpu"]
    if not args.cpu_only and dlbridge.cuda.is_available():
        try:
            import torch

            if torch.cuda.is_available():
                devices.append("cuda:0")
        except ImportError:
            pass
    big = args.big_mib << 20
    for device in devices:
        res = {
            fw: run_framework(fw, device, big, args.reps, args.small_msgs, args.pre_shared)
            for fw in ("dlbridge", "torch")
        }
        print(f"\n== {device} (spawn, Queue; dlbridge vs torch.multiprocessing) ==")
        print(f"{'metric':<36}{'dlbridge':>14}{'torch':>14}{'dlbridge/torch':>16}")
        for key in res["dlbridge"]:
            d, t = res["dlbridge"][key], res["torch"][key]
            ratio = f"{d / t:.2f}" if t else "-"
            print(f"{key:<36}{d:>14.1f}{t:>14.1f}{ratio:>16}")
        print("(first send: one round trip that moves an ordinary tensor into shared memory;")
        print(" latency: median round trip of one message and one element back; lower is better.)")
    print("\n" + outlives_producer())


if __name__ == "__main__":
    main()
