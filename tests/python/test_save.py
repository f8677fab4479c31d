"""Saving: the engine's ring of aligned buffers and parallel writers (O_DIRECT, buffered where
refused), byte-identical to the safetensors package; sharded saves with their index; interrupted
saves and full disks."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import dlbridge

torch = pytest.importorskip("torch")
from safetensors.numpy import save_file as st_save_numpy  # noqa: E402
from safetensors.torch import load_file as st_load_torch  # noqa: E402
from safetensors.torch import save_file as st_save_torch  # noqa: E402

_TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64,
]


def _random(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def _same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def test_every_dtype_round_trips_with_the_bytes_safetensors_writes(tmp_path):
    tensors = {f"t_{str(d).split('.')[-1]}": _random((7, 33), d, i) for i, d in enumerate(_TORCH_DTYPES)}
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros((0, 4), dtype=torch.float32)
    # One key: safetensors keeps metadata in a hash map, so the order of several keys in its header
    # varies from run to run (dlbridge writes them sorted).
    metadata = {"format": "pt"}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    dlbridge.save_file(tensors, ours, metadata)
    st_save_torch(tensors, str(theirs), metadata)
    assert _same_bytes(ours, theirs)
    back = st_load_torch(str(ours))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_numpy_arrays_give_the_bytes_safetensors_numpy_writes(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {
        "f64": rng.standard_normal((5, 6)),
        "f16": rng.standard_normal(17).astype(np.float16),
        "i8": rng.integers(-5, 5, (3, 3)).astype(np.int8),
        "b": rng.integers(0, 2, 9).astype(bool),
        "zero_d": np.array(7, dtype=np.int32),
    }
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    dlbridge.save_file(arrays, ours)
    st_save_numpy(arrays, str(theirs))
    assert _same_bytes(ours, theirs)


@pytest.mark.parametrize("direct_io", [True, False])
def test_many_chunks_through_the_ring_match_safetensors(tmp_path, direct_io):
    """40 MB in 1 MiB chunks by 3 writers (several laps of the ring, a partial last chunk), with
    and without O_DIRECT: the bytes safetensors writes."""
    tensors = {f"w{i}": _random((1000 + i, 1000), torch.float32, i) for i in range(10)}
    tensors["tail"] = _random((123,), torch.bfloat16)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    dlbridge.save_file(tensors, ours, threads=3, chunk_bytes=1 << 20, direct_io=direct_io, progress=False)
    st_save_torch(tensors, str(theirs))
    assert _same_bytes(ours, theirs)


def test_views_and_non_contiguous_arrays_are_written_compact(tmp_path):
    base = _random((64, 48), torch.float32)
    views = {
        "transposed": base.t(),
        "stepped": base[::3, 1::2],
        "offset_rows": base[10:20],
        "broadcast": torch.arange(6.0).expand(4, 6),
        "column": base[:, 5],
        "narrow_bf16": base.to(torch.bfloat16)[5:9, 40:],
    }
    assert not all(v.is_contiguous() for v in views.values())
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    dlbridge.save_file(views, ours)
    st_save_torch({k: v.contiguous() for k, v in views.items()}, str(theirs))
    assert _same_bytes(ours, theirs)
    back = st_load_torch(str(ours))
    for name, v in views.items():
        assert torch.equal(back[name], v), name


def _mount(folder, kind, size=None):
    """Mounts a `kind` file system (as root) on `folder`, or skips saying why it cannot."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {kind} needs root")
    options = ["-o", f"size={size}"] if size else []
    result = subprocess.run(["mount", "-t", kind, *options, kind, str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"mounting a {kind} is not permitted here: {result.stderr.strip()}")


@pytest.mark.parametrize("kind", ["ramfs", "tmpfs"])
def test_file_systems_that_refuse_or_take_o_direct_get_the_same_bytes(tmp_path, kind):
    """ramfs refuses O_DIRECT (EINVAL): every write goes through the page cache; tmpfs takes it
    on recent kernels and refuses it on older ones. Either way: safetensors' bytes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk, kind)
    try:
        if kind == "ramfs":
            with pytest.raises(OSError) as info:
                os.close(os.open(disk / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
            assert info.value.errno == errno.EINVAL
        tensors = {f"w{i}": _random((700, 1000), torch.float32, i) for i in range(6)}
        dlbridge.save_file(tensors, disk / "ours.safetensors", chunk_bytes=1 << 20, threads=2)
        st_save_torch(tensors, str(tmp_path / "theirs.safetensors"))
        assert _same_bytes(disk / "ours.safetensors", tmp_path / "theirs.safetensors")
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_progress_reports_bytes_up_to_the_file_length(tmp_path):
    tensors = {"w": _random((1000, 1000), torch.float32)}
    reports = []
    path = tmp_path / "p.safetensors"
    dlbridge.save_file(tensors, path, progress=lambda d, t: reports.append((d, t)))
    size = os.path.getsize(path)
    assert reports and reports[-1] == (size, size)
    assert all(d <= t == size for d, t in reports)
    assert [d for d, _ in reports] == sorted(d for d, _ in reports)


def test_a_failing_progress_callback_is_raised(tmp_path):
    def boom(done, total):
        raise KeyError("stop")

    with pytest.raises(KeyError):
        dlbridge.save_file({"w": torch.ones(3)}, tmp_path / "p.safetensors", progress=boom)


def test_device_arrays_give_the_bytes_of_the_host_copy(tmp_path, device):
    tensors = {f"w{i}": _random((300, 257), torch.float32, i) for i in range(4)}
    on_device = {k: dlbridge.asarray(v).to(device) for k, v in tensors.items()}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    dlbridge.save_file(on_device, ours, chunk_bytes=1 << 20)
    st_save_torch(tensors, str(theirs))
    assert _same_bytes(ours, theirs)


# ---------------------------------------------------------------------------------------------
# Sharded saves.


def test_sharded_save_writes_hugging_face_shards_and_index(tmp_path):
    # 400 kB each (100000 float32), then one of 1.2 MB (over the limit: alone), then small ones.
    tensors = {
        "a": _random((100000,), torch.float32, 1),
        "b": _random((100000,), torch.float32, 2),
        "c": _random((100000,), torch.float32, 3),
        "huge": _random((300000,), torch.float32, 4),
        "d": _random((100000,), torch.float32, 5),
        "e": _random((10,), torch.bfloat16, 6),
    }
    folder = tmp_path / "ckpt"
    dlbridge.save_file(tensors, folder, {"format": "pt"}, max_shard_size="1MB")
    index = str(folder / "model.safetensors.index.json")
    # Hugging Face's split: a, b fill 800 kB; c would overflow (a new shard); huge alone (before
    # the shard being filled, as huggingface_hub appends it); d joins c; e joins them.
    expected = {
        "model-00001-of-00003.safetensors": ["a", "b"],
        "model-00002-of-00003.safetensors": ["huge"],
        "model-00003-of-00003.safetensors": ["c", "d", "e"],
    }
    assert sorted(os.listdir(folder)) == sorted([*expected, "model.safetensors.index.json"])
    with open(index) as f:
        data = json.load(f)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert data["metadata"] == {"total_size": total}
    assert data["weight_map"] == {name: shard for shard, names in expected.items() for name in names}
    for shard, names in expected.items():
        back = st_load_torch(str(folder / shard))
        assert sorted(back) == sorted(names)
        for name in names:
            assert torch.equal(back[name], tensors[name])
        # Each shard is what safetensors writes for its tensors and the metadata.
        st_save_torch({n: tensors[n] for n in names}, str(tmp_path / "one.safetensors"), {"format": "pt"})
        assert _same_bytes(folder / shard, tmp_path / "one.safetensors")
    for source in (index, folder):
        loaded = dlbridge.load_file(source, framework="torch")
        assert loaded.keys() == tensors.keys()
        for name, t in tensors.items():
            assert torch.equal(loaded[name], t)


def test_one_shard_is_model_safetensors_without_an_index(tmp_path):
    tensors = {"a": torch.ones(10), "b": torch.zeros(3, dtype=torch.int64)}
    dlbridge.save_file(tensors, tmp_path / "ckpt", max_shard_size=10**9)
    written = tmp_path / "ckpt" / "model.safetensors"
    assert os.listdir(tmp_path / "ckpt") == ["model.safetensors"]
    st_save_torch(tensors, str(tmp_path / "theirs.safetensors"))
    assert _same_bytes(written, tmp_path / "theirs.safetensors")


@pytest.mark.parametrize(
    "size, bytes_",
    [(1000, 1000), ("1000", 1000), ("2KB", 2000), ("2 kb", 2000), ("1KiB", 1024), ("0.5kib", 512)],
)
def test_shard_sizes_read_as_hugging_face_writes_them(tmp_path, size, bytes_):
    # Two tensors of exactly `bytes_` bytes each: one shard each, whatever the spelling.
    n = bytes_ // 4
    tensors = {"a": torch.ones(n), "b": torch.zeros(n)}
    dlbridge.save_file(tensors, tmp_path / "ckpt", max_shard_size=size)
    with open(tmp_path / "ckpt" / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) == 2


def test_shard_sizes_larger_than_the_tensors_parse(tmp_path):
    for size in ("5GB", "500MB", "2GiB", 10**12):
        dlbridge.save_file({"a": torch.ones(4)}, tmp_path / "ckpt", max_shard_size=size)
        assert os.listdir(tmp_path / "ckpt") == ["model.safetensors"]


@pytest.mark.parametrize("size, error", [("5 parsecs", ValueError), ("GB", ValueError), (0, ValueError),
                                         (-3, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_shard_sizes_are_clear_errors(tmp_path, size, error):
    with pytest.raises(error, match="max_shard_size"):
        dlbridge.save_file({"a": torch.ones(4)}, tmp_path / "ckpt", max_shard_size=size)
    assert not (tmp_path / "ckpt").exists()


def test_a_refused_sharded_save_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        dlbridge.save_file({"a": torch.ones(4), "__metadata__": torch.ones(1)}, tmp_path / "ckpt",
                           max_shard_size=8)
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------------------------
# Interrupted saves and full disks.

_KILLED_SAVE = """
import os, sys, time, torch, dlbridge
path = sys.argv[1]
tensors = {f"w{i}": torch.full((1000, 1000), float(i)) for i in range(20)}
def stall(done, total):
    print("writing", done, total, flush=True)
    time.sleep(60)
dlbridge.save_file(tensors, path, progress=stall, chunk_bytes=1 << 20, threads=1)
"""


def test_a_save_killed_mid_write_leaves_the_old_file_and_the_next_save_removes_its_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    old = {"w": torch.arange(10.0)}
    dlbridge.save_file(old, path)
    before = path.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("writing"), line
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert path.read_bytes() == before
    leftovers = [n for n in os.listdir(tmp_path) if n != "model.safetensors"]
    assert len(leftovers) == 1, leftovers
    assert leftovers[0].startswith(".model.safetensors.") and leftovers[0].endswith(".tmp")
    # A save started right away leaves a temporary that was changed under a second ago.
    time.sleep(1.2)
    dlbridge.save_file({"w": torch.ones(2)}, path)
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert torch.equal(st_load_torch(str(path))["w"], torch.ones(2))


def test_a_temporary_that_another_save_holds_is_left_alone(tmp_path):
    """A stale-looking temporary (old, the same name pattern) that a live save still holds locked
    is not removed by another save to the same file."""
    import fcntl

    path = tmp_path / "model.safetensors"
    held = tmp_path / ".model.safetensors.999999.0.tmp"
    with open(held, "wb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        os.utime(held, (time.time() - 60, time.time() - 60))
        dlbridge.save_file({"w": torch.ones(2)}, path)
        assert held.exists()
    unrelated = tmp_path / ".model.safetensors.backup.tmp"
    unrelated.write_bytes(b"keep")
    os.utime(unrelated, (time.time() - 60, time.time() - 60))
    dlbridge.save_file({"w": torch.ones(2)}, path)
    assert not held.exists()  # no longer locked: a leftover
    assert unrelated.read_bytes() == b"keep"  # not a name a save gives its temporary


@pytest.mark.parametrize("sharded", [False, True])
def test_a_full_disk_is_an_oserror_and_leaves_nothing_partial(tmp_path, sharded):
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk, "tmpfs", "2m")  # a full disk
    try:
        path = disk / "model.safetensors"
        old = {"w": torch.arange(1000.0)}
        dlbridge.save_file(old, path)
        before = path.read_bytes()
        big = {f"w{i}": torch.ones(250_000) for i in range(3)}  # 3 MB into 2 MB
        with pytest.raises(OSError) as info:
            if sharded:
                dlbridge.save_file(big, disk / "ckpt", max_shard_size="1MB")
            else:
                dlbridge.save_file(big, path)
        assert "No space left on device" in str(info.value)
        assert info.value.errno == errno.ENOSPC and info.value.filename
        assert path.read_bytes() == before
        names = os.listdir(disk)
        if sharded:
            names = names + os.listdir(disk / "ckpt")
        assert sorted(names) == (["ckpt", "model.safetensors"] if sharded else ["model.safetensors"])
    finally:
        subprocess.run(["umount", str(disk)], check=False)
