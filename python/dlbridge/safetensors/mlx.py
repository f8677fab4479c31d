"""``safetensors.mlx`` over dlbridge: the same functions and signatures, so that switching is one
import (``from dlbridge.safetensors.mlx import load_file``).

MLX copies what it is given (it has no way to take memory it did not allocate): each array is
copied once from the mapped file's pages.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

import mlx.core as mx
import numpy as np

from .. import _dlbridge
from . import _copy_for, load_file as _load_file, save_file as _save_file

__all__ = ["load", "load_file", "save", "save_file"]


def load_file(filename: Union[str, "os.PathLike[str]"], *,
              backend: str = "mmap") -> Dict[str, mx.array]:
    """The tensors of a safetensors file (an index, a folder or a list of shards too) as MLX
    arrays."""
    return _load_file(filename, framework="mlx", copy=_copy_for(backend), progress=False)


def load(data: bytes) -> Dict[str, mx.array]:
    """The tensors of a safetensors file's bytes as MLX arrays."""
    _, arrays = _dlbridge._st_deserialize(data)
    return {name: mx.array(np.asarray(a)) for name, a in arrays.items()}


def save_file(tensors: Dict[str, Any], filename: Union[str, "os.PathLike[str]"],
              metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes ``tensors`` (MLX arrays) with ``metadata`` to ``filename``, atomically."""
    _save_file(tensors, filename, metadata)


def save(tensors: Dict[str, Any], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """``tensors`` with ``metadata`` in the safetensors format, as bytes."""
    return _dlbridge._st_serialize(dict(tensors), None if metadata is None else dict(metadata))
