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
    device: Any = None,
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
    shard: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    group: Any = None,
    targets: Any = None,
    strict: bool = True,
) -> StreamedLoad:
    """Loads the checkpoint at ``path`` (a file, an index, a folder or a list of shards, as
    :func:`load_file` takes them) group by group, handing each out as soon as it is on
    ``device`` while the next ones load::

        compute = torch.cuda.Stream()  # compute on a stream of your own to overlap the load
        with torch.cuda.stream(compute):
            for group, tensors, ready in dlbridge.stream_file(path, "cuda:0", framework="pt",
                                                              order=names_in_execution_order):
                ready.wait(compute)  # the GPU waits, not the host
                run_layer(group, tensors)

    One reader serves the whole stream (its threads, and on CUDA their streams and pinned
    staging, made at the first group and freed when the stream ends or is closed): a group is
    handed out once its bytes are read and their copies to the device are queued, and its
    ``ready`` event, not the host, waits for the copies.

    Each group's reads start after the work queued on the legacy default stream (PyTorch's
    default stream) when the group is read: the memory they write may be memory a kernel queued
    there still reads (the pool hands a block freed on that stream straight back out). A forward
    pass on PyTorch's default stream therefore runs after the loads, not beside them; on a stream
    of its own (above) it overlaps them.

    ``order``: the tensors to load, in that order (a name the checkpoint lacks is a
    ``KeyError``); by default all of them, in the files' order (shard by shard, by offset).
    ``groups`` puts tensors together: ``None`` by layer (the name up to its first numbered part,
    ``model.layers.3``; other tensors one group each), a regular expression (the tensors it
    matches grouped by the match, or by its first group where it has one; the others a group
    each), or a callable from a name to its group's name. Groups come in the order of their first
    tensor, the tensors of a group in ``order``.

    Each item is ``(group, {name: tensor}, ready)``. On a CUDA device ``ready`` is a
    :class:`dlbridge.cuda.Event` that completes once the group's bytes (converted, with
    ``dtype``) are on the device, recorded on a stream of the load's own (ordered after the
    caller's current stream when the load starts), not on the legacy default stream, so that it
    does not wait for compute queued there (with ``dtype``, on the stream the conversion ran on,
    after the copies). Use a group's tensors only after ``ready``: ``ready.wait(stream)`` makes a stream (a PyTorch or CuPy stream,
    a :class:`dlbridge.cuda.Stream`, or the current one by default) wait for it without blocking
    the host, ``ready.synchronize()`` blocks the host, ``ready.handle`` is the raw ``CUevent``.
    On the CPU (views of the mapped file, or copies with ``copy=True``) and on Metal the tensors
    are ready when handed out and ``ready`` is ``None``.

    A group's memory returns to dlbridge's pool when its last tensor goes, and the pool orders
    its reuse after work on the stream it was allocated for (the current stream of the stream's
    loading thread: the legacy default stream, PyTorch's default, which also waits for the
    group's copies), not after work PyTorch queued on a stream of its own: a consumer computing on another stream keeps each group's tensors
    until that work is done (an event it synchronises later, or ``torch.cuda.synchronize()``).

    At most ``ahead`` loaded groups wait for the caller besides the one being read, so a slow
    consumer holds only that much device memory ahead. An error while loading (a file truncated
    under the load, the device out of memory) is raised by the iteration that would have handed
    out its group, after the groups before it; nothing comes after. ``framework``, ``dtype``,
    ``copy``, ``threads``, ``chunk_bytes`` and ``direct_io`` as in :func:`load_file`.

    **Sharded and into targets.** With ``shard=`` (a plan, :mod:`dlbridge.shard`) and ``rank=``,
    ``world_size=``, ``group=`` (as :func:`load_file` takes them: one process per rank, every
    rank streaming the same ``order`` and ``groups``), each group holds this rank's parts of its
    tensors, read and handed out as :func:`load_file` does it (each byte of the checkpoint read
    once over all ranks). With ``targets=`` (a mapping of names to arrays, or a
    ``torch.nn.Module``, as :func:`dlbridge.load_into` takes them, with its ``strict`` and
    ``shard``, ``"targets"`` included), each group's tensors are read into the targets and the
    group hands out the targets themselves (``framework`` does not apply); the checks of
    ``load_into`` (names, shapes) are made before anything is read, and ``device`` defaults to
    the targets'. These streams run the loader's steps on a thread of their own, one group per
    step, each group delivered once this rank's parts are in place; on CUDA ``ready`` is an
    event recorded on the thread's stream after the group's last copy. The loader waits for the
    work queued on the device before the first group with targets is read (a kernel still
    filling a target could otherwise land after the checkpoint's bytes), not before later
    groups: work queued after the stream starts must not write the targets of groups not yet
    delivered (a forward pass over delivered groups does not).
    One device per process; ``dtype`` and ``chunk_bytes`` are not taken (``load_into`` converts
    to the targets' dtypes). A rank that closes its stream early, or fails, makes its peers'
    next transfer fail after the transfer timeout (``DLBRIDGE_NCCL_TIMEOUT``)."""
    from . import _Convert, _device, _target

    if not (shard is None and rank is None and world_size is None and group is None
            and targets is None):
        return _stream_parts(path, device, groups, order, framework, ahead, dtype, copy,
                             threads, chunk_bytes, direct_io, shard, rank, world_size, group,
                             targets, strict)
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


def _stream_parts(path: Any, device: Any, groups: GroupBy, order: Optional[Iterable[str]],
                  framework: str, ahead: int, dtype: Any, copy: bool, threads: Optional[int],
                  chunk_bytes: Optional[int], direct_io: Optional[bool], shard: Any,
                  rank: Optional[int], world_size: Optional[int], group: Any, targets: Any,
                  strict: bool) -> StreamedLoad:
    """:func:`stream_file` with a shard plan or targets (the loader's engine, ``dlbridge._load``)."""
    from .. import _load
    from . import _Convert, _device

    if dtype is not None or chunk_bytes is not None:
        raise ValueError(
            "stream_file with shard= or targets= takes no dtype= or chunk_bytes= (load_into "
            "converts to the targets' dtypes)"
        )
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
        raise ValueError(f"ahead must be an int of at least 1, got {ahead!r}")
    names = None
    if order is not None:
        names = [order] if isinstance(order, str) else list(order)
    convert: Callable[[Any], Any] = lambda v: v  # noqa: E731  (targets are handed out as given)
    if targets is None and not isinstance(device, (list, tuple)):
        framework_convert = _Convert(framework, _device(device))
        convert, copy = framework_convert, bool(copy) or framework_convert.copy
    native, planned = _load.stream_parts(
        path, device, names, groups, ahead, bool(copy), threads, direct_io, shard, rank,
        world_size, group, targets, strict)
    return StreamedLoad(native, convert, planned)
