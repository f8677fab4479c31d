"""safetensors checkpoints onto any device, in any framework's arrays, through DLPack.

>>> import dlbridge, numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
>>> dlbridge.save_file({"w": np.arange(4, dtype=np.float32)}, path, metadata={"format": "np"})
>>> weights = dlbridge.load_file(path)           # CPU: read-only views of the mapped file
>>> np.from_dlpack(weights["w"]).tolist()
[0.0, 1.0, 2.0, 3.0]
>>> with dlbridge.safe_open(path, framework="np") as f:  # only the bytes of the part are read
...     f.get_slice("w")[1:3].tolist()
[1.0, 2.0]

``load_file(paths, device="cuda")`` reads the files with parallel positioned reads into a few
pinned staging buffers and copies each to the GPU asynchronously while the next is read, into one
allocation per file; every tensor is a view of it and goes to PyTorch, JAX, CuPy or NumPy with no
copy (``framework="pt"``, or ``torch.from_dlpack(weights[name])``). Files mostly in the page cache
are read through it; others with direct I/O (``direct_io=`` overrides). ``device="metal"`` reads
nothing: the mapped files are wrapped in Metal buffers, and in shared storage (the default on
Apple silicon) every tensor is a read-only view of the file's pages; private storage
(``DLBRIDGE_METAL_STORAGE_MODE``) and ``copy=True`` get copies made on the GPU.

The modules ``dlbridge.safetensors.torch``, ``.numpy``, ``.jax`` (and ``.flax``) and ``.mlx``
mirror ``safetensors.<framework>``: ``load_file``, ``save_file``, ``load`` and ``save`` (and
``save_model``/``load_model`` for PyTorch), so that switching is one changed import.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import (
    Any, Callable, Dict, Iterable, List, Literal, Mapping, Optional, Sequence, Tuple, Union,
    overload,
)

from .. import _dlbridge
from .._dlbridge import Array, Device, SaveHandle

__all__ = ["FRAMEWORKS", "SaveHandle", "StreamedLoad", "load_file", "safe_open", "save_file", "stream_file"]

PathLike = Union[str, "os.PathLike[str]"]
Progress = Union[None, bool, Callable[[int, int], Any]]
DeviceLike = Any
"""A device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"metal"``/``"mps"``, an integer (a CUDA
ordinal, as PyTorch takes it), a ``torch.device``, or a :class:`dlbridge.Device`."""

FRAMEWORKS: Dict[str, str] = {
    "pt": "torch", "torch": "torch",
    "np": "numpy", "numpy": "numpy",
    "jax": "jax", "flax": "jax",
    "mlx": "mlx",
    "cupy": "cupy",
    "dlbridge": "dlbridge", "dl": "dlbridge",
}
"""The frameworks ``safe_open`` and ``load_file`` hand tensors out in: each name the user may
give, and the framework it names."""

_NAMES = "'pt'/'torch', 'np'/'numpy', 'jax'/'flax', 'mlx', 'cupy' or 'dlbridge'"


def _framework(framework: str) -> str:
    """The framework `framework` names; a ValueError naming the choices for anything else."""
    if not isinstance(framework, str) or framework not in FRAMEWORKS:
        raise ValueError(f"framework {framework!r} is not one of {_NAMES}")
    return FRAMEWORKS[framework]


def _device(device: DeviceLike) -> Device:
    """`device` as a :class:`dlbridge.Device`: an integer is a CUDA ordinal (PyTorch's
    ``device=0``), ``None`` the CPU."""
    if device is None:
        return Device("cpu")
    if isinstance(device, bool):
        raise TypeError(f"device must be a string, an integer or a device, not {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device {device}: a CUDA ordinal cannot be negative")
        return Device(f"cuda:{device}")
    return Device(device)


class _Convert:
    """Hands dlbridge arrays out as `framework`'s arrays on `device`, without a copy through
    DLPack where the framework takes the memory: PyTorch, NumPy and CuPy take the loaded memory
    itself (on the CPU, read-only views of the mapped file: NumPy sees them read-only, PyTorch
    ignores the flag and writes private copy-on-write pages); JAX cannot take read-only memory
    (it asks for DLPack's legacy form, which cannot say read-only), so on the CPU it gets memory
    of its own, read once from the file; MLX copies whatever it is given."""

    def __init__(self, framework: str, device: Device) -> None:
        self.framework = _framework(framework)
        self.device = device
        kind = device.type
        on = {"numpy": ("cpu",), "cupy": ("cuda",), "mlx": ("cpu", "metal")}.get(self.framework)
        if on is not None and kind not in on:
            where = " or ".join(repr(k) for k in on)
            raise ValueError(f"device {str(device)!r} is not for framework {framework!r} "
                             f"({self.framework}): its arrays live on {where}")
        # Memory of its own where the framework cannot take the mapped file's read-only pages.
        self.copy = self.framework == "jax" and kind == "cpu"
        self._to: Callable[[Array], Any] = self._converter()

    def _converter(self) -> Callable[[Array], Any]:
        framework = self.framework
        if framework == "dlbridge":
            return lambda a: a
        if framework == "torch":
            from torch.utils.dlpack import from_dlpack
            return from_dlpack
        if framework == "numpy":
            import numpy
            # Through Array.__array__: bfloat16 and the float8 types as ml_dtypes arrays.
            return numpy.asarray
        if framework == "jax":
            import jax.dlpack
            return jax.dlpack.from_dlpack
        if framework == "mlx":
            import mlx.core
            import numpy
            return lambda a: mlx.core.array(numpy.asarray(a))
        import importlib
        cupy: Any = importlib.import_module("cupy")
        return cupy.from_dlpack  # type: ignore[no-any-return]

    def __call__(self, array: Array) -> Any:
        return self._to(array)

    def all(self, arrays: Mapping[str, Array]) -> Dict[str, Any]:
        return {name: self._to(a) for name, a in arrays.items()}


class _Bar:
    """A progress bar (tqdm) for loads that last more than about a second, on a terminal only."""

    def __init__(self, desc: str = "loading") -> None:
        self._desc = desc
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
                             desc=self._desc, file=sys.stderr, leave=False)
        self._bar.update(done - self._shown)
        self._shown = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _progress_callback(progress: Progress, desc: str = "loading") -> Tuple[Optional[Callable[[int, int], Any]], Optional[_Bar]]:
    if progress is False:
        return None, None
    if progress is None or progress is True:
        if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
            return None, None
        bar = _Bar(desc)
        return bar, bar
    if not callable(progress):
        raise TypeError(f"progress must be None, a bool or a callable, got {type(progress).__name__}")
    return progress, None


def _target(path: Union[PathLike, Sequence[PathLike]]) -> Any:
    """A path as the native checkpoint takes it: one path (a file, an index, a folder), or a list
    of shard paths."""
    if isinstance(path, (str, bytes, os.PathLike)):
        return path
    return list(path)


@overload
def load_file(
    path: Union[PathLike, Sequence[PathLike]],
    device: Union[List[Any], Tuple[Any, ...]],
    *,
    keys: Union[str, Iterable[str], None] = ...,
    dtype: Any = ...,
    copy: Optional[bool] = ...,
    framework: str = ...,
    progress: Progress = ...,
    threads: Optional[int] = ...,
    chunk_bytes: Optional[int] = ...,
    direct_io: Optional[bool] = ...,
    storage: Optional[str] = ...,
    allocation: Optional[str] = ...,
    gds: Optional[bool] = ...,
    shard: Any = ...,
    rank: Optional[int] = ...,
    world_size: Optional[int] = ...,
    group: Any = ...,
) -> List[Dict[str, Any]]: ...
@overload
def load_file(
    path: Union[PathLike, Sequence[PathLike]],
    device: DeviceLike = ...,
    *,
    keys: Union[str, Iterable[str], None] = ...,
    dtype: Any = ...,
    copy: Optional[bool] = ...,
    framework: Literal["dlbridge", "dl"] = ...,
    progress: Progress = ...,
    threads: Optional[int] = ...,
    chunk_bytes: Optional[int] = ...,
    direct_io: Optional[bool] = ...,
    storage: Optional[str] = ...,
    allocation: Optional[str] = ...,
    gds: Optional[bool] = ...,
    shard: Any = ...,
    rank: Optional[int] = ...,
    world_size: Optional[int] = ...,
    group: Any = ...,
) -> Dict[str, Array]: ...
@overload
def load_file(
    path: Union[PathLike, Sequence[PathLike]],
    device: DeviceLike = ...,
    *,
    keys: Union[str, Iterable[str], None] = ...,
    dtype: Any = ...,
    copy: Optional[bool] = ...,
    framework: str,
    progress: Progress = ...,
    threads: Optional[int] = ...,
    chunk_bytes: Optional[int] = ...,
    direct_io: Optional[bool] = ...,
    storage: Optional[str] = ...,
    allocation: Optional[str] = ...,
    gds: Optional[bool] = ...,
    shard: Any = ...,
    rank: Optional[int] = ...,
    world_size: Optional[int] = ...,
    group: Any = ...,
) -> Dict[str, Any]: ...
def load_file(
    path: Union[PathLike, Sequence[PathLike]],
    device: DeviceLike = "cpu",
    *,
    keys: Union[str, Iterable[str], None] = None,
    dtype: Any = None,
    copy: Optional[bool] = None,
    framework: str = "dlbridge",
    progress: Progress = None,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    direct_io: Optional[bool] = None,
    storage: Optional[str] = None,
    allocation: Optional[str] = None,
    gds: Optional[bool] = None,
    shard: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    group: Any = None,
) -> Any:
    """Loads a safetensors file, a list of shards, a ``model.safetensors.index.json``, or a folder
    holding a checkpoint (its ``model.safetensors.index.json``, else its one
    ``*.safetensors.index.json``, else all its ``*.safetensors`` files in name order).

    ``device``: where the tensors go (``"cpu"``, ``"cuda:0"``, ``0``, a ``torch.device``, ...).
    ``framework``: the arrays handed out, ``"dlbridge"`` (the default) or ``"pt"``/``"torch"``,
    ``"np"``/``"numpy"``, ``"jax"``/``"flax"``, ``"mlx"``, ``"cupy"``, each through DLPack
    without a copy where the framework takes the memory (JAX on the CPU gets memory of its own,
    MLX a copy). On the CPU the arrays are
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
    ``keys``: only these tensors are read (a string is one name). ``dtype``: floating-point
    tensors are converted to this floating-point type on the device after loading (a type that
    is not floating-point is a ``ValueError``: it would truncate).
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

    Tensor-parallel loads (``shard=``, a plan of :mod:`dlbridge.shard`): with ``device`` a list
    (``["cuda:0", "cuda:1"]``, also ``["cpu", "cpu"]``), this process loads rank ``i``'s parts onto
    ``device[i]`` and returns a list of dicts, one per device; with ``rank=``, ``world_size=`` and
    ``group=`` (a ``dlbridge.nccl.Communicator`` or a ``torch.distributed`` process group), one
    device, it returns rank ``rank``'s parts only, the other ranks calling it with theirs. Parts
    each one run of the file (splits of dimension 0) are read by their rank; replicated tensors
    and inner-dimension splits are read once, by one owner rank, and each other rank gets only its
    part from it (a copy between devices, or a send over the group). Each rank's part is
    ``tensor.narrow(dim, start, length)`` as ``torch.chunk`` splits it, bit for bit. ``copy``,
    ``dtype``, ``storage``, ``allocation`` and ``gds`` are for unsharded loads.
    """
    if isinstance(device, (list, tuple)) or shard is not None or rank is not None:
        from .._load import load_sharded

        names = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
        callback, bar = _progress_callback(progress)
        try:
            parts, many, _ = load_sharded(path, device, shard, rank, world_size, group, names,
                                       threads, direct_io, callback)
        finally:
            if bar is not None:
                bar.close()
        devices = device if isinstance(device, (list, tuple)) else [device]
        converted = [_Convert(framework, _device(d)).all(p) for d, p in zip(devices, parts)]
        return converted if many else converted[0]
    convert = _Convert(framework, _device(device))
    checkpoint = _dlbridge._Checkpoint(_target(path))
    names = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
    callback, bar = _progress_callback(progress)
    try:
        result: Dict[str, Array] = checkpoint.load(
            names, convert.device, bool(copy) or convert.copy, dtype, threads,
            chunk_bytes, direct_io, callback, storage, allocation, gds)
    finally:
        if bar is not None:
            bar.close()
    return convert.all(result)


_SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def _size(size: Union[int, str]) -> int:
    """Bytes of a size as Hugging Face writes them: an int, or ``"5GB"``, ``"500MB"`` (powers
    of 10), ``"2GiB"`` (powers of 2); a ``ValueError`` naming the text otherwise."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"max_shard_size must be an int or a str such as '5GB', got {type(size).__name__}")
    if isinstance(size, int):
        value = size
    else:
        text = size.strip().upper()
        number = text.rstrip("BKMGTI ")
        unit = text[len(number):].strip() or "B"
        try:
            value = int(float(number) * _SIZE_UNITS[unit])
        except (KeyError, ValueError):
            raise ValueError(f"max_shard_size {size!r} is not a size such as 5GB, 500MB or 2GiB") from None
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


@overload
def save_file(
    tensors: Mapping[str, Any],
    path: PathLike,
    metadata: Optional[Mapping[str, str]] = ...,
    *,
    max_shard_size: Union[int, str, None] = ...,
    progress: Progress = ...,
    threads: Optional[int] = ...,
    chunk_bytes: Optional[int] = ...,
    direct_io: Optional[bool] = ...,
    wait: Literal[True] = ...,
) -> None: ...


@overload
def save_file(
    tensors: Mapping[str, Any],
    path: PathLike,
    metadata: Optional[Mapping[str, str]] = ...,
    *,
    max_shard_size: Union[int, str, None] = ...,
    progress: Progress = ...,
    threads: Optional[int] = ...,
    chunk_bytes: Optional[int] = ...,
    direct_io: Optional[bool] = ...,
    wait: Literal[False],
) -> SaveHandle: ...


def save_file(
    tensors: Mapping[str, Any],
    path: PathLike,
    metadata: Optional[Mapping[str, str]] = None,
    *,
    max_shard_size: Union[int, str, None] = None,
    progress: Progress = None,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    direct_io: Optional[bool] = None,
    wait: bool = True,
) -> Optional[SaveHandle]:
    """Writes ``tensors`` (any arrays dlbridge imports: its own, NumPy, PyTorch, JAX, CuPy, ...,
    on any device) with ``metadata`` in the safetensors format, atomically and durably (a
    temporary file in the same folder, synced, renamed, and the folder synced before it returns);
    ``safetensors`` reads the result, and its bytes are those ``safetensors`` writes for the same
    tensors. A symbolic link stays one (the file it leads to is replaced); an existing file keeps
    its permissions (and its owner, as root). A header over the format's 100 MB limit is a
    ``ValueError`` and writes nothing. A full disk or another write error is an ``OSError`` and
    leaves the old file (if any) as it was; a temporary a killed process left behind
    (``.NAME.PID.N.tmp``) is removed by the next save to the same file.

    The bytes go through a ring of page-aligned buffers written by several threads around the
    page cache (``O_DIRECT``; through it where the file system refuses, as ramfs does), with the
    GIL released. Arrays of any layout are copied piece by piece straight into the ring (no
    compact copy first); CUDA arrays asynchronously, on a stream of the save's that waits for the
    caller's current stream, into pinned buffers, many copies in flight. ``threads`` (writer
    threads, and as many threads that take the buffers from dlbridge's pool as the save starts),
    ``chunk_bytes`` (one write and one buffer, a multiple of 4096) and ``direct_io=False`` tune
    that. ``progress`` as in
    :func:`load_file` (bytes written; an exception it raises is raised once the save has
    finished).

    ``wait=False`` returns at once a :class:`SaveHandle` and saves on a thread of its own: every
    byte is copied into host memory (pinned for CUDA arrays) as fast as the copies go, so that
    ``handle.wait_copied()`` returns (and ``handle.copied`` is true) long before the disk is done;
    from then on the arrays may be written or freed (not before: an optimizer step must wait for
    it). ``handle.wait()`` returns once the file is durable, raising the save's error (a full
    disk: ``OSError``, with nothing partial left, as the synchronous form); ``handle.done()``
    tells without waiting. The staging memory is the file's size in buffers of ``chunk_bytes``
    (pinned memory for CUDA arrays, of the ``"cuda_host:0"`` pool; the ``"cpu"`` pool's
    otherwise), taken from dlbridge's pool as the save starts, by several threads at once (the
    first save pins it: the kernel zeroes the pages and the driver registers them); it goes back
    to the pool after the save and serves the next one, so that from the second save on the
    copies run at the device-to-host bandwidth. ``dlbridge.empty_cache("cuda_host:0")`` (or
    ``"cpu"``) gives it back to the system; ``dlbridge.set_cache_limit(n, "cuda_host:0")`` bounds
    what the pool keeps (the CPU pool keeps at most 1 GiB unless told otherwise). Memory the pool
    refuses (``set_memory_limit``) is a ``MemoryError`` from the save, the old file left as it
    was. Saves still running when the interpreter exits are waited for.

    ``max_shard_size`` (bytes, or ``"5GB"``, ``"500MB"``, ``"2GiB"``): ``path`` is a folder
    (created where missing) that receives a checkpoint as Hugging Face's ``save_pretrained``
    writes one: shards ``model-00001-of-00003.safetensors`` of at most that much tensor data (the
    tensors in the given order; one larger than the limit alone in its shard), written in
    parallel, and ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``); one
    shard is ``model.safetensors`` without an index. The shards are renamed into place only once
    all are written, the index last; then the checkpoint files of an earlier save that the new
    one does not name (shards of another count, an index or ``model.safetensors`` left from a
    save of the other shape) are removed, as ``huggingface_hub.save_torch_state_dict`` does;
    no other file is touched. :func:`load_file` takes the index or the folder."""
    shard = None if max_shard_size is None else _size(max_shard_size)
    args = (dict(tensors), os.fspath(path), None if metadata is None else dict(metadata), shard)
    if not wait:
        if progress is not None and progress is not False and not callable(progress):
            raise TypeError("save_file(wait=False) takes a callable progress (no bar)")
        handle = _dlbridge._st_save_async(
            *args, progress if callable(progress) else None, threads, chunk_bytes, direct_io)
        _running[:] = [h for h in _running if not h.done()] + [handle]
        return handle
    callback, bar = _progress_callback(progress, "saving")
    try:
        _dlbridge._st_save(*args, callback, threads, chunk_bytes, direct_io)
    finally:
        if bar is not None:
            bar.close()
    return None


# Asynchronous saves not known to have ended: waited for when the interpreter exits, so that a
# script that returns right after `save_file(..., wait=False)` still leaves its file.
_running: List[SaveHandle] = []


@atexit.register
def _wait_for_saves() -> None:
    for handle in _running:
        try:
            handle.wait()
        except BaseException:
            pass


class _Slice:
    """A tensor of :class:`safe_open` not yet read (``get_slice``): ``get_shape()``,
    ``get_dtype()`` (the safetensors name, ``"F32"``), and indexing, which reads only the bytes
    the part needs, on the ``safe_open``'s device, in its framework.

    The index is basic indexing, as NumPy and PyTorch take it: integers (negative ones count from
    the end; out of range an ``IndexError``), slices (open, negative bounds, bounds past the end
    clamped, a positive step; a negative step is a ``ValueError``), ``...`` and ``None``. On the
    CPU the part is a view of the mapped file with its strides (``backend="pread"``: a compact
    copy of only its bytes); on a GPU only the byte ranges covering it are read (one run for rows
    of dimension 0, one per row for a range of an inner dimension), into one allocation."""

    def __init__(self, owner: "safe_open", name: str) -> None:
        self._owner = owner
        self._name = name

    def get_shape(self) -> List[int]:
        return list(self._owner._open().info(self._name)[1])

    def get_dtype(self) -> str:
        return str(self._owner._open().info(self._name)[0])

    def __getitem__(self, key: Any) -> Any:
        owner = self._owner
        part = owner._open().load_part(self._name, key, owner._convert.device, owner._copy)
        return owner._convert(part)


_BACKENDS = ("mmap", "pread")


def _copy_for(backend: str) -> bool:
    """Whether `backend` asks for memory of its own (``"pread"``) or views (``"mmap"``)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(map(repr, _BACKENDS))}")
    return backend == "pread"


class safe_open:
    """``safetensors.safe_open`` over dlbridge, with its methods and their return types:
    ``keys()`` (sorted), ``offset_keys()`` (in file order), ``metadata()`` (``None`` for a file
    without), ``get_tensor(name)``, ``get_tensors()`` and ``get_slice(name)`` (indexing it reads
    only the part's bytes), each tensor in ``framework``'s arrays (``"pt"``/``"torch"``,
    ``"np"``/``"numpy"``, ``"jax"``/``"flax"``, ``"mlx"``, ``"cupy"``, or ``"dlbridge"``, the
    default) on ``device`` (``"cpu"``, ``"cuda:0"``, ``0``, a ``torch.device``, ``"mps"``...).
    Use it as a context manager or call :meth:`close`. It also opens an index, a folder or a list
    of shards.

    ``backend="mmap"`` (the default): CPU tensors are read-only views of the mapped file;
    ``"pread"``: memory of their own, as ``load_file(copy=True)`` gives. A missing tensor is a
    ``KeyError`` (``safetensors`` raises its own ``SafetensorError``).

    On the CPU, a write into a view by a consumer that ignores its read-only flag (PyTorch,
    through ``torch.from_dlpack``) changes this process's private copy of the page: every view
    of this ``safe_open`` sees it; the file, other opens of it and other processes do not."""

    def __init__(self, filename: Union[PathLike, Sequence[PathLike]], framework: str = "dlbridge",
                 device: DeviceLike = "cpu", *, backend: str = "mmap") -> None:
        self._checkpoint: Any = None
        self._convert = _Convert(framework, _device(device))
        self._copy = _copy_for(backend) or self._convert.copy
        self._checkpoint = _dlbridge._Checkpoint(_target(filename))

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

    def get_tensor(self, name: str) -> Any:
        """One tensor (``KeyError`` where there is none)."""
        device = self._convert.device
        loaded = self._open().load([name], device, self._copy, None, None, None, None, None)
        return self._convert(loaded[name])

    def get_tensors(self) -> Dict[str, Any]:
        """Every tensor, by name, in the order of :meth:`offset_keys`."""
        checkpoint = self._open()
        device = self._convert.device
        loaded = checkpoint.load(None, device, self._copy, None, None, None, None, None)
        return {name: self._convert(loaded[name]) for name in checkpoint.offset_keys()}

    def get_slice(self, name: str) -> _Slice:
        """A tensor to index into, reading only what the index selects (``KeyError`` where there
        is none)."""
        self._open().info(name)
        return _Slice(self, name)


from ._stream import StreamedLoad, stream_file  # noqa: E402  (it uses the helpers above)
