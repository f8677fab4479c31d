"""`dlbridge.load_into`: a checkpoint read into existing memory (PyTorch state dicts and modules,
NumPy and dlbridge arrays), compared bit for bit with `safetensors`; PyTorch modules on the `meta`
device created once on the target device; `strict=`, shape and read-only errors raised before
anything is written. The CUDA cases run on a GPU machine and skip elsewhere.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import dlbridge

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

cuda = dlbridge.cuda.is_available() and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not cuda, reason="needs a CUDA device (and PyTorch with CUDA)")


def _bits(t):
    """`t`'s bytes, to compare bit for bit (NaN payloads and signed zeros included)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).tolist() if t.dim() else t.reshape(1).view(torch.uint8).tolist()


def _checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(10, 6, generator=g),
        "layers.0.q.weight": torch.randn(6, 6, generator=g).to(torch.bfloat16),
        "layers.0.o.weight": torch.randn(6, 6, generator=g).to(torch.float16),
        "layers.0.norm.weight": torch.randn(6, generator=g),
        "step": torch.tensor(7, dtype=torch.int64),
        "scale": torch.tensor(0.5),
        "empty": torch.zeros(0, 4),
    }
    path = os.path.join(tmp_path, "model.safetensors")
    st.save_file(tensors, path)
    return path, st.load_file(path)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.q = torch.nn.Linear(6, 6, bias=False, dtype=torch.bfloat16)
        self.o = torch.nn.Linear(6, 6, bias=False, dtype=torch.float16)
        self.norm = torch.nn.Parameter(torch.ones(6), requires_grad=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.zeros(()))
        self.register_buffer("empty", torch.zeros(0, 4))

    def names(self):
        return {"embed.weight": "embed.weight", "q.weight": "layers.0.q.weight",
                "o.weight": "layers.0.o.weight", "norm": "layers.0.norm.weight",
                "step": "step", "scale": "scale", "empty": "empty"}


def _renamed(path, tmp_path):
    """The checkpoint under Model's names."""
    want = st.load_file(path)
    names = Model().names()
    out = os.path.join(tmp_path, "renamed.safetensors")
    st.save_file({ours: want[theirs].contiguous() for ours, theirs in names.items()}, out)
    return out, st.load_file(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_cuda)])
def test_state_dict_targets_are_filled_in_place_bit_exact(tmp_path, device):
    path, want = _checkpoint(tmp_path)
    targets = {k: torch.full_like(v, 3, device=device) for k, v in want.items()}
    ptrs = {k: v.data_ptr() for k, v in targets.items()}
    result = dlbridge.load_into(targets, path)
    assert result == dlbridge.IncompatibleKeys([], [])
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in want.items():
        assert targets[k].data_ptr() == ptrs[k], k
        assert targets[k].dtype == v.dtype and targets[k].shape == v.shape
        assert _bits(targets[k]) == _bits(v), k


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_cuda)])
def test_strided_and_cast_targets(tmp_path, device):
    """A transposed target keeps its strides (and the memory around a strided one is untouched);
    a target of another dtype gets the elements converted as `copy_` converts them."""
    path, want = _checkpoint(tmp_path)
    transposed = torch.zeros(6, 10, device=device).t()
    wide = torch.zeros(6, 12, dtype=torch.bfloat16, device=device)
    every_other = wide[:, ::2]
    as_f32 = torch.zeros(6, 6, device=device)
    as_f64 = torch.zeros(6, dtype=torch.float64, device=device)
    targets = {"embed.weight": transposed, "layers.0.q.weight": every_other,
               "layers.0.o.weight": as_f32, "layers.0.norm.weight": as_f64}
    result = dlbridge.load_into(targets, path, strict=False)
    assert sorted(result.unexpected_keys) == ["empty", "scale", "step"]
    assert transposed.stride() == (1, 10)
    assert _bits(transposed) == _bits(want["embed.weight"])
    assert _bits(every_other) == _bits(want["layers.0.q.weight"])
    assert torch.count_nonzero(wide[:, 1::2]) == 0
    assert torch.equal(as_f32.cpu(), want["layers.0.o.weight"].float())
    assert torch.equal(as_f64.cpu(), want["layers.0.norm.weight"].double())


def test_numpy_and_dlbridge_targets(tmp_path):
    path, want = _checkpoint(tmp_path)
    a = np.zeros((10, 6), dtype=np.float32)
    b = dlbridge.zeros((6,), dtype="float32")
    dlbridge.load_into({"embed.weight": a, "layers.0.norm.weight": b}, path, strict=False)
    np.testing.assert_array_equal(a, want["embed.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(b), want["layers.0.norm.weight"].numpy())
    read_only = np.zeros((6,), dtype=np.float32)
    read_only.flags.writeable = False
    with pytest.raises(BufferError):
        dlbridge.load_into({"layers.0.norm.weight": read_only}, path, strict=False)


def test_strict_lists_the_keys_and_writes_nothing(tmp_path):
    path, want = _checkpoint(tmp_path)
    targets = {"embed.weight": torch.zeros(10, 6), "not.there": torch.zeros(2)}
    with pytest.raises(KeyError) as e:
        dlbridge.load_into(targets, path)
    message = str(e.value)
    assert "not.there" in message and "layers.0.q.weight" in message and "step" in message
    assert torch.count_nonzero(targets["embed.weight"]) == 0, "nothing written before the error"
    result = dlbridge.load_into(targets, path, strict=False)
    assert result.missing_keys == ["not.there"]
    assert sorted(result.unexpected_keys) == sorted(k for k in want if k != "embed.weight")
    assert torch.equal(targets["embed.weight"], want["embed.weight"])


def test_a_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    path, _ = _checkpoint(tmp_path)
    good = torch.zeros(6)
    targets = {"layers.0.norm.weight": good, "embed.weight": torch.zeros(10, 5)}
    with pytest.raises(ValueError, match=r"'embed.weight'.*\(10, 5\).*\(10, 6\)"):
        dlbridge.load_into(targets, path, strict=False)
    assert torch.count_nonzero(good) == 0, "checked before anything is read"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_cuda)])
def test_a_meta_module_is_created_once_on_the_device_and_filled(tmp_path, device):
    path, _ = _checkpoint(tmp_path)
    path, want = _renamed(path, tmp_path)
    with torch.device("meta"):
        model = Model()
    before = {n: type(p) for n, p in model.named_parameters()}
    result = dlbridge.load_into(model, path, device=device)
    assert result == ([], [])
    for name, p in model.named_parameters():
        assert type(p) is before[name] is torch.nn.Parameter, name
        assert p.device.type == device.split(":")[0]
    assert model.norm.requires_grad is False and model.q.weight.requires_grad is True
    state = model.state_dict()
    for k, v in want.items():
        assert _bits(state[k]) == _bits(v), k
    # The module works.
    x = torch.tensor([1, 2], device=device)
    assert model.embed(x).shape == (2, 6)


def test_meta_tied_weights_stay_tied(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 6)
            self.head = torch.nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight

    path, want = _checkpoint(tmp_path)
    with torch.device("meta"):
        model = Tied()
    result = dlbridge.load_into(model, path, device="cpu", strict=False)
    assert model.head.weight is model.embed.weight
    assert result.missing_keys == ["head.weight"]
    assert torch.equal(model.embed.weight, want["embed.weight"])


def test_a_meta_module_without_a_device_is_a_clear_error(tmp_path):
    path, _ = _checkpoint(tmp_path)
    with torch.device("meta"):
        model = Model()
    with pytest.raises(ValueError, match="meta.*device="):
        dlbridge.load_into(model, path)


def test_targets_of_the_wrong_kind(tmp_path):
    path, _ = _checkpoint(tmp_path)
    with pytest.raises(TypeError, match="mapping"):
        dlbridge.load_into([1, 2], path)


@needs_cuda
def test_no_device_memory_beyond_the_parameters(tmp_path):
    """A module on `meta` loaded onto the GPU: PyTorch's peak is the parameters, and dlbridge's pool
    allocates nothing on the device (compact targets of the checkpoint's dtype are read into
    through pinned staging)."""
    path, _ = _checkpoint(tmp_path)
    path, want = _renamed(path, tmp_path)
    with torch.device("meta"):
        model = Model()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    dlbridge.reset_peak_memory("cuda:0")
    base = torch.cuda.memory_allocated()
    before = dlbridge.memory_stats("cuda:0")
    dlbridge.load_into(model, path, device="cuda:0")
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    after = dlbridge.memory_stats("cuda:0")
    assert torch.cuda.max_memory_allocated() - base <= params + 512 * len(want)
    assert after["peak_active_bytes"] == before["active_bytes"], (before, after)


def test_targets_that_share_memory_are_refused_and_tied_names_filled_once(tmp_path):
    path, want = _checkpoint(tmp_path)
    buf = torch.zeros(10, 6)
    overlapping = {"embed.weight": buf, "layers.0.norm.weight": buf[0]}
    with pytest.raises(ValueError, match="share memory"):
        dlbridge.load_into(overlapping, path, strict=False)
    # One tensor under two names the checkpoint both has: filled once, from the first name.
    tied = os.path.join(tmp_path, "tied.safetensors")
    st.save_file({"a": want["embed.weight"], "b": want["embed.weight"].clone()}, tied)
    same = torch.zeros(10, 6)
    assert dlbridge.load_into({"a": same, "b": same}, tied) == ([], [])
    assert torch.equal(same, want["embed.weight"])


def test_progress_reaches_the_total(tmp_path):
    path, want = _checkpoint(tmp_path)
    seen = []
    targets = {k: torch.zeros_like(v) for k, v in want.items()}
    dlbridge.load_into(targets, path, progress=lambda done, total: seen.append((done, total)))
    total = sum(v.numel() * v.element_size() for v in want.values())
    assert seen and seen[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_compact_targets_take_no_memory_of_dlbridge(tmp_path):
    """Compact targets of the checkpoint's dtype are read into in place: dlbridge's pool allocates
    nothing during the load (a strided target, read on its device first, does)."""
    path, want = _checkpoint(tmp_path)
    targets = {k: torch.zeros_like(v) for k, v in want.items()}
    dlbridge.empty_cache("cpu")
    dlbridge.reset_peak_memory("cpu")
    before = dlbridge.memory_stats("cpu")
    dlbridge.load_into(targets, path)
    after = dlbridge.memory_stats("cpu")
    assert after["peak_active_bytes"] == before["active_bytes"], (before, after)
    assert after["allocations"] == before["allocations"], (before, after)
    cast = {"embed.weight": torch.zeros(10, 6, dtype=torch.float64)}
    dlbridge.load_into(cast, path, strict=False)
    assert dlbridge.memory_stats("cpu")["allocations"] > after["allocations"]
