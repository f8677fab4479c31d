"""The CPU caching pool seen from Python (statistics, reuse, empty_cache, limits) and the
DLBRIDGE_STORAGE_MODE environment variable (each case in a fresh interpreter)."""

from __future__ import annotations

import gc
import json
import mmap
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import dlbridge

KIB = 1024
MIB = 1024 * KIB
PAGE = mmap.PAGESIZE


def block_size(n: int) -> int:
    """The block a CPU request of ``n`` bytes gets, by the rule the README documents: multiples of
    512 B up to 8 KiB, eight classes per power of two above; whole pages from 64 KiB."""
    if n <= 8 * KIB:
        step = 512
    else:
        step = (1 << ((n - 1).bit_length() - 1)) // 8
    size = max(-(-n // step) * step, 512)
    if size >= 64 * KIB:
        size = -(-size // PAGE) * PAGE
    return size


def stats() -> dict:
    return dlbridge.memory_stats()


@pytest.fixture
def pool():
    """The CPU pool with an empty cache and no memory limit; limits restored afterwards."""
    gc.collect()
    saved = stats()
    dlbridge.set_memory_limit(None)
    dlbridge.empty_cache()
    yield
    dlbridge.set_memory_limit(saved["memory_limit"])
    dlbridge.set_cache_limit(saved["cache_limit"])
    gc.collect()
    dlbridge.empty_cache()


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if k not in ("memory_limit", "cache_limit")}


# ---------------------------------------------------------------------------------------------
# Statistics and reuse through arrays.


def test_rounding_rule_of_the_documentation():
    # The rule the tests below rely on, checked against its promises.
    for n in [1, 511, 512, 513, 4096, 8192, 8193, 100_000, MIB + 1, 3 * MIB + 1, 1 << 30]:
        b = block_size(n)
        assert b >= n
        if n > MIB:
            assert (b - n) * 8 <= n


def test_stats_follow_array_lifetimes(pool):
    s0 = stats()
    a = dlbridge.empty(1000, dtype="uint8")
    s1 = stats()
    assert delta(s0, s1) | {"peak_active_bytes": 0} == {
        "active_bytes": 1024, "active_blocks": 1, "requested_bytes": 1000,
        "cached_bytes": 0, "cached_blocks": 0, "peak_active_bytes": 0,
        "allocations": 1, "cache_hits": 0, "cache_misses": 1,
        "driver_allocations": 1, "driver_frees": 0,
    }
    big = 3 * MIB + 1
    b = dlbridge.zeros(big, dtype="uint8")
    s2 = stats()
    assert s2["active_bytes"] == s0["active_bytes"] + 1024 + block_size(big)
    assert s2["requested_bytes"] == s0["requested_bytes"] + 1000 + big
    assert s2["peak_active_bytes"] >= s2["active_bytes"]

    address = a.data_ptr
    del a
    s3 = stats()
    assert s3["active_blocks"] == s2["active_blocks"] - 1
    assert (s3["cached_bytes"], s3["cached_blocks"]) == (1024, 1)

    c = dlbridge.empty((20, 30), dtype="uint8")  # 600 bytes: the same 1 KiB block
    assert c.data_ptr == address
    s4 = stats()
    assert delta(s3, s4)["cache_hits"] == 1
    assert s4["driver_allocations"] == s3["driver_allocations"]
    assert s4["cached_blocks"] == 0

    peak = s4["peak_active_bytes"]
    del b, c
    s5 = stats()
    assert s5["active_bytes"] == s0["active_bytes"]
    assert s5["cached_bytes"] == 1024 + block_size(big)
    assert s5["peak_active_bytes"] == peak
    dlbridge.reset_peak_memory()
    assert stats()["peak_active_bytes"] == s5["active_bytes"]


def test_views_and_exports_keep_the_block_in_use(pool):
    a = dlbridge.arange(10_000, dtype="int64")
    base = stats()
    view = a[10:20]
    exported = np.from_dlpack(a)
    as_torch = torch.from_dlpack(a[::2])
    del a
    assert stats()["active_blocks"] == base["active_blocks"], "views hold the block"
    del view, exported
    assert stats()["active_blocks"] == base["active_blocks"]
    del as_torch
    after = stats()
    assert after["active_blocks"] == base["active_blocks"] - 1
    assert after["cached_bytes"] == base["cached_bytes"] + block_size(80_000)


def test_reused_memory_is_zeroed_for_zeros(pool):
    a = dlbridge.full(5000, 7, dtype="uint8")
    address = a.data_ptr
    del a
    before = stats()
    z = dlbridge.zeros(4700, dtype="uint8")  # same 5 KiB class
    assert z.data_ptr == address
    assert not np.from_dlpack(z).any()
    after = stats()
    assert after["driver_allocations"] == before["driver_allocations"]
    assert after["cache_hits"] == before["cache_hits"] + 1


def test_foreign_memory_never_enters_the_pool(pool):
    before = stats()
    x = np.ones(1 << 20, dtype=np.float32)
    t = torch.ones(1 << 18)
    a, b = dlbridge.from_dlpack(x), dlbridge.asarray(t)
    assert a.is_foreign and b.is_foreign
    assert stats() == before
    del a, b, x, t
    gc.collect()
    assert stats() == before


def test_empty_cache_returns_every_cached_block(pool):
    arrays = [dlbridge.empty(n, dtype="uint8") for n in (100, 10_000, 100_000, 2 * MIB)]
    del arrays
    before = stats()
    assert before["cached_blocks"] == 4
    assert before["cached_bytes"] == sum(block_size(n) for n in (100, 10_000, 100_000, 2 * MIB))
    dlbridge.empty_cache()
    after = stats()
    assert (after["cached_bytes"], after["cached_blocks"]) == (0, 0)
    assert after["driver_frees"] == before["driver_frees"] + 4
    # The next array of such a size comes from the driver again.
    a = dlbridge.empty(2 * MIB, dtype="uint8")
    assert stats()["cache_misses"] == after["cache_misses"] + 1
    del a


def test_threads_leave_exact_figures(pool):
    base = stats()
    counts = [0] * 8

    def work(i):
        held = []
        for k in range(300):
            held.append(dlbridge.empty((k % 7 + 1) * 1000, dtype="uint8"))
            counts[i] += 1
            if len(held) > 3:
                held.pop(0)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = stats()
    assert end["active_bytes"] == base["active_bytes"]
    assert end["allocations"] - base["allocations"] == sum(counts)
    d = delta(base, end)
    assert d["cache_hits"] + d["cache_misses"] == sum(counts)
    assert d["driver_allocations"] - d["driver_frees"] == d["cached_blocks"]


# ---------------------------------------------------------------------------------------------
# Limits.


def test_memory_limit_raises_memory_error(pool):
    active = stats()["active_bytes"]
    dlbridge.set_memory_limit(active + MIB)
    assert stats()["memory_limit"] == active + MIB
    ok = dlbridge.empty(MIB // 2, dtype="uint8")
    with pytest.raises(MemoryError) as info:
        dlbridge.zeros(MIB, dtype="uint8")
    text = str(info.value)
    assert f"cannot allocate {MIB} bytes" in text
    assert f"memory limit {active + MIB} bytes" in text
    assert f"{active + block_size(MIB // 2)} bytes active" in text
    del ok
    big = dlbridge.empty(MIB, dtype="uint8")  # fits once the first is released
    del big
    dlbridge.set_memory_limit(None)
    assert stats()["memory_limit"] is None
    larger = dlbridge.empty(4 * MIB, dtype="uint8")
    del larger


def test_cache_limit_releases_blocks(pool):
    dlbridge.set_cache_limit(0)
    before = stats()
    a = dlbridge.empty(10_000, dtype="uint8")
    del a
    after = stats()
    assert after["cached_bytes"] == 0
    assert after["driver_frees"] == before["driver_frees"] + 1
    dlbridge.set_cache_limit(None)
    a = dlbridge.empty(10_000, dtype="uint8")
    del a
    assert stats()["cached_bytes"] == block_size(10_000)
    dlbridge.set_cache_limit(100)  # smaller than the block: released at once
    assert stats()["cached_bytes"] == 0
    dlbridge.set_cache_limit(np.int64(4096))  # integer-like objects are fine
    assert stats()["cache_limit"] == 4096


@pytest.mark.parametrize("setter", [dlbridge.set_memory_limit, dlbridge.set_cache_limit])
@pytest.mark.parametrize(
    "value, error",
    [(-1, ValueError), (-(2**70), ValueError), (2**64, ValueError), (2**63, ValueError),
     ("1024", TypeError), (1024.0, TypeError), (True, TypeError)],
)
def test_invalid_limits(pool, setter, value, error):
    before = stats()
    with pytest.raises(error):
        setter(value)
    assert stats() == before


def test_backends_not_built_raise_runtime_error():
    backends = dlbridge.build_info()["backends"]
    checked = 0
    for device, backend in [("cuda:0", "cuda"), ("metal", "metal")]:
        if backend in backends:
            continue
        for call in (dlbridge.memory_stats, dlbridge.empty_cache, dlbridge.storage_mode):
            with pytest.raises(RuntimeError, match="not available"):
                call(device)
        with pytest.raises(RuntimeError, match="not available"):
            dlbridge.set_memory_limit(None, device)
        checked += 1
    if not checked:
        pytest.skip("every backend is built in")


def test_storage_mode_arguments():
    assert dlbridge.storage_mode("cpu", requested="Private") == ("shared", "explicit")
    with pytest.raises(ValueError, match="storage mode"):
        dlbridge.storage_mode(requested="pinned")
    with pytest.raises(TypeError):
        dlbridge.memory_stats(device=3.5)


# ---------------------------------------------------------------------------------------------
# DLBRIDGE_STORAGE_MODE, each case in a fresh interpreter (the variable is read once).

PROBE = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import dlbridge
        late = os.environ.pop("LATE_VALUE", None)
        if late is not None:  # set after import, before first use: still seen
            os.environ["DLBRIDGE_STORAGE_MODE"] = late
        first = dlbridge.storage_mode()
        explicit = dlbridge.storage_mode(requested="managed")
        os.environ["DLBRIDGE_STORAGE_MODE"] = "private"  # too late: read once
        again = dlbridge.storage_mode()
        stats = dlbridge.memory_stats()
        a = dlbridge.zeros(10)
    print(json.dumps({
        "first": first, "explicit": explicit, "again": again,
        "warnings": [[w.category.__name__, str(w.message)] for w in caught],
    }))
    """
)


def probe(value=None, late=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DLBRIDGE_STORAGE_MODE"}
    if value is not None:
        env["DLBRIDGE_STORAGE_MODE"] = value
    if late is not None:
        env["LATE_VALUE"] = late
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_env_unset_gives_the_default():
    out = probe(None)
    assert out["first"] == ["shared", "default"]
    assert out["again"] == ["shared", "default"]
    assert out["explicit"] == ["shared", "explicit"]
    assert out["warnings"] == []


@pytest.mark.parametrize("value", ["private", "shared", "managed", "Private", "MANAGED",
                                   "  sHaReD\t", "\nprivate "])
def test_env_each_mode_in_any_case(value):
    out = probe(value)
    # The CPU reports shared whatever was asked, but says the environment asked.
    assert out["first"] == ["shared", "environment"]
    assert out["again"] == ["shared", "environment"]
    assert out["explicit"] == ["shared", "explicit"]
    assert out["warnings"] == []


def test_env_empty_counts_as_unset():
    out = probe("  ")
    assert out["first"] == ["shared", "default"]
    assert out["warnings"] == []


@pytest.mark.parametrize("value", ["bogus", "pinned", "private,shared"])
def test_env_invalid_warns_once_and_uses_the_default(value):
    out = probe(value)
    assert out["first"] == ["shared", "default"]
    assert out["again"] == ["shared", "default"]
    assert out["explicit"] == ["shared", "explicit"]
    runtime = [m for c, m in out["warnings"] if c == "RuntimeWarning"]
    assert len(runtime) == 1, out["warnings"]
    assert "DLBRIDGE_STORAGE_MODE" in runtime[0] and repr(value).strip("'") in runtime[0]
    assert len(out["warnings"]) == 1


def test_env_is_read_on_first_use_not_at_import():
    out = probe(None, late="managed")
    assert out["first"] == ["shared", "environment"]
    out = probe(None, late="nonsense")
    assert out["first"] == ["shared", "default"]
    assert [c for c, _ in out["warnings"]] == ["RuntimeWarning"]
