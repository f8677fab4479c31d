"""Loading a sharded safetensors checkpoint into PyTorch and JAX, on the CPU and on CUDA.

    python examples/load_checkpoint.py

Writes a small two-shard checkpoint with its `model.safetensors.index.json` (as Hugging Face lays
one out), then loads it:
- on the CPU into PyTorch without a copy (the tensors are views of the mapped files);
- with `safetensors`' own function names (`dlbridge.safetensors.torch.load_file`);
- one tensor-parallel rank's half of a weight, reading only that half's bytes (`get_slice`);
- into JAX;
- onto `cuda:0` into PyTorch and JAX, where there is a CUDA device (else that part says it was
  skipped, and why).
"""

import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch

import dlbridge
from dlbridge.safetensors.torch import load_file as torch_load_file


def write_checkpoint(folder: str) -> dict:
    """Two shards and their index; returns the tensors written, as NumPy arrays."""
    rng = np.random.default_rng(0)
    tensors = {
        "embed.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "layers.0.attn.q.weight": rng.standard_normal((32, 32)).astype(np.float32),
        "layers.0.mlp.up.weight": rng.standard_normal((128, 32)).astype(np.float32),
        "norm.weight": np.ones(32, dtype=np.float32),
    }
    shards = {
        "model-00001-of-00002.safetensors": ["embed.weight", "layers.0.attn.q.weight"],
        "model-00002-of-00002.safetensors": ["layers.0.mlp.up.weight", "norm.weight"],
    }
    weight_map = {}
    for shard, names in shards.items():
        dlbridge.save_file({n: tensors[n] for n in names}, os.path.join(folder, shard),
                           metadata={"format": "pt"})
        weight_map.update({n: shard for n in names})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                   "weight_map": weight_map}, f)
    return tensors


def main() -> None:
    folder = tempfile.mkdtemp()
    expected = write_checkpoint(folder)
    index = os.path.join(folder, "model.safetensors.index.json")

    # The CPU, into PyTorch: the tensors are views of the mapped files (no copy, nothing read
    # until touched). PyTorch ignores DLPack's read-only flag; a write lands in this process's
    # private copy of the page, never in the file.
    weights = dlbridge.load_file(index, framework="pt")
    for name, t in weights.items():
        assert isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), expected[name]), name
    arrays = dlbridge.load_file(index)  # dlbridge's own arrays: each says where its bytes are
    assert torch.from_dlpack(arrays["norm.weight"]).data_ptr() == arrays["norm.weight"].data_ptr
    print(f"cpu, PyTorch: {len(weights)} tensors from 2 shards, as views of the mapped files")

    # The same with safetensors' own function, a folder given in place of the index.
    state = torch_load_file(folder)
    assert sorted(state) == sorted(expected)

    # One rank of two, column-parallel: only its 64 rows of `up` are read.
    with dlbridge.safe_open(index, framework="pt") as f:
        part = f.get_slice("layers.0.mlp.up.weight")[64:]
        assert part.shape == (64, 32)
        assert np.array_equal(part.numpy(), expected["layers.0.mlp.up.weight"][64:])
    print("cpu, a rank's half of a weight: only its bytes")

    # JAX (on its CPU device).
    with jax.default_device(jax.devices("cpu")[0]):
        jweights = dlbridge.load_file(index, framework="jax")
        total = float(jnp.sum(jweights["norm.weight"]))
    assert total == 32.0
    print(f"cpu, JAX: {len(jweights)} tensors")

    if not dlbridge.cuda.is_available():
        print(f"cuda: skipped, no CUDA device: {dlbridge.cuda.unavailable_reason()}")
    else:
        # Straight into device memory through pinned staging buffers; PyTorch takes it as it is.
        gpu = dlbridge.load_file(index, device="cuda:0", framework="pt")
        for name, t in gpu.items():
            assert t.is_cuda and np.array_equal(t.cpu().numpy(), expected[name]), name
        print(f"cuda:0, PyTorch: {len(gpu)} tensors")
        if any(d.platform == "gpu" for d in jax.devices()):
            jgpu = dlbridge.load_file(index, device="cuda:0", framework="jax")
            assert np.array_equal(np.asarray(jgpu["embed.weight"]), expected["embed.weight"])
            print(f"cuda:0, JAX: {len(jgpu)} tensors")
        else:
            print("cuda:0, JAX: skipped, this JAX has no GPU backend")
    print("load_checkpoint: ok")


if __name__ == "__main__":
    main()
