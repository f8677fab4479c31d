"""CUDA devices, streams and events.

dlbridge enqueues its work (copies, zero-fills) on the calling thread's *current stream* of each
device: the legacy default stream unless set with :func:`stream`. DLPack exchange follows the
array API standard: as a producer, ``Array.__dlpack__(stream=s)`` makes dlbridge's pending work
visible on the consumer's stream ``s`` with an event and a stream wait (no host synchronization);
as a consumer, ``dlbridge.from_dlpack(x)`` passes its current stream to ``x.__dlpack__``.

>>> import dlbridge, torch
>>> s = torch.cuda.Stream()
>>> with dlbridge.cuda.stream(s):           # work on PyTorch's stream
...     a = dlbridge.zeros((4,), device="cuda:0")
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from . import _dlbridge
from ._dlbridge import _cuda_device_count as device_count
from ._dlbridge import _cuda_is_available as is_available

Stream = _dlbridge.Stream
Event = _dlbridge.Event

__all__ = [
    "Event",
    "Stream",
    "current_stream",
    "device_count",
    "device_name",
    "driver_version",
    "is_available",
    "mem_get_info",
    "stream",
    "synchronize",
    "unavailable_reason",
]


def unavailable_reason() -> str:
    """Why CUDA cannot be used here (an empty string when it can)."""
    return _dlbridge._cuda_unavailable_reason()


def driver_version() -> "tuple[int, int]":
    """The CUDA version of the installed driver, e.g. ``(12, 4)``; ``RuntimeError`` where no
    driver loads."""
    return _dlbridge._cuda_driver_version()


def synchronize(device: Any = None) -> None:
    """Waits for all work on a CUDA device (default: device 0)."""
    _dlbridge._cuda_synchronize(device)


def device_name(device: Any = None) -> str:
    """The device's name, e.g. ``NVIDIA H200``."""
    return _dlbridge._cuda_device_name(device)


def mem_get_info(device: Any = None) -> "tuple[int, int]":
    """``(free, total)`` bytes of the device's memory, as the driver reports them."""
    return _dlbridge._cuda_mem_get_info(device)


def current_stream(device: Any = None) -> Stream:
    """The calling thread's current stream on a device (the legacy default stream unless set)."""
    handle = _dlbridge._cuda_current_stream(device)
    return Stream.from_handle(handle or 1, device)


def _handle_of(s: Any) -> int:
    """The raw handle of a dlbridge, PyTorch or CuPy stream, or of an int handle."""
    if isinstance(s, Stream):
        return s.handle
    if isinstance(s, bool):
        raise TypeError("a stream is a dlbridge.cuda.Stream, a stream object or an int handle")
    if isinstance(s, int):
        if s <= 0:
            raise ValueError(
                f"stream handle {s} is not valid: pass 1 for the legacy default stream, 2 for the "
                "per-thread default stream, or a CUstream handle"
            )
        return s
    for attr in ("cuda_stream", "ptr"):  # PyTorch, CuPy
        handle = getattr(s, attr, None)
        if isinstance(handle, int):
            return handle
    raise TypeError(
        f"{type(s).__name__} is not a stream: expected a dlbridge.cuda.Stream, an object with "
        "`cuda_stream` or `ptr`, or an int handle"
    )


def _device_of(s: Any, device: Any) -> Any:
    if device is not None:
        return device
    if isinstance(s, Stream):
        return s.device
    index = getattr(getattr(s, "device", None), "index", None)  # torch.cuda.Stream
    if isinstance(index, int):
        return index
    dev = getattr(s, "device_id", None)  # cupy.cuda.Stream
    if isinstance(dev, int):
        return dev
    return 0


@contextlib.contextmanager
def stream(s: Any, device: Any = None) -> Iterator[Any]:
    """Makes ``s`` the calling thread's current stream on its device inside the ``with`` block.

    ``s`` is a :class:`Stream`, another library's stream object (``torch.cuda.Stream``,
    ``cupy.cuda.Stream``) or a raw handle (1: legacy default, 2: per-thread default). Another
    library's stream must outlive the arrays allocated while it is current (dlbridge's caching
    pool orders their reuse after work on it); dlbridge's own streams are never destroyed, only
    recycled. ``None`` leaves the current stream as it is.
    """
    if s is None:
        yield s
        return
    handle = _handle_of(s)
    dev = _device_of(s, device)
    previous = _dlbridge._cuda_set_stream(handle, dev)
    try:
        yield s
    finally:
        _dlbridge._cuda_set_stream(previous, dev)
