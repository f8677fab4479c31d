"""Where a cross-process round trip's time goes, per phase, for dlbridge and torch.multiprocessing.

The producer pickles with ``ForkingPickler`` (the reducers both libraries register) and sends the
bytes; the consumer times unpickling (rebuild + open/import), reading one element, and dropping
the array, and sends the timings back. Medians of ``--reps`` messages, the same tensor each time
(as ``bench_ipc.py`` does). Run: ``python bench/probe_ipc.py [--device cuda:0] [--reps 200]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_ipc import multiprocessing_of  # bench/ is on the path when this file is run


def _consumer(framework: str, q_in, q_out) -> None:
    multiprocessing_of(framework)
    from multiprocessing.reduction import ForkingPickler

    while True:
        data = q_in.get()
        if data is None:
            return
        t0 = time.perf_counter()
        x = ForkingPickler.loads(data)
        t1 = time.perf_counter()
        v = float(x[0])
        t2 = time.perf_counter()
        del x
        t3 = time.perf_counter()
        q_out.put((v, t1 - t0, t2 - t1, t3 - t2))


def _make(framework: str, n: int, device: str):
    if framework == "torch":
        import torch

        t = torch.ones(n, dtype=torch.float32, device=device)
        return t.share_memory_() if device == "cpu" else t
    import dlbridge

    return dlbridge.full((n,), 1.0, "float32", device=device).to_shareable()


def run(framework: str, device: str, n: int, reps: int) -> dict[str, float]:
    from multiprocessing.reduction import ForkingPickler

    ctx = multiprocessing_of(framework).get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consumer, args=(framework, q_in, q_out))
    p.start()
    x = _make(framework, n, device)
    rows: dict[str, list[float]] = {k: [] for k in ("pickle", "round trip", "unpickle+open", "read x[0]", "drop")}
    try:
        for i in range(reps + 5):
            t0 = time.perf_counter()
            data = bytes(ForkingPickler.dumps(x))
            t1 = time.perf_counter()
            q_in.put(data)
            v, load, read, drop = q_out.get(timeout=120)
            t2 = time.perf_counter()
            assert v == 1.0
            if i >= 5:
                for k, s in zip(rows, (t1 - t0, t2 - t1, load, read, drop)):
                    rows[k].append(s)
    finally:
        q_in.put(None)
        p.join(60)
    return {k: statistics.median(v) * 1e6 for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--elements", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    res = {fw: run(fw, args.device, args.elements, args.reps) for fw in ("dlbridge", "torch")}
    print(f"\n== {args.device}, {args.elements * 4} bytes: median µs per phase ==")
    print(f"{'phase':<16}{'dlbridge':>10}{'torch':>10}")
    for k in res["dlbridge"]:
        print(f"{k:<16}{res['dlbridge'][k]:>10.1f}{res['torch'][k]:>10.1f}")


if __name__ == "__main__":
    main()
