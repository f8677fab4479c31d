"""``UnifiedBuffer``: a host array and a device array kept coherent by state tracking.

>>> import dlbridge
>>> ub = dlbridge.UnifiedBuffer((4,), "float32", device="cpu")
>>> ub.host[:] = 1.0; ub.mark_host_dirty()
>>> ub.device.tolist()                     # the CPU shares memory: nothing was copied
[1.0, 1.0, 1.0, 1.0]
>>> ub.transfers
{'host_to_device': 0, 'device_to_host': 0}

States: ``uninitialized`` (nothing written yet), ``host_only`` / ``device_only`` (only one side
has been used), ``synchronized`` (both sides hold the same values), ``host_dirty`` /
``device_dirty`` (one side was written since the last synchronization). ``host`` and ``device``
copy only when the other side is newer. After writing through a view, say so with
:meth:`UnifiedBuffer.mark_host_dirty` or :meth:`UnifiedBuffer.mark_device_dirty`.

Where the host and the device share memory — the CPU, CUDA managed memory
(``storage="managed"``), Metal shared storage on Apple silicon — both views are the same memory
and nothing is ever copied; ``is_shared`` says which case applies.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

from . import _dlbridge, cuda, metal
from ._dlbridge import Array, Device

__all__ = ["UnifiedBuffer"]

UNINITIALIZED = "uninitialized"
HOST_ONLY = "host_only"
DEVICE_ONLY = "device_only"
SYNCHRONIZED = "synchronized"
HOST_DIRTY = "host_dirty"
DEVICE_DIRTY = "device_dirty"


def _numpy_view(a: Array) -> Any:
    """A NumPy view of host-addressable memory (never a silent copy)."""
    import numpy as np

    return np.asarray(a, copy=False)


class UnifiedBuffer:
    """A host and a device copy of one array, copied only when the other side is newer.

    ``device`` is any device string (default: the best available, as ``dlbridge.Backend()``);
    ``pinned=True`` puts the host side of a CUDA buffer in page-locked memory (faster copies);
    ``storage="managed"`` on CUDA, or Metal's default shared storage, makes both sides one
    allocation.
    """

    def __init__(
        self,
        shape: Any,
        dtype: Any = "float32",
        device: Optional[Union[str, Device]] = None,
        pinned: bool = False,
        storage: Optional[str] = None,
    ) -> None:
        if device is None:
            from .backend import Backend

            device = Backend().device
        dev = device if isinstance(device, Device) else Device(device)
        kind = dev.type
        self._state = UNINITIALIZED
        self._transfers = {"host_to_device": 0, "device_to_host": 0}
        self._device_array = _dlbridge.empty(shape, dtype, device=dev, storage=storage)
        placed = self._device_array.device
        # Metal managed storage keeps separate host and GPU copies (the driver synchronizes them
        # on request), so only shared storage is one memory for both sides.
        self._shared = placed.type in ("cpu", "cuda_managed") or (
            kind == "metal" and self._device_array.storage == "shared"
        )
        if pinned and kind != "cuda":
            raise ValueError(f"pinned host memory is a CUDA notion; this buffer is on {dev}")
        if self._shared:
            self._host_backing = self._device_array
        elif pinned:
            self._host_backing = _dlbridge.empty(
                shape, dtype, device=f"cuda:{dev.index}", storage="pinned"
            )
        else:
            self._host_backing = _dlbridge.empty(shape, dtype, device="cpu")
        self._host_view = _numpy_view(self._host_backing) if placed.type != "cuda_managed" else None

    # -- state ---------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """One of ``uninitialized``, ``host_only``, ``device_only``, ``synchronized``,
        ``host_dirty``, ``device_dirty``."""
        return self._state

    @property
    def is_shared(self) -> bool:
        """Whether host and device views are the same memory (no copies ever)."""
        return self._shared

    @property
    def transfers(self) -> Dict[str, int]:
        """How many copies each way were made so far."""
        return dict(self._transfers)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._device_array.shape

    @property
    def dtype(self) -> Any:
        return self._device_array.dtype

    def __repr__(self) -> str:
        return (
            f"dlbridge.UnifiedBuffer(shape={self.shape}, dtype={self.dtype}, "
            f"device='{self._device_array.device}', state={self._state!r}, shared={self._shared})"
        )

    # -- views ---------------------------------------------------------------------------------

    @property
    def host(self) -> Any:
        """The host side as a NumPy array, brought up to date first if the device side is
        newer. Writes through it must be followed by :meth:`mark_host_dirty`."""
        if self._state in (DEVICE_DIRTY, DEVICE_ONLY):
            self.sync_to_host()
        elif self._state == UNINITIALIZED:
            self._state = HOST_ONLY
        return self._host()

    @property
    def device(self) -> Array:
        """The device side as a dlbridge array, brought up to date first if the host side is
        newer. Writes to it must be followed by :meth:`mark_device_dirty`."""
        if self._state in (HOST_DIRTY, HOST_ONLY):
            self.sync_to_device()
        elif self._state == UNINITIALIZED:
            self._state = DEVICE_ONLY
        return self._device_array

    def _host(self) -> Any:
        if self._host_view is None:
            # Managed memory: a fresh view each time waits for the device's pending work.
            return _numpy_view(self._host_backing)
        return self._host_view

    # -- transitions ---------------------------------------------------------------------------

    def mark_host_dirty(self) -> None:
        """The host side was written: the device side is stale. Raises ``RuntimeError`` when
        the device side was also written since the last synchronization (one side's writes
        would be lost; synchronize first)."""
        if self._state == DEVICE_DIRTY and not self._shared:
            raise RuntimeError(
                "both sides of the UnifiedBuffer were written: the device side is dirty; call "
                "sync_to_host() before writing the host side"
            )
        self._state = HOST_DIRTY

    def mark_device_dirty(self) -> None:
        """The device side was written: the host side is stale. Raises ``RuntimeError`` when
        the host side was also written since the last synchronization."""
        if self._state == HOST_DIRTY and not self._shared:
            raise RuntimeError(
                "both sides of the UnifiedBuffer were written: the host side is dirty; call "
                "sync_to_device() before writing the device side"
            )
        self._state = DEVICE_DIRTY

    def sync_to_host(self) -> None:
        """Makes the host side current (a device → host copy only when the device side is
        newer and the memory is not shared)."""
        if self._state in (DEVICE_DIRTY, DEVICE_ONLY):
            if not self._shared:
                self._host_backing[...] = self._device_array
                self._transfers["device_to_host"] += 1
            self._wait_for_device()
            self._state = SYNCHRONIZED

    def sync_to_device(self) -> None:
        """Makes the device side current (a host → device copy only when the host side is
        newer and the memory is not shared)."""
        if self._state in (HOST_DIRTY, HOST_ONLY):
            if not self._shared:
                self._device_array[...] = self._host_backing
                self._transfers["host_to_device"] += 1
                # A copy out of pinned memory is asynchronous: the host must not write the
                # pinned side again until it has been read.
                self._wait_for_device()
            self._state = SYNCHRONIZED

    def _wait_for_device(self) -> None:
        dev = self._device_array.device
        if dev.type in ("cuda", "cuda_managed"):
            cuda.current_stream(dev.index).synchronize()
        elif dev.type == "metal":
            metal.synchronize(dev.index)
