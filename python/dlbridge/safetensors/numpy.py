"""``safetensors.numpy`` over dlbridge: the same functions and signatures, so that switching is one
import (``from dlbridge.safetensors.numpy import load_file``).

>>> import numpy as np, tempfile, os
>>> from dlbridge.safetensors.numpy import load_file, save_file
>>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
>>> save_file({"w": np.arange(4, dtype=np.float32)}, path)
>>> w = load_file(path)["w"]
>>> w.tolist(), w.flags.writeable
([0.0, 1.0, 2.0, 3.0], False)

Differences from ``safetensors``: ``load_file`` hands out read-only views of the mapped file
(zero-copy) where ``safetensors`` gives writable copies; ``backend="pread"`` gives writable memory
of their own. bfloat16 and float8 tensors load as ``ml_dtypes`` arrays (``safetensors.numpy``
refuses them). ``save_file`` writes a strided array's elements in order (``safetensors`` writes
its memory as it lies, which for a transposed array is not its elements' order).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional, Union

import numpy as np

from .. import _dlbridge
from . import _copy_for, load_file as _load_file, save_file as _save_file

__all__ = ["load", "load_file", "save", "save_file"]


def load_file(filename: Union[str, "os.PathLike[str]"], *,
              backend: str = "mmap") -> Dict[str, np.ndarray]:
    """The tensors of a safetensors file (an index, a folder or a list of shards too) as NumPy
    arrays: read-only views of the mapped file, or (``backend="pread"``) writable memory of
    their own."""
    return _load_file(filename, framework="numpy", copy=_copy_for(backend), progress=False)


def load(data: bytes) -> Dict[str, np.ndarray]:
    """The tensors of a safetensors file's bytes, each in writable memory of its own."""
    _, arrays = _dlbridge._st_deserialize(data)
    return {name: np.asarray(a) for name, a in arrays.items()}


def save_file(tensor_dict: Dict[str, np.ndarray], filename: Union[str, "os.PathLike[str]"],
              metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes ``tensor_dict`` with ``metadata`` to ``filename``, atomically (arrays of another
    byte order are written little-endian, as the format says)."""
    _save_file(_native(tensor_dict), filename, metadata)


def save(tensor_dict: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """``tensor_dict`` with ``metadata`` in the safetensors format, as bytes."""
    return _dlbridge._st_serialize(_native(tensor_dict),
                                   None if metadata is None else dict(metadata))


def _native(tensor_dict: Dict[str, Any]) -> Dict[str, Any]:
    """The arrays, those of the other byte order converted to this machine's."""
    other = ">" if sys.byteorder == "little" else "<"
    return {name: a.astype(a.dtype.newbyteorder("=")) if getattr(
                getattr(a, "dtype", None), "byteorder", "=") == other else a
            for name, a in tensor_dict.items()}
