"""safetensors checkpoints: files written by the `safetensors` package loaded by dlbridge (CPU and
CUDA) equal to what `safetensors` loads, dlbridge's files loaded by `safetensors`, zero-copy on the
CPU, shards with an index, progress, the command line, and every kind of bad file."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import dlbridge

safetensors = pytest.importorskip("safetensors")
from safetensors.numpy import load_file as st_load_numpy  # noqa: E402
from safetensors.numpy import save_file as st_save_numpy  # noqa: E402

torch = pytest.importorskip("torch")
from safetensors.torch import load_file as st_load_torch  # noqa: E402
from safetensors.torch import save_file as st_save_torch  # noqa: E402

CUDA = dlbridge.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64,
                np.int64, np.float16, np.float32, np.float64]
TORCH_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]
for name in ("float8_e8m0fnu",):
    if hasattr(torch, name):
        TORCH_DTYPES.append(getattr(torch, name))


def _numpy_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for i, dt in enumerate(NUMPY_DTYPES):
        if dt is np.bool_:
            a = rng.integers(0, 2, size=(3, 5)).astype(dt)
        elif np.issubdtype(dt, np.integer):
            info = np.iinfo(dt)
            a = rng.integers(max(info.min, -1000), min(info.max, 1000), size=(3, 5)).astype(dt)
        else:
            a = rng.standard_normal((3, 5)).astype(dt)
        out[f"t{i}_{np.dtype(dt).name}"] = a
    out["scalar"] = np.array(2.5, dtype=np.float32)
    out["empty"] = np.zeros((0, 4), dtype=np.float32)
    return out


def _as_numpy(a: dlbridge.Array) -> np.ndarray:
    return np.asarray(a)


def test_numpy_files_load_equal(tmp_path):
    tensors = _numpy_tensors(np.random.default_rng(1))
    path = tmp_path / "np.safetensors"
    st_save_numpy(tensors, str(path), metadata={"framework": "numpy"})
    loaded = dlbridge.load_file(path)
    expected = st_load_numpy(str(path))
    assert sorted(loaded) == sorted(expected)
    for name, ref in expected.items():
        got = _as_numpy(loaded[name])
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        np.testing.assert_array_equal(got, ref)
        assert loaded[name].readonly, "CPU loads are read-only views of the file"
    with dlbridge.safe_open(path) as f:
        assert f.metadata() == {"framework": "numpy"}
        assert sorted(f.keys()) == sorted(tensors)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_only_dtypes_load_equal(tmp_path, dtype):
    g = torch.Generator().manual_seed(2)
    if dtype.is_complex:
        t = torch.randn(4, 6, dtype=dtype, generator=g)
    else:
        t = (torch.randn(4, 6, generator=g) * 4).to(dtype)
    path = tmp_path / "t.safetensors"
    st_save_torch({"x": t, "y": t[:1].clone()}, str(path))
    loaded = dlbridge.load_file(path)
    got = torch.from_dlpack(loaded["x"])
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_zero_copy_views_of_one_mapping(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {"a": rng.standard_normal((64, 32)).astype(np.float32),
               "b": rng.standard_normal((128,)).astype(np.float32),
               "c": rng.integers(0, 9, (7, 7)).astype(np.int64)}
    path = tmp_path / "z.safetensors"
    st_save_numpy(tensors, str(path))
    loaded = dlbridge.load_file(path)
    checkpoint = dlbridge._dlbridge._Checkpoint(str(path))
    starts = {n: checkpoint.info(n)[2][0] for n in tensors}
    base = loaded["a"].data_ptr - starts["a"]
    for name in tensors:
        # Every array lies where its bytes lie in the file, in one mapping of it.
        assert loaded[name].data_ptr - base == starts[name]
        assert loaded[name].is_foreign
    # ... and goes on to NumPy and PyTorch without a copy.
    assert np.from_dlpack(loaded["b"]).ctypes.data == loaded["b"].data_ptr
    assert torch.from_dlpack(loaded["c"]).data_ptr() == loaded["c"].data_ptr


def test_load_options_are_checked_and_leave_cpu_views_alone(tmp_path):
    """`storage=`, `allocation=` and `gds=` name what they take; a bad value is a ValueError
    naming it. On the CPU the tensors are views of the mapped file whatever the reader options
    (they tune devices whose tensors are read)."""
    path = tmp_path / "o.safetensors"
    st_save_numpy({"w": np.arange(10, dtype=np.float32), "b": np.ones((2, 3), np.int64)}, str(path))
    expected = st_load_numpy(str(path))
    for kw in ({"allocation": "per-tensor"}, {"allocation": "PER-FILE"}, {"gds": False},
               {"storage": "shared"}, {"allocation": "per_tensor", "gds": True}):
        loaded = dlbridge.load_file(path, **kw)
        for name, want in expected.items():
            assert np.array_equal(np.from_dlpack(loaded[name]), want), (kw, name)
            assert loaded[name].readonly and loaded[name].is_foreign, kw
    with pytest.raises(ValueError, match="allocation \"per-array\".*'per-file' or 'per-tensor'"):
        dlbridge.load_file(path, allocation="per-array")
    with pytest.raises(ValueError, match="storage \"fast\""):
        dlbridge.load_file(path, storage="fast")


def test_copy_true_gives_writable_private_memory(tmp_path):
    path = tmp_path / "c.safetensors"
    st_save_numpy({"w": np.arange(10, dtype=np.float32)}, str(path))
    view = dlbridge.load_file(path)["w"]
    copy = dlbridge.load_file(path, copy=True)["w"]
    assert view.readonly and not copy.readonly
    assert copy.data_ptr != view.data_ptr
    t = torch.from_dlpack(copy)
    t[0] = 42
    assert np.asarray(copy)[0] == 42 and np.asarray(view)[0] == 0


def test_keys_and_dtype(tmp_path):
    path = tmp_path / "k.safetensors"
    st_save_numpy({"a": np.ones(3, np.float32), "b": np.arange(4, dtype=np.int32),
                   "c": np.full(2, 0.5, np.float64)}, str(path))
    loaded = dlbridge.load_file(path, keys=["a", "c"], dtype=dlbridge.float16)
    assert sorted(loaded) == ["a", "c"]
    assert loaded["a"].dtype == dlbridge.float16 and loaded["c"].dtype == dlbridge.float16
    with pytest.raises(KeyError, match="nope"):
        dlbridge.load_file(path, keys=["nope"])


def test_dlbridge_files_load_in_safetensors(tmp_path):
    rng = np.random.default_rng(4)
    arrays = {
        "np": rng.standard_normal((5, 3)).astype(np.float32),
        "strided": np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2],
        "torch_bf16": torch.randn(3, 3).to(torch.bfloat16),
        "dl": dlbridge.arange(7, dtype=dlbridge.int64),
        "scalar": np.array(True),
        "empty": np.zeros((2, 0), np.float64),
    }
    path = tmp_path / "out.safetensors"
    dlbridge.save_file(arrays, path, metadata={"who": "dlbridge"})
    back = st_load_torch(str(path))
    assert torch.equal(back["np"], torch.from_numpy(arrays["np"]))
    assert torch.equal(back["strided"], torch.from_numpy(np.ascontiguousarray(arrays["strided"])))
    assert torch.equal(back["torch_bf16"], arrays["torch_bf16"])
    assert back["dl"].tolist() == list(range(7))
    assert back["scalar"].shape == () and bool(back["scalar"])
    assert back["empty"].shape == (2, 0)
    with safetensors.safe_open(str(path), "np") as f:
        assert f.metadata() == {"who": "dlbridge"}
    # Round trip through dlbridge too.
    again = dlbridge.load_file(path)
    np.testing.assert_array_equal(np.asarray(again["np"]), arrays["np"])


def test_shards_with_an_index(tmp_path):
    rng = np.random.default_rng(5)
    shards = [{f"layer{i}.w": rng.standard_normal((8, 8)).astype(np.float32) for i in range(j * 3, j * 3 + 3)}
              for j in range(2)]
    weight_map = {}
    for j, shard in enumerate(shards):
        name = f"model-{j + 1:05d}-of-00002.safetensors"
        st_save_numpy(shard, str(tmp_path / name))
        weight_map.update({k: name for k in shard})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    loaded = dlbridge.load_file(index)
    assert sorted(loaded) == sorted(weight_map)
    for shard in shards:
        for k, v in shard.items():
            np.testing.assert_array_equal(np.asarray(loaded[k]), v)
    # The shards as a list give the same tensors.
    listed = dlbridge.load_file(sorted(tmp_path.glob("model-*.safetensors")))
    assert sorted(listed) == sorted(weight_map)
    # An index naming a missing shard names it.
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises((ValueError, FileNotFoundError), match="model-00002-of-00002"):
        dlbridge.load_file(index)


def test_progress_callable(tmp_path):
    path = tmp_path / "p.safetensors"
    st_save_numpy({"w": np.zeros(1000, np.float32)}, str(path))
    calls = []
    dlbridge.load_file(path, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1] == (4000, 4000)
    with pytest.raises(TypeError, match="progress"):
        dlbridge.load_file(path, progress="yes")


def test_cli_inspect(tmp_path):
    path = tmp_path / "cli.safetensors"
    st_save_numpy({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.int8)}, str(path))
    out = subprocess.run([sys.executable, "-m", "dlbridge", "inspect", str(path)], check=True,
                         capture_output=True, text=True).stdout
    assert "w" in out and "F32" in out and "(2, 3)" in out
    assert "2 tensors" in out and "27 bytes" in out
    out = subprocess.run([sys.executable, "-m", "dlbridge", "load", str(path)], check=True,
                         capture_output=True, text=True).stdout
    assert "loaded 2 tensors" in out and "GB/s" in out


def _write_raw(path, header: bytes, data: bytes = b"", length: int | None = None) -> None:
    n = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header + data)


def _header(entries: dict) -> bytes:
    return json.dumps(entries).encode()


@pytest.mark.parametrize("case", [
    "short", "huge_header", "bad_json", "bad_utf8", "duplicate", "outside", "overlap",
    "bad_length", "unknown_dtype",
])
def test_bad_files_are_clear_errors(tmp_path, case):
    path = tmp_path / f"{case}.safetensors"
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    if case == "short":
        _write_raw(path, _header({"w": ok}), b"\0" * 4)
    elif case == "huge_header":
        _write_raw(path, b"{}", length=200_000_000)
    elif case == "bad_json":
        _write_raw(path, b"{not json", b"")
    elif case == "bad_utf8":
        _write_raw(path, b'{"\xff\xfe": 1}', b"")
    elif case == "duplicate":
        body = b'{"w": %s, "w": %s}' % (json.dumps(ok).encode(), json.dumps(ok).encode())
        _write_raw(path, body, b"\0" * 8)
    elif case == "outside":
        _write_raw(path, _header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}), b"\0" * 8)
    elif case == "overlap":
        _write_raw(path, _header({"a": ok, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}),
                   b"\0" * 12)
    elif case == "bad_length":
        _write_raw(path, _header({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), b"\0" * 8)
    elif case == "unknown_dtype":
        _write_raw(path, _header({"w": {"dtype": "F13", "shape": [2], "data_offsets": [0, 8]}}), b"\0" * 8)
    before = dlbridge.memory_stats("cpu")["active_bytes"]
    with pytest.raises(ValueError) as info:
        dlbridge.load_file(path)
    assert path.name in str(info.value), str(info.value)
    if case in ("duplicate", "outside", "overlap", "bad_length", "unknown_dtype"):
        assert "w" in str(info.value) or "b" in str(info.value)
    assert dlbridge.memory_stats("cpu")["active_bytes"] == before


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.safetensors") as info:
        dlbridge.load_file(tmp_path / "missing.safetensors")
    # As open() raises it: the number, the system's text and the file as attributes.
    assert info.value.errno == errno.ENOENT
    assert info.value.strerror == os.strerror(errno.ENOENT)
    assert info.value.filename == str(tmp_path / "missing.safetensors")
    with pytest.raises(OSError):
        dlbridge.load_file(tmp_path)


@needs_cuda
def test_cuda_load_equals_safetensors(tmp_path):
    g = torch.Generator().manual_seed(6)
    tensors = {f"w{i}": torch.randn(257, 129, generator=g).to(torch.bfloat16) for i in range(5)}
    tensors["odd"] = torch.arange(3, dtype=torch.uint8)  # leaves the next tensor misaligned
    tensors["zz"] = torch.randn(1000, generator=g)
    tensors["scalar"] = torch.tensor(3.0)
    tensors["empty"] = torch.zeros(0, 3)
    path = tmp_path / "gpu.safetensors"
    st_save_torch(tensors, str(path))
    expected = st_load_torch(str(path), device="cuda:0")
    for direct in (None, True, False):
        for threads in (1, 4):
            loaded = dlbridge.load_file(path, "cuda:0", direct_io=direct, threads=threads,
                                        chunk_bytes=64 << 10)
            for name, ref in expected.items():
                got = torch.from_dlpack(loaded[name])
                assert got.device.type == "cuda" and got.dtype == ref.dtype, name
                assert torch.equal(got, ref), (name, direct, threads)
                if got.numel():  # PyTorch reports 0 as the address of an empty tensor
                    assert got.data_ptr() == loaded[name].data_ptr, "zero-copy into PyTorch"
    stats = dlbridge.memory_stats("cuda:0")
    del loaded, got
    assert dlbridge.memory_stats("cuda:0")["active_bytes"] < stats["active_bytes"]


@needs_cuda
@pytest.mark.parametrize("allocation", ["per-file", "per-tensor"])
@pytest.mark.parametrize("register", ["1", "0"])
def test_cuda_load_from_registered_pages_or_staging_agree(tmp_path, monkeypatch, register, allocation):
    """Registered file pages (opt-in) and pinned staging (the default), into one allocation per
    file (the default) or one per tensor, give the same tensors, for every selection: runs with
    gaps share pages at their edges."""
    monkeypatch.setenv("DLBRIDGE_LOAD_REGISTER", register)
    g = torch.Generator().manual_seed(9)
    tensors = {
        "a": torch.randn(1001, generator=g),
        "b": torch.arange(4097, dtype=torch.uint8),
        "c": torch.randn(7, 7, generator=g).to(torch.float64),
        "d": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "e": torch.randn(1000, 700, generator=g),  # spans three 1 MiB windows (16 chunks each)
    }
    path = tmp_path / "pages.safetensors"
    st_save_torch(tensors, str(path))
    expected = st_load_torch(str(path), device="cuda:0")
    for keys in (None, ["a", "c", "e"], ["b", "d"], ["e"]):
        for threads in (1, 3):
            loaded = dlbridge.load_file(path, "cuda:0", keys=keys, threads=threads,
                                        chunk_bytes=64 << 10, allocation=allocation)
            assert sorted(loaded) == sorted(keys or tensors)
            for name, got in loaded.items():
                assert torch.equal(torch.from_dlpack(got), expected[name]), (name, keys, threads)
            if allocation == "per-tensor":
                pointers = [got.data_ptr for got in loaded.values() if got.size]
                assert len(set(pointers)) == len(pointers)

_CUFILE_CHILD = """
import sys, torch, dlbridge
from safetensors.torch import load_file
path, direct = sys.argv[1], sys.argv[2] == "1"
try:
    expected = load_file(path, device="cuda:0")
    for keys in (None, ["a", "c"], ["b"]):
        for threads in (1, 3):
            loaded = dlbridge.load_file(path, "cuda:0", keys=keys, threads=threads,
                                        chunk_bytes=64 << 10, direct_io=direct)
            assert sorted(loaded) == sorted(keys or expected), (sorted(loaded), keys)
            for name, got in loaded.items():
                assert torch.equal(torch.from_dlpack(got), expected[name]), (name, keys, threads)
except RuntimeError as e:
    # No libcufile on this machine: asking for GPUDirect Storage must say so.
    assert "libcufile" in str(e) and "GPUDirect Storage" in str(e), e
    print("no libcufile:", e)
except OSError as e:
    # cuFile refuses the file (on the H100 machine, a container without udev, cuFile cannot
    # describe the volume, in either mode): a clear error naming the file, nothing left allocated.
    assert "cuFileHandleRegister failed" in str(e) and path in str(e), e
    assert dlbridge.memory_stats("cuda:0")["active_bytes"] == 0, dlbridge.memory_stats("cuda:0")
    print("cuFile refused the file:", e)
else:
    print("loaded through cuFile")
"""


@needs_cuda
@pytest.mark.parametrize("direct", [True, False])
def test_cuda_load_through_cufile(tmp_path, direct):
    """GPUDirect Storage asked for (DLBRIDGE_LOAD_GDS=1): cuFile reads straight into the device
    allocation and gives the same tensors, for every selection; where libcufile is missing,
    asking for it is a clear RuntimeError, and where cuFile refuses the file a clear OSError
    with nothing left allocated. (The GPU machine this was written on, a container without
    udev, refuses every file; `scripts/gpu-cufile-compat.sh` writes the udev facts cuFile asks
    for, and there every read went through cuFile.) In a child process: cuFile reads its
    settings when it opens, once per process, and without the nvidia-fs module it registers no file unless told
    to run in its compatibility mode (it reads on the host and copies), which this test asks
    for; dlbridge's calls are the same in both modes."""
    g = torch.Generator().manual_seed(11)
    tensors = {
        "a": torch.randn(1001, generator=g),
        "b": torch.arange(4097, dtype=torch.uint8),
        "c": torch.randn(300, 1000, generator=g).to(torch.bfloat16),
        "d": torch.zeros(0, 3),
    }
    path = tmp_path / "gds.safetensors"
    st_save_torch(tensors, str(path))
    env = dict(os.environ, DLBRIDGE_LOAD_GDS="1", CUFILE_FORCE_COMPAT_MODE="true")
    child = subprocess.run([sys.executable, "-c", _CUFILE_CHILD, str(path), "1" if direct else "0"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    assert any(outcome in child.stdout for outcome in
               ("loaded through cuFile", "no libcufile", "cuFile refused the file")), child.stdout


@needs_cuda
def test_cuda_load_of_a_truncated_file_is_an_error(tmp_path):
    path = tmp_path / "t.safetensors"
    st_save_torch({"w": torch.randn(1 << 20)}, str(path))
    checkpoint = dlbridge._dlbridge._Checkpoint(str(path))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 4096)
    with pytest.raises(OSError, match="truncated|ended"):
        checkpoint.load(None, "cuda:0", False, None, 2, 1 << 16, False, None)


@needs_cuda
def test_cuda_out_of_range_device(tmp_path):
    path = tmp_path / "d.safetensors"
    st_save_numpy({"w": np.zeros(4, np.float32)}, str(path))
    with pytest.raises((ValueError, RuntimeError), match="cuda:99|99"):
        dlbridge.load_file(path, "cuda:99")
