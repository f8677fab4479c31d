"""dlbridge's caching pool: storage modes, cache hits, limits and statistics.

    python examples/memory_pool.py

The CUDA part (pinned and managed storage) prints that it was skipped where there is no CUDA
device; the Metal part likewise off a Mac.
"""

import dlbridge


def show(label: str, device: str = "cpu", **kw: str) -> dict:
    s = dlbridge.memory_stats(device, **kw)
    print(f"  {label:<34} active {s['active_bytes']:>9} B in {s['active_blocks']} blocks, "
          f"cached {s['cached_bytes']:>9} B, hits {s['cache_hits']}, misses {s['cache_misses']}")
    return s


def main() -> None:
    mode, source = dlbridge.storage_mode("cpu")
    print(f"cpu: storage mode {mode!r} ({source})")
    dlbridge.empty_cache("cpu")
    show("start")

    a = dlbridge.empty((1 << 18,), dtype="float32")  # 1 MiB from the driver (a miss)
    first = show("after allocating 1 MiB")
    del a  # back to the pool's cache, not to the OS
    show("after freeing it")
    b = dlbridge.empty((1 << 18,), dtype="float32")  # the cached block again (a hit)
    again = show("after allocating 1 MiB again")
    assert again["cache_hits"] == first["cache_hits"] + 1
    del b

    # Limits: at most 4 MiB cached; allocations past the memory limit raise MemoryError.
    dlbridge.set_cache_limit(4 << 20, "cpu")
    dlbridge.set_memory_limit(64 << 20, "cpu")
    try:
        dlbridge.empty((128 << 20,), dtype="uint8")
    except MemoryError as e:
        print(f"  past the 64 MiB limit: MemoryError: {e}")
    dlbridge.set_memory_limit(None, "cpu")
    dlbridge.set_cache_limit(None, "cpu")
    dlbridge.empty_cache("cpu")
    show("after empty_cache")

    if dlbridge.cuda.is_available():
        for storage in ("device", "pinned", "managed"):
            x = dlbridge.zeros((1 << 20,), device="cuda:0", storage=storage)
            print(f"cuda:0 storage={storage!r}: an array on {x.device} (storage {x.storage})")
            show(f"cuda:0 pool, storage={storage!r}", "cuda:0", storage=storage)
            del x
        dlbridge.empty_cache("cuda:0")
    else:
        print(f"cuda: skipped, no CUDA device: {dlbridge.cuda.unavailable_reason()}")

    if dlbridge.metal.is_available():
        for storage in ("shared", "private"):
            x = dlbridge.zeros((1 << 20,), device="metal", storage=storage)
            show(f"metal:0 pool, storage={storage!r}", "metal:0", storage=storage)
            del x
    else:
        print(f"metal: skipped: {dlbridge.metal.unavailable_reason()}")
    print("memory_pool: ok")


if __name__ == "__main__":
    main()
