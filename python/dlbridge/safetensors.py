"""safetensors checkpoints onto any device, handed out through DLPack.

>>> import dlbridge, numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
>>> dlbridge.save_file({"w": np.arange(4, dtype=np.float32)}, path, metadata={"format": "np"})
>>> weights = dlbridge.load_file(path)           # CPU: read-only views of the mapped file
>>> np.from_dlpack(weights["w"]).tolist()
[0.0, 1.0, 2.0, 3.0]

``load_file(paths, device="cuda")`` reads the files with parallel positioned reads into a few
pinned staging buffers and copies each to the GPU asynchronously while the next is read, into one
allocation per file; every tensor is a view of it and goes to PyTorch, JAX, CuPy or NumPy with no
copy (``torch.from_dlpack(weights[name])``). Files mostly in the page cache are read through it;
others with direct I/O (``direct_io=`` overrides). ``device="metal"`` reads nothing: the mapped
files are wrapped in Metal buffers, and in shared storage (the default on Apple silicon) every
tensor is a read-only view of the file's pages; private storage (``DLBRIDGE_METAL_STORAGE_MODE``)
and ``copy=True`` get copies made on the GPU.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _dlbridge
from ._dlbridge import Array

__all__ = ["load_file", "safe_open", "save_file"]

PathLike = Union[str, "os.PathLike[str]"]
Progress = Union[None, bool, Callable[[int, int], Any]]


class _Bar:
    """A progress bar (tqdm) for loads that last more than about a second, on a terminal only."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._bar: Any = None
        self._shown = 0

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            if time.monotonic() - self._start < 1.0 or done >= total:
                return
            try:
                from tqdm import tqdm
            except ImportError:  # the bar is a nicety; a load never fails for it
                return
            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                             desc="loading", file=sys.stderr, leave=False)
        self._bar.update(done - self._shown)
        self._shown = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _progress_callback(progress: Progress) -> Tuple[Optional[Callable[[int, int], Any]], Optional[_Bar]]:
    if progress is False:
        return None, None
    if progress is None or progress is True:
        if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
            return None, None
        bar = _Bar()
        return bar, bar
    if not callable(progress):
        raise TypeError(f"progress must be None, a bool or a callable, got {type(progress).__name__}")
    return progress, None


def load_file(
    path: Union[PathLike, Sequence[PathLike]],
    device: Any = "cpu",
    *,
    keys: Optional[Iterable[str]] = None,
    dtype: Any = None,
    copy: Optional[bool] = None,
    progress: Progress = None,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    direct_io: Optional[bool] = None,
    storage: Optional[str] = None,
    allocation: Optional[str] = None,
    gds: Optional[bool] = None,
) -> Dict[str, Array]:
    """Loads a safetensors file, a list of shards, or a ``model.safetensors.index.json``.

    ``device``: where the tensors go (``"cpu"``, ``"cuda:0"``, ...). On the CPU the arrays are
    read-only views of the mapped files (zero-copy) unless ``copy=True`` asks for writable
    memory; so are they on Metal in shared storage (the files' pages wrapped in Metal buffers),
    while private storage gets GPU copies; elsewhere they are views of one allocation per file.
    The files are mapped copy-on-write: a consumer that ignores the read-only flag and writes
    anyway (PyTorch does) changes this process's private copy of the page, seen by every view of
    this load and by nothing else (not the file, not another load, not another process). Where
    the system refuses such a mapping (strict overcommit), the CPU arrays are read-only copies.
    A view shows the file's pages: truncating the file under it makes reading it raise
    ``SIGBUS``, and a change written into the file in place shows through; ``copy=True`` gives
    memory of its own. Paths must be regular files (a FIFO or a device is an ``OSError``).
    ``keys``: only these tensors are read. ``dtype``: floating-point tensors are converted on the
    device after loading.
    ``progress``: ``None`` shows a bar on a terminal for loads that last over a second, ``False``
    none, a callable gets ``(bytes_done, bytes_total)``. ``threads``, ``chunk_bytes`` and
    ``direct_io`` tune the reader (defaults come from the machine and the page cache).
    ``storage``: the storage mode of the loaded memory (``"private"``, ``"shared"``,
    ``"managed"``; ``None``: the device's default, or ``DLBRIDGE_METAL_STORAGE_MODE`` on Metal).
    For devices whose tensors are read (CUDA; Metal where it declines to wrap a file):
    ``allocation="per-tensor"`` gives each tensor an allocation of its own, freed when that tensor
    goes, instead of one per file (``None``: ``DLBRIDGE_LOAD_ALLOCATION``, else ``"per-file"``);
    ``gds=True`` reads through GPUDirect Storage (cuFile) or fails naming the file, ``False``
    never (``None``: ``DLBRIDGE_LOAD_GDS``, else cuFile for cold files where the nvidia-fs module
    is loaded). ``DLBRIDGE_LOAD_REGISTER=1`` copies from the files' registered pages instead of
    pinned staging buffers.
    """
    checkpoint = _dlbridge._Checkpoint(path if isinstance(path, (str, os.PathLike)) else list(path))
    callback, bar = _progress_callback(progress)
    try:
        result: Dict[str, Array] = checkpoint.load(
            None if keys is None else list(keys), device, bool(copy), dtype, threads,
            chunk_bytes, direct_io, callback, storage, allocation, gds)
    finally:
        if bar is not None:
            bar.close()
    return result


def save_file(
    tensors: Mapping[str, Any],
    path: PathLike,
    metadata: Optional[Mapping[str, str]] = None,
) -> None:
    """Writes ``tensors`` (any arrays dlbridge imports: its own, NumPy, PyTorch, JAX, CuPy, ...,
    on any device) with ``metadata`` in the safetensors format, atomically (a temporary file in
    the same folder, renamed); ``safetensors`` reads the result. A symbolic link stays one (the
    file it leads to is replaced); an existing file keeps its permissions (and its owner, as
    root). A header over the format's 100 MB limit is a ``ValueError`` and writes nothing."""
    _dlbridge._st_save(dict(tensors), os.fspath(path), None if metadata is None else dict(metadata))


class _Slice:
    """A lazily loaded tensor of :class:`safe_open` (``get_slice``): ``get_shape()``,
    ``get_dtype()`` (the safetensors name, ``"F32"``), and indexing, which loads it."""

    def __init__(self, owner: "safe_open", name: str) -> None:
        self._owner = owner
        self._name = name

    def get_shape(self) -> List[int]:
        return list(self._owner._open().info(self._name)[1])

    def get_dtype(self) -> str:
        return str(self._owner._open().info(self._name)[0])

    def __getitem__(self, key: Any) -> Array:
        return self._owner.get_tensor(self._name)[key]


_BACKENDS = ("mmap", "pread")


class safe_open:
    """``safetensors.safe_open`` over dlbridge, with its methods and their return types:
    ``keys()`` (sorted), ``offset_keys()`` (in file order), ``metadata()`` (``None`` for a file
    without), ``get_tensor(name)``, ``get_tensors()`` and ``get_slice(name)``, each tensor a
    dlbridge :class:`Array` on ``device``. Use it as a context manager or call :meth:`close`.

    ``backend="mmap"`` (the default): CPU tensors are read-only views of the mapped file;
    ``"pread"``: memory of their own, as ``load_file(copy=True)`` gives. A missing tensor is a
    ``KeyError`` (``safetensors`` raises its own ``SafetensorError``).

    On the CPU, a write into a view by a consumer that ignores its read-only flag (PyTorch,
    through ``torch.from_dlpack``) changes this process's private copy of the page: every view
    of this ``safe_open`` sees it; the file, other opens of it and other processes do not."""

    def __init__(self, filename: Union[PathLike, Sequence[PathLike]], framework: str = "dlbridge",
                 device: Any = "cpu", *, backend: str = "mmap") -> None:
        if framework not in ("dlbridge", "dl", "numpy", "np", "pt", "torch"):
            raise ValueError(f"framework {framework!r}: dlbridge.safe_open hands out dlbridge arrays "
                             "(framework='dlbridge'); convert them with your framework's from_dlpack")
        if backend not in _BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(map(repr, _BACKENDS))}")
        target = filename if isinstance(filename, (str, os.PathLike)) else list(filename)
        self._checkpoint: Any = _dlbridge._Checkpoint(target)
        self._device = device
        self._copy = backend == "pread"

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Lets go of the files (arrays already loaded stay valid)."""
        self._checkpoint = None

    def _open(self) -> Any:
        if self._checkpoint is None:
            raise ValueError("this safe_open was closed")
        return self._checkpoint

    def keys(self) -> List[str]:
        """The tensor names, sorted."""
        return list(self._open().keys())

    def offset_keys(self) -> List[str]:
        """The tensor names in the order their bytes lie in the file (shard by shard)."""
        return list(self._open().offset_keys())

    def metadata(self) -> Optional[Dict[str, str]]:
        """The header's ``__metadata__`` strings (an index's ``metadata``); ``None`` where the
        file has none, as ``safetensors`` says."""
        metadata = self._open().metadata()
        return None if metadata is None else dict(metadata)

    def get_tensor(self, name: str) -> Array:
        """One tensor (``KeyError`` where there is none)."""
        loaded = self._open().load([name], self._device, self._copy, None, None, None, None, None)
        return loaded[name]  # type: ignore[no-any-return]

    def get_tensors(self) -> Dict[str, Array]:
        """Every tensor, by name, in the order of :meth:`offset_keys`."""
        checkpoint = self._open()
        loaded = checkpoint.load(None, self._device, self._copy, None, None, None, None, None)
        return {name: loaded[name] for name in checkpoint.offset_keys()}

    def get_slice(self, name: str) -> _Slice:
        """A tensor to index into (``KeyError`` where there is none)."""
        self._open().info(name)
        return _Slice(self, name)
