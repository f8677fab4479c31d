"""Arrays sent between processes and machines over NCCL's point-to-point operations.

Where two processes cannot map each other's memory (two GPUs that do not share an address space
with the sender, two hosts), arrays travel as copies: :class:`Communicator` joins an NCCL
communicator and sends any dlbridge arrays on its GPU to another rank, which receives them into
**one** new block of its own GPU memory from the caching pool. Arrays carved from one driver
allocation (a pool slab, one weight matrix and its views) are merged into a few contiguous runs,
so a thousand small arrays cost one NCCL operation, not a thousand; views that shared bytes on the
sender share them on the receiver::

    # rank 0                                   # rank 1
    uid = dlbridge.nccl.unique_id()            # (uid handed over by any means)
    comm = Communicator(uid, 2, 0, device=0)   comm = Communicator(uid, 2, 1, device=0)
    runs, views = comm.plan(arrays)            # (runs, views handed over)
    comm.send(arrays, peer=1, runs=runs)       out = comm.recv(runs, views, peer=0)

Both sides work on the communicator's own stream, after the work queued on the calling
thread's current stream of its GPU, and return once the transfer is done; a peer that fails or does not take part within ``timeout`` seconds
aborts the communicator and raises ``RuntimeError`` instead of hanging. ``dlbridge.ray`` builds
its transport between GPUs and hosts on this (``tensor_transport="dlbridge_nccl"``).

``libnccl`` is opened on first use: ``DLBRIDGE_NCCL_LIBRARY`` if set, else the copy the
``nvidia-nccl-cu12``/``-cu13`` wheel installs (PyTorch's CUDA wheels bring it), else
``libnccl.so.2`` from the loader's path.
"""

from __future__ import annotations

import glob
import os
import sys
import threading
from typing import Any, Optional

from . import _dlbridge

__all__ = ["Communicator", "is_available", "unique_id", "version"]

_paths_added = False
_paths_lock = threading.Lock()


def _add_wheel_paths() -> None:
    """Tells the core where pip's NCCL wheels put ``libnccl.so.2`` (once)."""
    global _paths_added
    with _paths_lock:
        if _paths_added:
            return
        for entry in sys.path:
            if not entry or not os.path.isdir(os.path.join(entry, "nvidia")):
                continue
            for lib in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnccl.so*"))):
                _dlbridge._nccl_add_library_path(lib)
        _paths_added = True


def is_available() -> bool:
    """Whether NCCL can be loaded in this process."""
    try:
        version()
    except Exception:
        return False
    return True


def version() -> "tuple[int, int, int]":
    """NCCL's version; raises ``RuntimeError`` saying why where it cannot be loaded."""
    _add_wheel_paths()
    major, minor, patch = _dlbridge._nccl_version()
    return (major, minor, patch)


def unique_id() -> bytes:
    """A new communicator id (128 bytes) for :class:`Communicator`. Make it in the process of
    rank 0, which serves the bootstrap while the ranks join."""
    _add_wheel_paths()
    return _dlbridge._nccl_unique_id()


_DEFAULT = object()


def Communicator(
    unique_id: bytes, size: int, rank: int, device: Any = 0, timeout: Any = _DEFAULT
) -> _dlbridge.NcclCommunicator:
    """Joins the communicator ``unique_id`` as ``rank`` of ``size`` on CUDA device ``device`` (an
    ordinal, ``"cuda:N"`` or a :class:`dlbridge.Device`); waits until every rank has joined.
    With NCCL 2.14 or later, a join not finished within ``timeout`` seconds (default:
    ``DLBRIDGE_NCCL_TIMEOUT``, else 300; ``None``: no limit) aborts and raises ``RuntimeError``
    (a rank that never came); older NCCL waits with no limit. Returns a ``NcclCommunicator`` with
    ``plan(arrays)``, ``send(arrays, peer, runs=None, timeout=None)`` and ``recv(runs, views,
    peer, timeout=None)``."""
    _add_wheel_paths()
    if timeout is _DEFAULT:
        timeout = _timeout()
    return _dlbridge.NcclCommunicator(
        bytes(unique_id), int(size), int(rank), _ordinal(device), None if timeout is None else float(timeout)
    )


def _ordinal(device: Any) -> int:
    if isinstance(device, int):
        return device
    d = _dlbridge.Device(device) if isinstance(device, str) else device
    if getattr(d, "type", None) != "cuda":
        raise ValueError(f"NCCL runs on CUDA devices, not on {device!r}")
    return int(d.index)


def plan(arrays: "list[Any]") -> "tuple[list[tuple[int, int]], list[tuple[Any, ...]]]":
    """The runs and views CUDA ``arrays`` travel as (without a communicator)."""
    return _dlbridge._nccl_plan(list(arrays))


def _timeout(default: Optional[float] = 300.0) -> Optional[float]:
    """The transfer timeout in seconds: ``DLBRIDGE_NCCL_TIMEOUT`` (``0`` or ``none``: wait
    forever), else ``default``."""
    raw = os.environ.get("DLBRIDGE_NCCL_TIMEOUT")
    if raw is None:
        return default
    if raw.strip().lower() in ("0", "none", ""):
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not (0 < seconds < float("inf")):
        raise ValueError(
            f"DLBRIDGE_NCCL_TIMEOUT={raw!r} is not a positive number of seconds (0 or none: wait "
            f"forever)"
        )
    return seconds
