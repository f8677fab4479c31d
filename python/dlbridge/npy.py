"""NumPy ``.npy`` and ``.npz`` files onto any device, through dlbridge's loading engine (the one
``load_file`` uses for safetensors).

>>> import dlbridge, numpy as np, tempfile, os
>>> folder = tempfile.mkdtemp()
>>> np.save(os.path.join(folder, "w.npy"), np.arange(6, dtype=np.float32).reshape(2, 3))
>>> w = dlbridge.load_npy(os.path.join(folder, "w.npy"))   # a read-only view of the mapped file
>>> np.from_dlpack(w).tolist()
[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
>>> np.savez(os.path.join(folder, "ab.npz"), a=np.ones(2, np.int16), b=np.float64(3))
>>> arrays = dlbridge.load_npz(os.path.join(folder, "ab.npz"))
>>> sorted(arrays), np.from_dlpack(arrays["a"]).tolist()
(['a', 'b'], [1, 1])

What ``numpy.load`` users can expect:

* every dtype dlbridge has: ``bool``, the signed and unsigned integers, ``float16``, ``float32``,
  ``float64``, ``complex64``, ``complex128``; shapes of any rank, 0-d and empty included;
* ``fortran_order`` arrays keep NumPy's column-major strides;
* big-endian files (``'>f4'``) are byte-swapped on load, into memory of their own;
* object arrays (which only pickle can read, as ``numpy.load(allow_pickle=False)`` refuses them),
  structured, string, date and void dtypes are a ``ValueError`` naming the dtype (``np.save``
  writes ml_dtypes' ``bfloat16`` as void bytes, which cannot be told from other void data: save
  those with :func:`dlbridge.save_file`);
* ``.npz`` archives as ``np.savez`` writes them (members stored, ZIP64 for large ones); keys are
  the member names without ``.npy``, as ``numpy.load(path).files``; a compressed member
  (``np.savez_compressed``) is a ``ValueError`` saying so;
* a truncated file, a bad magic or an impossible header is a ``ValueError``; a missing file, a
  directory, a FIFO or a device an ``OSError`` (only regular files are opened, so nothing blocks).

On the CPU each array is a read-only view of the file, mapped copy-on-write, wherever its data is
aligned for its element type (``np.save`` aligns it to 64 bytes; ``np.savez`` does not align its
members, which are views where their data happens to be aligned and read-only copies elsewhere):
NumPy sees the view read-only, and a consumer that writes anyway (PyTorch does) writes a private
copy of the page, never the file. ``copy=True`` gives writable memory of its own. On CUDA the
data is read with the parallel reader and pinned staging of ``load_file``; on Metal, views of the
file's pages in shared storage, GPU copies in private storage.
"""

from __future__ import annotations

import os
from typing import Dict, Union

from . import _dlbridge
from ._dlbridge import Array
from .safetensors import DeviceLike, _device

__all__ = ["load_npy", "load_npz"]

PathLike = Union[str, "os.PathLike[str]"]


def load_npy(path: PathLike, device: DeviceLike = "cpu", *, copy: bool = False) -> Array:
    """The array of the ``.npy`` file at ``path`` (as ``numpy.load`` reads it, without pickle),
    on ``device`` (``"cpu"``, ``"cuda:0"``, ``0``, ``"metal"``, a ``torch.device``, ...).

    On the CPU a read-only view of the mapped file where its data is aligned, else a read-only
    copy; ``copy=True`` gives writable memory of its own on every device."""
    return _dlbridge._npy_load(os.fspath(path), _device(device), bool(copy))


def load_npz(path: PathLike, device: DeviceLike = "cpu", *, copy: bool = False) -> Dict[str, Array]:
    """The arrays of the ``.npz`` archive at ``path`` (``np.savez``; a ``np.savez_compressed``
    member is a ``ValueError``), on ``device``, keyed as ``numpy.load(path).files`` keys them
    (member names without ``.npy``). ``copy`` as in :func:`load_npy`."""
    arrays: Dict[str, Array] = _dlbridge._npz_load(os.fspath(path), _device(device), bool(copy))
    return arrays
