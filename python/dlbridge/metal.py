"""Apple GPUs through Metal: devices, synchronization and residency.

dlbridge batches its GPU work (copies, fills) on one command queue per device. Synchronization is
explicit, as in MLX and PyTorch MPS: :func:`synchronize` commits and waits for dlbridge's pending
work. ``Array.__dlpack__`` does so itself before handing a buffer to another framework, and so
does every host read (``tolist``, ``np.asarray``). The other direction is the producer's job:
``torch.mps.synchronize()`` or ``mx.eval(x)`` before ``dlbridge.from_dlpack(x)``.

Arrays are created with ``device="metal"`` (or ``"metal:N"``) and ``storage="shared"``,
``"private"`` or ``"managed"`` (macOS); without ``storage`` they get the device's default
(:func:`device_info` ``["default_storage"]``). ``Array.storage`` says what an array has.

Where Metal is not available (not an Apple platform, or no device) :func:`is_available` is False,
:func:`unavailable_reason` says why, and everything that needs a device raises ``RuntimeError``
("Metal backend not available: ...").

>>> import dlbridge, torch
>>> a = dlbridge.arange(8, dtype="float32", device="metal")
>>> t = torch.from_dlpack(a)                   # the same MTLBuffer, on "mps"
"""

from __future__ import annotations

from typing import Any

from . import _dlbridge
from ._dlbridge import _metal_device_count as device_count
from ._dlbridge import _metal_is_available as is_available

__all__ = [
    "device_count",
    "device_info",
    "devices",
    "is_available",
    "residency_allocation_count",
    "synchronize",
    "unavailable_reason",
]


def unavailable_reason() -> str:
    """Why Metal cannot be used here (an empty string when it can)."""
    return _dlbridge._metal_unavailable_reason()


def devices() -> "list[dict[str, Any]]":
    """Every Metal device as a dict (see :func:`device_info`); index 0 is the system default.

    Raises ``RuntimeError`` where Metal is not available.
    """
    return _dlbridge._metal_devices()


def device_info(device: Any = None) -> "dict[str, Any]":
    """What dlbridge knows about a Metal device (default ``metal:0``), as a dict.

    Keys: ``device`` (``"metal:N"``), ``name``, ``registry_id``, ``has_unified_memory``,
    ``max_buffer_length``, ``recommended_max_working_set_size``, ``low_power``, ``removable``,
    ``page_size`` (the granularity of no-copy wrapping), ``default_storage`` (``"shared"``,
    ``"private"`` or ``"managed"``), ``managed_storage`` (whether the OS has it), ``residency``
    (``"enabled"``, ``"disabled"`` by ``DLBRIDGE_METAL_RESIDENCY=0``, ``"unsupported"`` before
    macOS 15, or ``"failed"``) and ``residency_error`` (Metal's message when it failed, else None).
    """
    return _dlbridge._metal_device_info(device)


def synchronize(device: Any = None) -> None:
    """Commits and waits for dlbridge's pending GPU work on a device (default ``metal:0``), and
    raises ``RuntimeError`` for GPU errors recorded since the last call."""
    _dlbridge._metal_synchronize(device)


def residency_allocation_count(device: Any = None) -> "int | None":
    """How many allocations the device's residency set holds (None when residency sets are not
    in use). Cached blocks of the memory pool stay resident: ``dlbridge.empty_cache("metal",
    storage=...)`` releases them."""
    return _dlbridge._metal_residency_allocation_count(device)
