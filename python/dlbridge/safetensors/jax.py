"""``safetensors.flax`` over dlbridge, for JAX: the same functions and signatures, so that switching
is one import (``from dlbridge.safetensors.jax import load_file``; ``dlbridge.safetensors.flax``
is the same module under ``safetensors``' name).

>>> import jax.numpy as jnp, tempfile, os
>>> from dlbridge.safetensors.jax import load_file, save_file
>>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
>>> save_file({"w": jnp.arange(4.0)}, path)
>>> load_file(path)["w"].tolist()
[0.0, 1.0, 2.0, 3.0]

JAX cannot take read-only memory through DLPack (it asks for the legacy form, which cannot say
read-only), so each array is read once from the file into memory of its own, which JAX then takes
without a copy (``safetensors`` copies it twice). For JAX on a GPU, use
``dlbridge.load_file(path, "cuda:0", framework="jax")``: the loaded device memory goes to JAX as it
is.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

import jax
import jax.dlpack

from .. import _dlbridge
from . import _copy_for, load_file as _load_file, save_file as _save_file

__all__ = ["load", "load_file", "save", "save_file"]


def load_file(filename: Union[str, "os.PathLike[str]"], *,
              backend: str = "mmap") -> Dict[str, jax.Array]:
    """The tensors of a safetensors file (an index, a folder or a list of shards too) as JAX
    arrays on the CPU."""
    return _load_file(filename, framework="jax", copy=_copy_for(backend), progress=False)


def load(data: bytes) -> Dict[str, jax.Array]:
    """The tensors of a safetensors file's bytes as JAX arrays (each in memory of its own)."""
    _, arrays = _dlbridge._st_deserialize(data)
    return {name: jax.dlpack.from_dlpack(a) for name, a in arrays.items()}


def save_file(tensors: Dict[str, Any], filename: Union[str, "os.PathLike[str]"],
              metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes ``tensors`` (JAX arrays, on any device) with ``metadata`` to ``filename``,
    atomically."""
    _save_file(tensors, filename, metadata)


def save(tensors: Dict[str, Any], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """``tensors`` with ``metadata`` in the safetensors format, as bytes."""
    return _dlbridge._st_serialize(dict(tensors), None if metadata is None else dict(metadata))
