"""Streaming loads: a checkpoint handed out group by group (a layer's tensors, say) in the order
a model runs, each group with an event that completes when its bytes are on the device, while
the next groups load."""

from __future__ import annotations

import re
from typing import (
    Any, Callable, Dict, Iterable, Iterator, List, Optional, Pattern, Sequence, Tuple, Union,
)

from .. import _dlbridge

GroupBy = Union[None, str, "Pattern[str]", Callable[[str], str]]

_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def layer_of(name: str) -> str:
    """The default group of a tensor: its name up to its first numbered part
    (``model.layers.3.mlp.up_proj.weight`` → ``model.layers.3``), else the whole name (an
    embedding, a final norm, a head: a group each)."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


def _key_function(groups: GroupBy) -> Callable[[str], str]:
    if groups is None:
        return layer_of
    if isinstance(groups, (str, re.Pattern)):
        pattern = re.compile(groups)

        def by_pattern(name: str) -> str:
            match = pattern.search(name)
            if match is None:
                return name
            return match.group(1) if pattern.groups else match.group(0)

        return by_pattern
    if callable(groups):
        def by_callable(name: str) -> str:
            key = groups(name)
            if not isinstance(key, str):
                raise TypeError(f"groups({name!r}) returned {type(key).__name__}, not a str")
            return key

        return by_callable
    raise TypeError(f"groups must be None, a regular expression or a callable, got {type(groups).__name__}")


def plan_groups(names: Sequence[str], groups: GroupBy = None) -> List[Tuple[str, List[str]]]:
    """``names`` (in the order to load them) grouped: ``[(group, [names])]``, groups in the order
    of their first tensor, tensors in the given order within each."""
    key_of = _key_function(groups)
    planned: Dict[str, List[str]] = {}
    for name in names:
        planned.setdefault(key_of(name), []).append(name)
    return list(planned.items())


class StreamedLoad:
    """The iterator :func:`stream_file` returns: ``(group, {name: tensor}, ready)`` per group.
    ``close()`` (or leaving a ``with`` block, or dropping it) stops the load: the group being read
    finishes and everything not handed out is freed."""

    def __init__(self, native: Any, convert: Callable[[Any], Any], groups: List[Tuple[str, List[str]]]) -> None:
        self._native = native
        self._convert = convert
        self.groups = groups
        """The plan: ``[(group, [tensor names])]`` in the order they come."""

    def __iter__(self) -> Iterator[Tuple[str, Dict[str, Any], Any]]:
        return self

    def __next__(self) -> Tuple[str, Dict[str, Any], Any]:
        name, tensors, ready = next(self._native)
        return name, {k: self._convert(v) for k, v in tensors.items()}, ready

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> "StreamedLoad":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def stream_file(
    path: Any,
    device: Any = "cpu",
    *,
    groups: GroupBy = None,
    order: Optional[Iterable[str]] = None,
    framework: str = "dlbridge",
    ahead: int = 2,
    dtype: Any = None,
    copy: bool = False,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    direct_io: Optional[bool] = None,
) -> StreamedLoad:
    """Loads the checkpoint at ``path`` (a file, an index, a folder or a list of shards, as
    :func:`load_file` takes them) group by group, handing each out as soon as it is on
    ``device`` while the next ones load::

        for group, tensors, ready in dlbridge.stream_file(path, "cuda:0", framework="pt",
                                                          order=names_in_execution_order):
            ready.wait(torch.cuda.current_stream())  # the GPU waits, not the host
            run_layer(group, tensors)

    ``order``: the tensors to load, in that order (a name the checkpoint lacks is a
    ``KeyError``); by default all of them, in the files' order (shard by shard, by offset).
    ``groups`` puts tensors together: ``None`` by layer (the name up to its first numbered part,
    ``model.layers.3``; other tensors one group each), a regular expression (the tensors it
    matches grouped by the match, or by its first group where it has one; the others a group
    each), or a callable from a name to its group's name. Groups come in the order of their first
    tensor, the tensors of a group in ``order``.

    Each item is ``(group, {name: tensor}, ready)``. On a CUDA device ``ready`` is a
    :class:`dlbridge.cuda.Event` that completes once the group's bytes (converted, with
    ``dtype``) are on the device: ``ready.wait(stream)`` makes a stream (a PyTorch or CuPy stream,
    a :class:`dlbridge.cuda.Stream`, or the current one by default) wait for it without blocking
    the host, ``ready.synchronize()`` blocks the host, ``ready.handle`` is the raw ``CUevent``.
    On the CPU (views of the mapped file, or copies with ``copy=True``) and on Metal the tensors
    are ready when handed out and ``ready`` is ``None``.

    A group's memory returns to dlbridge's pool when its last tensor goes, and the pool orders
    its reuse after work on the stream it was allocated for (the current stream of the stream's
    loading thread: the legacy default stream, PyTorch's default), not after work PyTorch queued
    on a stream of its own: a consumer computing on another stream keeps each group's tensors
    until that work is done (an event it synchronises later, or ``torch.cuda.synchronize()``).

    At most ``ahead`` loaded groups wait for the caller besides the one being read, so a slow
    consumer holds only that much device memory ahead. An error while loading (a file truncated
    under the load, the device out of memory) is raised by the iteration that would have handed
    out its group, after the groups before it; nothing comes after. ``framework``, ``dtype``,
    ``copy``, ``threads``, ``chunk_bytes`` and ``direct_io`` as in :func:`load_file`."""
    from . import _Convert, _device, _target

    convert = _Convert(framework, _device(device))
    target = _target(path)
    checkpoint = _dlbridge._Checkpoint(target)
    if order is None:
        names = list(checkpoint.offset_keys())
    else:
        names = [order] if isinstance(order, str) else list(order)
        known = set(checkpoint.keys())
        missing = [n for n in names if n not in known]
        if missing:
            raise KeyError(f"no tensor named {missing[0]!r} in the checkpoint")
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor {twice!r} is named twice in order")
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
        raise ValueError(f"ahead must be an int of at least 1, got {ahead!r}")
    planned = plan_groups(names, groups)
    native = _dlbridge._st_stream(
        target, planned, convert.device, ahead, bool(copy) or convert.copy, dtype, threads,
        chunk_bytes, direct_io)
    return StreamedLoad(native, convert, planned)
