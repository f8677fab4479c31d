"""dlbridge as a drop-in for `safetensors`: the same script run against the `safetensors` package
and against dlbridge gives the same results (types, values, dtypes, metadata, errors).

- `safe_open(path, framework, device)` hands out the framework's own arrays (`"pt"`, `"np"`,
  `"flax"`/`"jax"`, `"mlx"`, `"cupy"`, `"dlbridge"`), zero-copy through DLPack where the framework
  takes the memory; `load_file(..., framework=)` too.
- `get_slice(name)[...]` takes what safetensors' slices take and reads only the bytes the part
  needs (counted by the kernel: `/proc/self/io`'s `rchar`, the bytes read(2)/pread(2) returned).
- `dlbridge.safetensors.{torch,numpy,jax,flax,mlx}` have `safetensors.<framework>`'s functions
  with the same signatures, and the files they write are the files it writes.
- `load_file(keys="name")`, `dtype=` of a type that is not floating-point, folders.

Where dlbridge differs on purpose, the test says so and checks the difference (the list a user
switching still meets is in the README)."""

from __future__ import annotations

import inspect
import json
import os

import numpy as np
import pytest

import dlbridge

safetensors = pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402

import dlbridge.safetensors.numpy  # noqa: E402
import dlbridge.safetensors.torch  # noqa: E402

CUDA = dlbridge.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
METAL = dlbridge.metal.is_available()
needs_metal = pytest.mark.skipif(not METAL, reason="needs a Metal device")
PROC_IO = os.path.exists("/proc/self/io")
needs_proc_io = pytest.mark.skipif(not PROC_IO, reason="needs Linux's /proc/self/io")


def _jax():
    return pytest.importorskip("jax")


def _mlx():
    return pytest.importorskip("mlx.core")


def _frameworks():
    """(name given to safe_open, the module its arrays come from, the array type's name)."""
    return [("pt", "torch", "Tensor"), ("torch", "torch", "Tensor"),
            ("np", "numpy", "ndarray"), ("numpy", "numpy", "ndarray"),
            ("flax", "jax", "ArrayImpl"), ("jax", "jax", "ArrayImpl"),
            ("mlx", "mlx", "array"), ("dlbridge", "dlbridge", "Array")]


def _needs(module: str) -> None:
    if module == "jax":
        _jax()
    elif module == "mlx":
        _mlx()


def _reference_framework(framework: str) -> str | None:
    """The name `safetensors.safe_open` takes for the same framework (None: it has none)."""
    return {"jax": "flax", "torch": "pt", "dlbridge": None, "cupy": None}.get(framework, framework)


def _host(x) -> np.ndarray:
    """Any framework's array as a NumPy array (bfloat16 through float32: NumPy has none)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    mod = type(x).__module__
    if mod.startswith("mlx"):
        mx = _mlx()
        return np.asarray(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)
    a = np.asarray(x)
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


def _dtype_name(x) -> str:
    """The dtype's name without the framework's prefix (`torch.float32`, `mlx.core.float32`)."""
    return str(x.dtype).rsplit(".", 1)[-1]


@pytest.fixture
def checkpoint(tmp_path):
    """A file the `safetensors` package wrote: every dtype the frameworks share, a 0-d and an
    empty tensor, and metadata."""
    g = torch.Generator().manual_seed(7)
    tensors = {
        "f32": torch.randn(6, 5, generator=g),
        "f16": torch.randn(4, 3, generator=g).half(),
        "bf16": torch.randn(3, 8, generator=g).bfloat16(),
        "i64": torch.arange(-6, 6).reshape(3, 4),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(7, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt", "who": "reference"})
    return path, tensors


# ---------------------------------------------------------------------------------------------
# safe_open: the framework's arrays


@pytest.mark.parametrize("framework,module,type_name", _frameworks())
def test_safe_open_hands_out_the_framework_s_arrays(checkpoint, framework, module, type_name):
    path, tensors = checkpoint
    _needs(module)
    ref_name = _reference_framework(framework)
    ours = dlbridge.safe_open(path, framework=framework)
    assert ours.keys() == sorted(tensors)
    assert ours.metadata() == {"format": "pt", "who": "reference"}
    if module == "numpy":
        pytest.importorskip("ml_dtypes")  # NumPy's bfloat16, for both
    for name in tensors:
        got = ours.get_tensor(name)
        assert type(got).__module__.split(".")[0] in (module, "jaxlib"), (name, type(got))
        assert type(got).__name__ == type_name, (name, type(got))
        if ref_name is None:
            np.testing.assert_array_equal(_host(got), _host(tensors[name]))
            continue
        with safetensors.safe_open(str(path), framework=ref_name) as ref:
            want = ref.get_tensor(name)
            assert type(got) is type(want), name
            assert _dtype_name(got) == _dtype_name(want), name
            assert tuple(got.shape) == tuple(want.shape), name
            np.testing.assert_array_equal(_host(got), _host(want))
            assert ours.offset_keys() == ref.offset_keys()
            assert list(ours.get_tensors()) == list(ref.get_tensors())


def test_numpy_gets_bfloat16_as_ml_dtypes(checkpoint):
    """NumPy has no bfloat16: dlbridge gives ml_dtypes' type (zero-copy), as safetensors does once
    ml_dtypes is imported (without it, safetensors fails: "data type 'bfloat16' not
    understood")."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    path, tensors = checkpoint
    with dlbridge.safe_open(path, "np") as f, safetensors.safe_open(str(path), "np") as ref:
        got, want = f.get_tensor("bf16"), ref.get_tensor("bf16")
        part = f.get_slice("bf16")[1:, 2:5]
    assert got.dtype == want.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), tensors["bf16"].float().numpy())
    np.testing.assert_array_equal(part, want[1:, 2:5])


def test_an_unknown_framework_is_a_value_error_naming_the_choices(checkpoint):
    path, _ = checkpoint
    for framework in ("tf", "tensorflow", "paddle", "PT", "", None):
        with pytest.raises(ValueError) as info:
            dlbridge.safe_open(path, framework=framework)
        for choice in ("'pt'", "'np'", "'jax'", "'flax'", "'mlx'", "'cupy'", "'dlbridge'"):
            assert choice in str(info.value), info.value
        with pytest.raises(ValueError, match="framework"):
            dlbridge.load_file(path, framework=framework)
    # The reference refuses them too (with its own error type).
    with pytest.raises(Exception):
        safetensors.safe_open(str(path), framework="bogus")


def test_devices_as_safetensors_takes_them(checkpoint):
    """`"cpu"`, None, a torch.device and a dlbridge.Device name the CPU; an int is a CUDA
    ordinal (PyTorch's `device=0`); NumPy arrays live on the CPU only (safetensors refuses a GPU
    device for NumPy too); nonsense is a clear error."""
    path, tensors = checkpoint
    for device in ("cpu", None, torch.device("cpu"), dlbridge.Device("cpu")):
        with dlbridge.safe_open(path, "pt", device=device) as f:
            assert f.get_tensor("f32").device.type == "cpu"
    for framework in ("np", "numpy"):
        for device in ("cuda:0", 0, "cuda"):
            with pytest.raises(ValueError, match=r"framework '\w+' \(numpy\): its arrays live "
                                                  "on 'cpu'"):
                dlbridge.safe_open(path, framework, device=device)
            with pytest.raises(Exception):
                safetensors.safe_open(str(path), framework, device=device)
    with pytest.raises(ValueError, match="cupy"):
        dlbridge.safe_open(path, "cupy", device="cpu")
    with pytest.raises(ValueError):
        dlbridge.safe_open(path, "pt", device="tpu:0")
    with pytest.raises(ValueError, match="negative"):
        dlbridge.safe_open(path, "pt", device=-1)
    with pytest.raises(TypeError):
        dlbridge.safe_open(path, "pt", device=True)


def test_cpu_tensors_are_views_of_one_mapping_as_in_safetensors(checkpoint):
    """PyTorch and NumPy get the mapped file's pages (no copy): tensors lie at their file offsets
    in one mapping, a slice is a view inside its tensor with PyTorch's strides, and a PyTorch
    write (it ignores the read-only flag) is seen by the other views of the same `safe_open`, as
    with `safetensors`, and by nothing else."""
    path, _ = checkpoint
    info = dlbridge._dlbridge._Checkpoint(str(path)).info
    with dlbridge.safe_open(path, "pt") as f, safetensors.safe_open(str(path), "pt") as ref:
        a, b = f.get_tensor("f32"), f.get_tensor("i64")
        assert b.data_ptr() - a.data_ptr() == info("i64")[2][0] - info("f32")[2][0]
        part = f.get_slice("f32")[2:4, 1:3]
        whole = f.get_tensor("f32")
        assert part.data_ptr() == whole.data_ptr() + (2 * 5 + 1) * 4
        assert part.stride() == whole[2:4, 1:3].stride() == ref.get_slice("f32")[2:4, 1:3].stride()
        before = whole[2, 1].item()
        part.add_(1)
        assert whole[2, 1].item() == before + 1, "one memory, as safetensors' views are"
        r_whole = ref.get_tensor("f32")
        ref.get_slice("f32")[2:4, 1:3].add_(1)
        assert r_whole[2, 1].item() == before + 1
    with dlbridge.safe_open(path, "np") as f:
        a, b = f.get_tensor("f32"), f.get_tensor("i64")
        assert not a.flags.writeable and not a.flags.owndata
        assert b.ctypes.data - a.ctypes.data == info("i64")[2][0] - info("f32")[2][0]
        part = f.get_slice("f32")[2:4, 1:3]
        assert part.ctypes.data == a.ctypes.data + (2 * 5 + 1) * 4 and part.strides == (20, 4)
    assert safetensors.torch.load_file(str(path))["f32"][2, 1].item() == before


def test_numpy_views_are_read_only_where_safetensors_gives_writable_copies(checkpoint):
    """The one difference of the NumPy path: dlbridge's arrays are the file's pages (zero-copy,
    read-only); `safetensors` gives writable copies. `backend="pread"` gives writable memory of
    its own, as safetensors does."""
    path, _ = checkpoint
    with safetensors.safe_open(str(path), "np") as ref:
        assert ref.get_tensor("f32").flags.writeable
    with dlbridge.safe_open(path, "np") as f:
        view = f.get_tensor("f32")
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0] = 1
    with dlbridge.safe_open(path, "np", backend="pread") as f:
        mine, other = f.get_tensor("f32"), f.get_tensor("f32")
        mine[0, 0] = 42
        assert other[0, 0] != 42 and mine.flags.writeable


def test_jax_gets_memory_of_its_own_read_once(checkpoint):
    """JAX cannot take read-only memory (it asks for DLPack's legacy form): on the CPU each array
    is read once into memory of its own, which JAX takes without a second copy."""
    jax = _jax()
    path, tensors = checkpoint
    for framework in ("jax", "flax"):
        with dlbridge.safe_open(path, framework) as f:
            got = f.get_tensor("f32")
            part = f.get_slice("f32")[1:3]
        assert isinstance(got, jax.Array)
        np.testing.assert_array_equal(np.asarray(got), tensors["f32"].numpy())
        np.testing.assert_array_equal(np.asarray(part), tensors["f32"][1:3].numpy())


def test_load_file_with_a_framework(checkpoint):
    path, tensors = checkpoint
    default = dlbridge.load_file(path)
    assert all(isinstance(a, dlbridge.Array) for a in default.values())
    for framework, module, type_name in _frameworks():
        _needs(module)
        loaded = dlbridge.load_file(path, framework=framework)
        assert sorted(loaded) == sorted(tensors)
        for name, want in tensors.items():
            assert type(loaded[name]).__name__ == type_name, (framework, name)
            np.testing.assert_array_equal(_host(loaded[name]), _host(want))


# ---------------------------------------------------------------------------------------------
# get_slice: what safetensors' slices take, and only the bytes they need

# Index expressions as `safetensors.safe_open(..., "pt").get_slice(name)[...]` takes them.
SLICES = ["[:]", "[1]", "[-1]", "[1:]", "[:, 1:3]", "[..., 2]", "[:, ::2]", "[1:2, 0]", "[0:10]",
          "[:, 2:1]", "[0, 0, 0]", "[()]", "[None]", "[None, 1, :, None]", "[np.int64(1)]",
          "[torch.tensor(1)]", "[-3:-1, -2]", "[:, :, 10:20]", "[1, ..., 1:4:2]"]
# ... and those it refuses, with the error type it raises; dlbridge raises the same type.
REFUSED = {"[::-1]": ValueError, "[::0]": ValueError, "[5]": IndexError, "[-4]": IndexError,
           "[0, 0, 0, 0]": IndexError, "[1.5]": IndexError}
# Indexes PyTorch takes but a part of a file is not: gathers (lists, masks) and two ellipses.
# dlbridge refuses them with an IndexError; load the tensor and index it.
NOT_PARTS = ["[[0, 1]]", "[True]", "[..., ...]"]


def _three_d(tmp_path):
    t = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    path = tmp_path / "three.safetensors"
    safetensors.torch.save_file({"a": t, "s": torch.tensor(3.0), "e": torch.zeros(0, 4)},
                                str(path))
    return path


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_slices_equal_safetensors_slices(tmp_path, backend):
    path = _three_d(tmp_path)
    with dlbridge.safe_open(path, "pt", backend=backend) as ours, \
            safetensors.safe_open(str(path), "pt") as ref:
        for key in SLICES:
            want = eval("ref.get_slice('a')" + key)
            got = eval("ours.get_slice('a')" + key)
            assert isinstance(got, torch.Tensor), key
            assert got.shape == want.shape and got.dtype == want.dtype, key
            assert torch.equal(got, want), key
        for key, error in REFUSED.items():
            with pytest.raises(error):
                eval("ref.get_slice('a')" + key)
            with pytest.raises(error):
                eval("ours.get_slice('a')" + key)
        for key in NOT_PARTS:
            eval("ref.get_slice('a')" + key)  # PyTorch indexing takes it
            with pytest.raises(IndexError):
                eval("ours.get_slice('a')" + key)
        for name, keys in (("s", ["[...]", "[()]"]), ("e", ["[:]", "[:, 1:3]", "[0:0]"])):
            for key in keys:
                want = eval(f"ref.get_slice('{name}')" + key)
                got = eval(f"ours.get_slice('{name}')" + key)
                assert got.shape == want.shape and torch.equal(got, want), (name, key)
        for key in ("[:]", "[0]"):
            with pytest.raises(IndexError):
                eval("ref.get_slice('s')" + key)
            with pytest.raises(IndexError):
                eval("ours.get_slice('s')" + key)


def test_numpy_slices_equal_safetensors_where_it_takes_them(tmp_path):
    """safetensors' NumPy slices are stricter than PyTorch's (an out-of-range bound is an error,
    not clamped): wherever it gives an array, dlbridge gives the same one."""
    path = _three_d(tmp_path)
    with dlbridge.safe_open(path, "np", backend="pread") as ours, \
            safetensors.safe_open(str(path), "np") as ref:
        compared = 0
        for key in SLICES:
            try:
                want = eval("ref.get_slice('a')" + key)
            except Exception:
                continue
            got = eval("ours.get_slice('a')" + key)
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype, key
            np.testing.assert_array_equal(got, want)
            compared += 1
        assert compared >= 10


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _wide(tmp_path):
    """A 2 MiB tensor of 64 rows of 32 KiB (8192 float32), and one after it."""
    w = torch.arange(64 * 8192, dtype=torch.float32).reshape(64, 8192)
    path = tmp_path / "wide.safetensors"
    safetensors.torch.save_file({"w": w, "z": torch.ones(1000)}, str(path))
    return path, w


# (index, bytes the part needs, runs): rows of dimension 0 are one run; a range of columns is one
# run per row (the rows' gaps, 24 KiB, are wider than the page a plan reads through).
PARTS = [("[8:24]", 16 * 32768, 1), ("[5]", 32768, 1), ("[:, 1024:3072]", 64 * 8192, 64),
         ("[40:48, 4096:]", 8 * 16384, 8), ("[-1, -8:]", 32, 1)]


@needs_proc_io
@pytest.mark.parametrize("key,needed,runs", PARTS)
def test_a_slice_reads_only_the_bytes_it_needs_on_the_cpu(tmp_path, key, needed, runs):
    """`backend="pread"`: the part is read from the file, and the kernel's count of bytes read
    grows by the part's bytes, not the tensor's 2 MiB (a whole-tensor read fails this). With
    `"mmap"` the part is a view of the mapping: nothing is read at all."""
    path, w = _wide(tmp_path)
    want = eval("w" + key)
    with dlbridge.safe_open(path, "pt", backend="pread") as f:
        f.get_slice("z")[:1]  # the first read of the process's reader, out of the count
        before = _rchar()
        got = eval("f.get_slice('w')" + key)
        read = _rchar() - before
        assert torch.equal(got, want)
        assert needed <= read <= needed + 16384, (key, read, needed)
    with dlbridge.safe_open(path, "pt") as f:
        before = _rchar()
        view = eval("f.get_slice('w')" + key)
        assert _rchar() - before < 4096, "a view reads nothing"
        assert view.data_ptr() - f.get_tensor("w").data_ptr() == (
            want.data_ptr() - w.data_ptr()), key
        assert torch.equal(view, want)


@needs_proc_io
def test_a_whole_tensor_read_is_counted(tmp_path):
    """The count the test above relies on: reading a whole tensor through the same path (a part
    covering all of it) counts all of its bytes."""
    path, w = _wide(tmp_path)
    with dlbridge.safe_open(path, "pt", backend="pread") as f:
        f.get_slice("z")[:1]
        before = _rchar()
        got = f.get_slice("w")[:]
        assert w.numel() * 4 <= _rchar() - before <= w.numel() * 4 + 16384
        assert torch.equal(got, w)


# ---------------------------------------------------------------------------------------------
# load_file: keys, dtype, folders


def test_load_file_keys_as_a_string_is_one_key(checkpoint):
    path, tensors = checkpoint
    loaded = dlbridge.load_file(path, keys="f32")
    assert list(loaded) == ["f32"]
    assert list(dlbridge.load_file(path, keys=("f32", "u8"))) == ["f32", "u8"]
    with pytest.raises(KeyError, match="f3"):
        dlbridge.load_file(path, keys="f3")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "bool", "complex64"])
def test_load_file_dtype_that_is_not_floating_point_is_a_value_error(checkpoint, dtype):
    """A float tensor loaded with `dtype=int8` was silently truncated; now refused, naming it."""
    path, _ = checkpoint
    with pytest.raises(ValueError, match=f"dtype {dtype}.*truncate"):
        dlbridge.load_file(path, dtype=dtype)
    loaded = dlbridge.load_file(path, dtype="float16")
    assert loaded["f32"].dtype == dlbridge.float16 and loaded["i64"].dtype == dlbridge.int64


def test_a_folder_loads_as_the_checkpoint_it_holds(tmp_path):
    """A Hugging Face snapshot folder: its model.safetensors.index.json, else all its
    *.safetensors in name order; an empty folder says what it looked for."""
    a = {"a": np.arange(3, dtype=np.float32)}
    b = {"b": np.ones((2, 2), np.int64)}
    safetensors.numpy.save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors.numpy.save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    loaded = dlbridge.load_file(tmp_path, framework="np")
    assert sorted(loaded) == ["a", "b"]
    np.testing.assert_array_equal(loaded["b"], b["b"])
    with dlbridge.safe_open(tmp_path, "np") as f:
        assert f.keys() == ["a", "b"] and f.metadata() is None
    index = {"metadata": {"total_size": "44"},
             "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert list(dlbridge.load_file(tmp_path)) == ["a"], "the index is preferred"
    assert dlbridge.safe_open(str(tmp_path)).metadata() == {"total_size": "44"}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holding no model.safetensors.index.json"):
        dlbridge.load_file(empty)


def test_a_file_that_is_not_safetensors_says_so(tmp_path):
    path = tmp_path / "model.bin"
    torch.save({"w": torch.zeros(3)}, str(path))
    with pytest.raises(ValueError, match="not a safetensors file"):
        dlbridge.safetensors.torch.load_file(path)
    with pytest.raises(ValueError, match="not a safetensors file"):
        dlbridge.safetensors.torch.load(path.read_bytes())
    with pytest.raises(Exception):
        safetensors.torch.load_file(str(path))


# ---------------------------------------------------------------------------------------------
# dlbridge.safetensors.<framework>: safetensors.<framework>'s functions


def _modules():
    """(ours, reference, functions both have)."""
    import importlib
    four = ["load_file", "save_file", "load", "save"]
    out = [(dlbridge.safetensors.torch, safetensors.torch, four + ["save_model", "load_model"]),
           (dlbridge.safetensors.numpy, safetensors.numpy, four)]
    pairs = [("flax", "flax", "jax"), ("jax", "flax", "jax"), ("mlx", "mlx", "mlx.core")]
    for mine, theirs, needs in pairs:
        try:
            importlib.import_module(needs)  # safetensors.mlx needs mlx.core imported first
            ref = importlib.import_module(f"safetensors.{theirs}")
        except ImportError:
            continue
        out.append((importlib.import_module(f"dlbridge.safetensors.{mine}"), ref, four))
    return out


@pytest.mark.parametrize("ours,ref,functions", _modules(), ids=lambda v: getattr(v, "__name__", ""))
def test_the_modules_have_the_reference_signatures(ours, ref, functions):
    for name in functions:
        mine = inspect.signature(getattr(ours, name)).parameters
        theirs = inspect.signature(getattr(ref, name)).parameters
        assert [(p.name, p.kind, p.default) for p in mine.values()] == \
            [(p.name, p.kind, p.default) for p in theirs.values()], name


def _sample(framework: str):
    """Tensors of `framework` and their values as NumPy arrays."""
    values = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(4, dtype=np.int64),
              "m": np.array([True, False]), "s": np.array(1.5, dtype=np.float64),
              "e": np.zeros((0, 2), np.float32)}
    if framework == "torch":
        return {k: torch.from_numpy(v.copy()) for k, v in values.items()}, values
    if framework in ("jax", "flax"):
        jnp = pytest.importorskip("jax.numpy")
        return {k: jnp.asarray(v) for k, v in values.items()}, values
    if framework == "mlx":
        mx = _mlx()
        return {k: mx.array(v) for k, v in values.items()}, values
    return {k: v.copy() for k, v in values.items()}, values


@pytest.mark.parametrize("ours,ref,functions", _modules(), ids=lambda v: getattr(v, "__name__", ""))
def test_the_same_script_against_both_modules(tmp_path, ours, ref, functions):
    """save_file → load_file, save → load, each module reading the other's files and bytes: the
    same names, types, dtypes, shapes, values and metadata."""
    framework = ours.__name__.rsplit(".", 1)[-1]
    results = {}
    for which, module in (("ref", ref), ("ours", ours)):
        tensors, values = _sample(framework)
        path = tmp_path / f"{which}.safetensors"
        module.save_file(dict(tensors), str(path), metadata={"who": which})
        data = module.save(dict(tensors), metadata={"who": which})
        results[which] = (path, data, values)
    for reader in (ref, ours):
        for which, (path, data, values) in results.items():
            reference = ref.load_file(str(path))
            for loaded in (reader.load_file(str(path)), reader.load(data)):
                assert sorted(loaded) == sorted(values), (reader.__name__, which)
                for name, want in values.items():
                    got = loaded[name]
                    assert tuple(got.shape) == want.shape, (reader.__name__, which, name)
                    np.testing.assert_array_equal(_host(got), want)
                    assert _dtype_name(got) == _dtype_name(reference[name]), name
            with safetensors.safe_open(str(path), "np") as f:
                assert f.metadata() == {"who": which}
    # Bytes: the same, byte for byte (dlbridge orders the header and the data as safetensors).
    tensors, _ = _sample(framework)
    assert ours.save(dict(tensors), {"k": "v"}) == ref.save(dict(tensors), {"k": "v"})
    # Types: the framework's own, as the reference gives them.
    path = str(results["ref"][0])
    for name, got in ours.load_file(path).items():
        assert type(got) is type(ref.load_file(path)[name]), name


def test_save_writes_the_bytes_safetensors_writes():
    """Every element type, several tensors of each, metadata: the same file, byte for byte (the
    header's order and the data's order are safetensors'). Metadata of one key: safetensors keeps
    metadata in a hash map, whose order changes from process to process (dlbridge sorts it)."""
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16,
              torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.float64, torch.int64,
              torch.uint64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
    tensors = {}
    for i, dtype in enumerate(dtypes):
        for j, shape in enumerate([(3, 2), (5,), ()]):
            raw = torch.randint(0, 255, shape, dtype=torch.uint8, generator=g)
            value = raw.to(dtype) if not dtype.is_floating_point and not dtype.is_complex else \
                torch.randn(shape, generator=g).to(dtype)
            tensors[f"{'zyx'[j]}{i:02d}"] = value
    tensors["empty"] = torch.zeros(0, 3)
    metadata = {"format": "pt"}
    assert dlbridge.safetensors.torch.save(tensors, metadata) == \
        safetensors.torch.save(tensors, metadata)
    assert dlbridge.safetensors.torch.save(tensors) == safetensors.torch.save(tensors)


def test_torch_save_refuses_what_safetensors_refuses(tmp_path):
    path = str(tmp_path / "x.safetensors")
    x = torch.zeros(4, 4)
    cases = [({"a": x, "b": x[0]}, RuntimeError), ({"a": x, "b": x}, RuntimeError),
             ({"a": 3}, ValueError), ([x], ValueError),
             ({"a": x.to_sparse()}, ValueError)]
    for tensors, error in cases:
        for module in (safetensors.torch, dlbridge.safetensors.torch):
            with pytest.raises(error):
                module.save_file(tensors, path)
            with pytest.raises(error):
                module.save(tensors)
    for module in (safetensors.torch, dlbridge.safetensors.torch):
        with pytest.raises(TypeError):
            module.save_file({"a": x}, path, metadata={"k": 1})
    # Tensors of one storage that do not overlap share nothing: both save them.
    halves = {"a": x[:2], "b": x[2:]}
    for module in (safetensors.torch, dlbridge.safetensors.torch):
        module.save_file(halves, path)
        assert sorted(module.load_file(path)) == ["a", "b"]
    # A parameter that requires grad is saved as its values.
    p = torch.nn.Parameter(torch.ones(3))
    dlbridge.safetensors.torch.save_file({"p": p}, path)
    assert torch.equal(safetensors.torch.load_file(path)["p"], torch.ones(3))


def test_non_contiguous_tensors_are_written_in_order_where_safetensors_refuses(tmp_path):
    path = str(tmp_path / "t.safetensors")
    x = torch.arange(12.0).reshape(3, 4)
    with pytest.raises(ValueError, match="non contiguous"):
        safetensors.torch.save_file({"t": x.t()}, path)
    dlbridge.safetensors.torch.save_file({"t": x.t()}, path)
    assert torch.equal(safetensors.torch.load_file(path)["t"], x.t())
    # safetensors.numpy writes a transposed array's memory, not its elements (dlbridge: elements).
    safetensors.numpy.save_file({"t": x.numpy().T}, path)
    assert not np.array_equal(safetensors.numpy.load_file(path)["t"], x.numpy().T)
    dlbridge.safetensors.numpy.save_file({"t": x.numpy().T}, path)
    np.testing.assert_array_equal(safetensors.numpy.load_file(path)["t"], x.numpy().T)


def test_numpy_save_of_another_byte_order(tmp_path):
    big = np.arange(6, dtype=">f4").reshape(2, 3)
    for module in (safetensors.numpy, dlbridge.safetensors.numpy):
        path = str(tmp_path / f"{module.__name__}.safetensors")
        module.save_file({"b": big}, path)
        got = safetensors.numpy.load_file(path)["b"]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, big)


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.norm = torch.nn.LayerNorm(3)


def test_save_model_and_load_model_handle_tied_weights_as_safetensors_does(tmp_path):
    torch.manual_seed(0)
    model = _Tied()
    files = {}
    for module in (safetensors.torch, dlbridge.safetensors.torch):
        path = str(tmp_path / f"{module.__name__}.safetensors")
        module.save_model(model, path, metadata={"format": "pt"})
        files[module] = path
        with safetensors.safe_open(path, "pt") as f:
            assert f.keys() == ["embed.weight", "norm.bias", "norm.weight"]
            assert f.metadata() == {"format": "pt", "head.weight": "embed.weight"}
    for reader in (safetensors.torch, dlbridge.safetensors.torch):
        for path in files.values():
            fresh = _Tied()
            missing, unexpected = reader.load_model(fresh, path)
            assert set(missing) == set() and list(unexpected) == []
            assert fresh.head.weight is fresh.embed.weight
            assert torch.equal(fresh.embed.weight, model.embed.weight)
    # strict: a key the model lacks is a RuntimeError naming it, as load_state_dict says it.
    extra = str(tmp_path / "extra.safetensors")
    safetensors.torch.save_file({**{k: v.clone() for k, v in model.state_dict().items()
                                    if k != "head.weight"}, "extra": torch.ones(1)}, extra)
    for reader in (safetensors.torch, dlbridge.safetensors.torch):
        with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "extra"'):
            reader.load_model(_Tied(), extra)
        missing, unexpected = reader.load_model(_Tied(), extra, strict=False)
        assert set(missing) == set() and list(unexpected) == ["extra"]


@pytest.mark.parametrize("name", ["dlbridge.safetensors", "dlbridge.safetensors.torch",
                                  "dlbridge.safetensors.numpy", "dlbridge.safetensors.jax"])
def test_the_modules_examples_run_as_written(name):
    import doctest
    import importlib
    if name.endswith("jax"):
        _jax()
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted >= 3 and result.failed == 0, result


# ---------------------------------------------------------------------------------------------
# CUDA (the GPU machine runs these)


@needs_cuda
@pytest.mark.parametrize("device", ["cuda:0", 0, "cuda"])
def test_cuda_safe_open_equals_safetensors(checkpoint, device):
    path, tensors = checkpoint
    with dlbridge.safe_open(path, "pt", device=device) as ours, \
            safetensors.safe_open(str(path), "pt", device="cuda:0") as ref:
        for name in tensors:
            got, want = ours.get_tensor(name), ref.get_tensor(name)
            assert got.device == want.device == torch.device("cuda:0"), name
            assert got.dtype == want.dtype and torch.equal(got, want), name
    with dlbridge.safe_open(path, "pt", device=torch.device("cuda", 0)) as ours:
        assert ours.get_tensor("f32").device == torch.device("cuda:0")
    reference = safetensors.torch.load_file(str(path), device="cuda:0")
    # Zero-copy: the memory is dlbridge's, handed to PyTorch as it is (PyTorch allocates none).
    torch.cuda.synchronize()
    torch_before = torch.cuda.memory_allocated(0)
    ours_before = dlbridge.memory_stats("cuda:0")["requested_bytes"]
    loaded = dlbridge.safetensors.torch.load_file(path, device="cuda:0")
    part = dlbridge.safe_open(path, "pt", device="cuda:0").get_slice("f32")[2:5]
    assert torch.cuda.memory_allocated(0) == torch_before
    assert dlbridge.memory_stats("cuda:0")["requested_bytes"] >= ours_before + sum(
        t.numel() * t.element_size() for t in tensors.values())
    for name in tensors:
        assert torch.equal(loaded[name], reference[name]), name
    assert torch.equal(part, reference["f32"][2:5])


@needs_cuda
def test_cuda_slices_equal_safetensors_slices(tmp_path):
    path = _three_d(tmp_path)
    with dlbridge.safe_open(path, "pt", device="cuda:0") as ours, \
            safetensors.safe_open(str(path), "pt") as ref:
        for key in SLICES:
            want = eval("ref.get_slice('a')" + key).to("cuda:0")
            got = eval("ours.get_slice('a')" + key)
            assert got.device == torch.device("cuda:0"), key
            assert got.shape == want.shape and torch.equal(got, want), key
        for key, error in REFUSED.items():
            with pytest.raises(error):
                eval("ours.get_slice('a')" + key)


@needs_cuda
@needs_proc_io
@pytest.mark.parametrize("key,needed,runs", PARTS)
def test_a_cuda_slice_reads_only_the_bytes_it_needs(tmp_path, monkeypatch, key, needed, runs):
    """A tensor-parallel rank's part onto the GPU: only the runs covering it are read (through
    the pinned staging reader; direct reads round each run out to whole pages), into one
    allocation of the part's size."""
    monkeypatch.setenv("DLBRIDGE_LOAD_GDS", "0")  # cuFile's reads are not read(2)s
    path, w = _wide(tmp_path)
    want = eval("w" + key).cuda()
    with dlbridge.safe_open(path, "pt", device="cuda:0") as f:
        f.get_slice("z")[:1]
        torch.cuda.synchronize()
        active = dlbridge.memory_stats("cuda:0")["requested_bytes"]
        before = _rchar()
        got = eval("f.get_slice('w')" + key)
        read = _rchar() - before
        assert torch.equal(got, want), key
        assert needed <= read <= needed + runs * 8192 + 16384, (key, read, needed)
        assert read < w.numel() * 4 // 2
        grown = dlbridge.memory_stats("cuda:0")["requested_bytes"] - active
        assert grown == needed, (key, grown, needed)


@needs_cuda
def test_cupy_takes_the_loaded_device_memory(checkpoint):
    cupy = pytest.importorskip("cupy")
    path, tensors = checkpoint
    with dlbridge.safe_open(path, "cupy", device="cuda:0") as f:
        ours = f.get_tensor("f32")
        part = f.get_slice("f32")[1:3, 2:]
        raw = dlbridge.safe_open(path, device="cuda:0").get_tensor("f32")
    assert isinstance(ours, cupy.ndarray) and isinstance(part, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(ours), tensors["f32"].numpy())
    np.testing.assert_array_equal(cupy.asnumpy(part), tensors["f32"][1:3, 2:].numpy())
    assert raw.data_ptr != ours.data.ptr  # two loads, two allocations: each handed over as is
    loaded = dlbridge.load_file(path, "cuda:0", framework="cupy", keys="f32")
    assert isinstance(loaded["f32"], cupy.ndarray)


# ---------------------------------------------------------------------------------------------
# Metal (a Mac runs these)


@needs_metal
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_metal_slices_are_views_of_the_file_s_pages_or_copies(tmp_path, backend):
    """In shared storage (the default on Apple silicon), a part is a read-only view of the mapped
    file's pages wrapped for the GPU, at its file offset; `backend="pread"` (or private storage)
    gets a copy of only its bytes. Either way, the values PyTorch's indexing gives."""
    path = _three_d(tmp_path)
    full = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    info = dlbridge.metal.device_info()
    start = dlbridge._dlbridge._Checkpoint(str(path)).info("a")[2][0]
    with dlbridge.safe_open(path, "dlbridge", device="metal:0", backend=backend) as f:
        whole = f.get_tensor("a")
        for key in SLICES:
            got = eval("f.get_slice('a')" + key)
            want = eval("full" + key)
            assert got.device == "metal:0", key
            assert tuple(got.shape) == tuple(want.shape), key
            np.testing.assert_array_equal(np.asarray(got), want.numpy())
            view = backend == "mmap" and info["default_storage"] == "shared" and got.size
            if view:
                assert got.readonly and got.is_foreign, key
                offset = np.asarray(got).ctypes.data - np.asarray(whole).ctypes.data
                assert offset == want.storage_offset() * 4, key
                assert np.asarray(got).ctypes.data % info["page_size"] == (
                    start + offset) % info["page_size"], key
            elif got.size:
                assert not got.is_foreign, key
