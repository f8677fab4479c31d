"""Loading a checkpoint into existing memory and across the ranks of a tensor-parallel group:
``dlbridge.load_into`` and ``dlbridge.load_file(..., shard=...)``.

One engine for every mode. Each tensor of the checkpoint, in file order, is either

- *read by every rank itself*: a split whose ranks' parts are each one run of the file (dimension
  0, or a dimension with only length-1 dimensions before it), read by
  ``_Checkpoint.load_part``/``load_parts_into``, which read only the parts' bytes (into
  targets, all of them by one run of the reader per device); or
- *read once by its owner* (replicated tensors, splits of an inner dimension, whose parts are
  one run per row): owners are chosen by bytes (each such tensor to the rank with the fewest
  bytes so far, in file order: the same answer on every rank), the owner reads the whole tensor
  once and hands every other rank its part only, by a copy between devices (one process driving
  several devices) or a point-to-point send (one process per rank, over a ``dlbridge.nccl``
  communicator or a ``torch.distributed`` process group) -- never an all-gather.

Every rank walks the tensors in the same order and each send has its one matching receive, so
the transfers cannot deadlock; a rank that fails makes its peers' transfers fail (the
communicator's timeout, or the process group's) instead of hanging.
"""

from __future__ import annotations

from typing import (
    Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union,
)

from . import _dlbridge, shard as _shard
from ._dlbridge import Array, Device

__all__ = ["IncompatibleKeys", "load_into"]


class IncompatibleKeys(NamedTuple):
    """What ``load_into`` did not match, as PyTorch's ``load_state_dict`` returns it: target names
    the checkpoint lacks, and checkpoint names no target has."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def _is_module(obj: Any) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(obj, torch.nn.Module)


def _detached(t: Any) -> Any:
    """A PyTorch tensor without its autograd record (sharing its memory: DLPack refuses tensors
    that require grad); anything else as it is."""
    detach = getattr(t, "detach", None)
    if detach is not None and type(t).__module__.startswith("torch"):
        return detach()
    return t


def _shape_of(t: Any) -> Tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


def _device_of(t: Any) -> Optional[Device]:
    """The target's device, ``None`` for PyTorch's ``meta`` device (no memory yet)."""
    if getattr(getattr(t, "device", None), "type", None) == "meta":
        return None
    if isinstance(t, Array):
        return t.device
    return _dlbridge.from_dlpack(t, copy=False).device


def _materialise(module: Any, device: Optional[Device]) -> None:
    """Replaces every parameter and buffer of ``module`` on PyTorch's ``meta`` device by empty
    memory on ``device`` (the load then fills it): parameters stay ``Parameter``s with their
    ``requires_grad``, tied ones stay tied, and no memory is allocated twice."""
    import torch

    done: Dict[int, Any] = {}
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(sub, kind)
            for key, t in list(slots.items()):
                if t is None or not t.is_meta:
                    continue
                if device is None:
                    raise ValueError(
                        "the module has tensors on the 'meta' device: give device= (where to "
                        "create them) to load_into"
                    )
                new = done.get(id(t))
                if new is None:
                    # (`empty_like` on a meta tensor imports PyTorch's reference ops: 0.7 s.)
                    data = torch.empty_strided(tuple(t.shape), tuple(t.stride()),
                                               dtype=t.dtype, device=str(device))
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(data, requires_grad=t.requires_grad)
                    else:
                        new = data
                    done[id(t)] = new
                slots[key] = new


def _targets(targets: Any, device: Optional[Device]) -> Dict[str, Any]:
    """``targets`` as name -> array (a module's ``state_dict``, after its ``meta`` tensors were
    created on ``device``)."""
    if _is_module(targets):
        _materialise(targets, device)
        return dict(targets.state_dict(keep_vars=True))
    if not isinstance(targets, Mapping):
        raise TypeError(
            f"targets must be a mapping of names to arrays or a torch.nn.Module, not "
            f"{type(targets).__name__}"
        )
    return dict(targets)


def _untied(targets: Mapping[str, Any], present: Any) -> Dict[str, Any]:
    """``targets`` without the second and later names of one memory among those the checkpoint
    has (tied weights, which a ``state_dict`` lists under each name): the first is filled, which
    fills all."""
    seen: Dict[Tuple[Any, ...], str] = {}
    out: Dict[str, Any] = {}
    for name, t in targets.items():
        ptr = getattr(t, "data_ptr", None)
        if name in present and callable(ptr) and getattr(t, "numel", lambda: 0)():
            key = (str(t.device), ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key in seen:
                continue
            seen[key] = name
        out[name] = t
    return out


class _Info(NamedTuple):
    name: str
    dtype: Any
    shape: Tuple[int, ...]
    nbytes: int


def _key(shape: Sequence[int], split: Optional[_shard.Split], rank: int) -> Tuple[Any, ...]:
    """The index of rank ``rank``'s part: ``()`` for the whole tensor."""
    if split is None:
        return ()
    a, b = split.ranges[rank]  # type: ignore[index]
    return (slice(None),) * split.dim + (slice(a, b),)


def _part_shape(shape: Sequence[int], split: Optional[_shard.Split], rank: int) -> Tuple[int, ...]:
    if split is None:
        return tuple(shape)
    a, b = split.ranges[rank]  # type: ignore[index]
    out = list(shape)
    out[split.dim] = b - a
    return tuple(out)


def _one_run(shape: Sequence[int], split: Optional[_shard.Split]) -> bool:
    """Whether each rank's part is one run of the file: a split with only length-1 dimensions
    before the split one."""
    return split is not None and all(n == 1 for n in shape[: split.dim])


def _owners(infos: Sequence[_Info], splits: Mapping[str, Optional[_shard.Split]],
            world: int) -> Dict[str, int]:
    """The rank that reads each tensor no rank reads a part of itself, balanced by bytes (in file
    order, each to the rank with the fewest so far, the lowest such rank on a tie)."""
    load = [0] * world
    owners: Dict[str, int] = {}
    for info in infos:
        if _one_run(info.shape, splits[info.name]):
            continue
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[info.name] = rank
        load[rank] += info.nbytes
    return owners


class _TorchGroup:
    """Point-to-point transfers over a ``torch.distributed`` process group (NCCL for CUDA
    tensors, gloo for CPU ones)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def _peer(self, rank: int) -> int:
        import torch.distributed as dist

        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return int(dist.get_global_rank(self.group, rank))

    def send(self, array: Array, peer: int) -> None:
        import torch.distributed as dist
        from torch.utils.dlpack import from_dlpack

        dist.send(from_dlpack(array), dst=self._peer(peer), group=self.group)

    def recv(self, shape: Tuple[int, ...], dtype: Any, device: Device, peer: int,
             into: Any = None) -> Any:
        import torch.distributed as dist
        from torch.utils.dlpack import from_dlpack

        t = into
        if t is None:
            t = from_dlpack(_dlbridge.empty(shape, dtype, device=device))
        dist.recv(t, src=self._peer(peer), group=self.group)
        return t

    def can_receive_into(self, target: Any, dtype: Any, device: Device) -> bool:
        import torch

        return (isinstance(target, torch.Tensor) and target.is_contiguous()
                and Device(str(target.device)) == device
                and _dlbridge.from_dlpack(target, copy=False).dtype == _dlbridge.DType(dtype))


class _NcclComm:
    """Point-to-point transfers over a ``dlbridge.nccl`` communicator: each part is one compact
    array, one run, so the receiver plans its receive from the shape and dtype alone."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def send(self, array: Array, peer: int) -> None:
        self.comm.send([array], peer)

    def recv(self, shape: Tuple[int, ...], dtype: Any, device: Device, peer: int,
             into: Any = None) -> Any:
        runs, views = self.comm.plan([_dlbridge.empty(shape, dtype, device=device)])
        return self.comm.recv(runs, views, peer)[0]

    def can_receive_into(self, target: Any, dtype: Any, device: Device) -> bool:
        return False


def _transport(group: Any) -> Any:
    if isinstance(group, _dlbridge.NcclCommunicator):
        return _NcclComm(group)
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None  # type: ignore[assignment]
    if dist is not None and (group is None or isinstance(group, dist.ProcessGroup)):
        if not dist.is_initialized():
            raise ValueError(
                "rank= and world_size= need group=: a dlbridge.nccl.Communicator, or a "
                "torch.distributed process group (torch.distributed is not initialised)"
            )
        return _TorchGroup(group)
    raise TypeError(
        f"group must be a dlbridge.nccl.Communicator or a torch.distributed ProcessGroup, not "
        f"{type(group).__name__}"
    )


def _copy_into(target: Any, src: Any) -> None:
    """``src`` (any array) copied into ``target``'s memory with its strides, converted to its
    dtype, across devices where they differ."""
    dst = target if isinstance(target, Array) else _dlbridge.from_dlpack(target, copy=False)
    if not isinstance(src, Array):
        src = _dlbridge.from_dlpack(_detached(src), copy=False)
    dst[...] = src


def _run(
    ckpt: Any,
    devices: Sequence[Device],
    local: Sequence[int],
    world: int,
    plan: Any,
    targets: Optional[Sequence[Mapping[str, Any]]],
    transport: Any,
    threads: Optional[int],
    direct_io: Optional[bool],
    progress: Optional[Callable[[int, int], Any]],
    names: Optional[Sequence[str]] = None,
) -> Tuple[List[Dict[str, Any]], int]:
    """The engine (see the module's documentation): returns, per local rank, the tensors it
    loaded (new arrays, or the targets it filled), and the bytes this process needed from the
    file.

    First every part this process reads for itself, into targets by one call of the reader
    (``load_parts_into``: one run per device); then, in file order, the tensors read once by an
    owner and handed out, each rank taking part in the same order."""
    wanted = None if names is None else set(names)
    infos = []
    for name in ckpt.offset_keys():
        if wanted is not None and name not in wanted:
            continue
        _, shape, (begin, end), _ = ckpt.info(name)
        infos.append(_Info(name, ckpt.dtype(name), tuple(shape), end - begin))
    splits = {i.name: (_shard.resolve(plan, i.name, i.shape, world) if plan is not None else None)
              for i in infos}
    owners = _owners(infos, splits, world)
    out: List[Dict[str, Any]] = [{} for _ in local]
    total = sum(i.nbytes for i in infos)

    def target_of(slot: int, name: str) -> Any:
        return None if targets is None else targets[slot].get(name)

    def store(slot: int, name: str, value: Any) -> None:
        t = target_of(slot, name)
        if t is None:
            out[slot][name] = value
        else:
            _copy_into(t, value)
            out[slot][name] = t

    # Each rank's own parts, and the replicated tensors an owner reads into its own target.
    items = []
    read = 0
    for info in infos:
        name, split, owner = info.name, splits[info.name], owners.get(info.name)
        for slot, rank in enumerate(local):
            t = target_of(slot, name)
            if owner is None:
                if targets is not None and t is None:
                    continue  # no target here (a tied name, or a rank without it)
                key = _key(info.shape, split, rank)
            elif owner == rank and split is None and t is not None:
                key = ()
            else:
                continue
            if t is None and devices[slot].type == "cpu":
                # A view of the mapped file: nothing is read.
                got = ckpt.load_part(name, key, devices[slot], False)
                read += got.nbytes
                out[slot][name] = got
            elif t is None:
                # New memory, read into with the targets by the one run of the reader.
                got = _dlbridge.empty(_part_shape(info.shape, split, rank), info.dtype,
                                      device=devices[slot])
                items.append((name, key, got))
                out[slot][name] = got
            else:
                items.append((name, key, t))
                out[slot][name] = t
    first = 0

    def report(done: int, _total: int) -> None:
        if progress is not None:
            progress(min(done, total), total)

    if items:
        first = ckpt.load_parts_into(items, threads, direct_io, report)
        read += first
    done = first

    def hand_out(info: _Info, whole: Any) -> None:
        """Tensor `info` (`whole`: the owner's copy, where this process is its owner) handed out:
        each local rank keeps its part, the others are sent theirs."""
        name, split, owner = info.name, splits[info.name], owners[info.name]
        if owner in local:
            slot = local.index(owner)
            t = target_of(slot, name)
            for rank in range(world):
                part = whole[_key(info.shape, split, rank)]
                if rank == owner:
                    if not (split is None and t is not None):
                        # Compact, so that the whole tensor is not kept for one part of it.
                        store(slot, name, part if split is None else part.copy())
                elif rank in local:
                    other = local.index(rank)
                    store(other, name, part.to(devices[other], copy=True))
                elif part.size:
                    transport.send(part if part.is_contiguous else part.copy(), rank)
            return
        for slot, rank in enumerate(local):
            shape = _part_shape(info.shape, split, rank)
            t = target_of(slot, name)
            dtype = info.dtype
            if 0 in shape:
                # Nothing is sent for an empty part.
                got = _dlbridge.empty(shape, dtype, device=devices[slot])
                out[slot][name] = got if t is None else t
                continue
            if t is not None and transport.can_receive_into(t, dtype, devices[slot]):
                transport.recv(shape, dtype, devices[slot], owner, into=t)
                out[slot][name] = t
                continue
            got = transport.recv(shape, dtype, devices[slot], owner)
            if t is None:
                out[slot][name] = got if isinstance(got, Array) else _dlbridge.from_dlpack(got)
            else:
                _copy_into(t, got)
                out[slot][name] = t

    # The tensors read by an owner, in groups of at most `_BATCH` bytes (a larger tensor alone),
    # the same groups on every rank: an owner reads its tensors of a group by one run of the
    # reader, then the group's tensors are handed out in file order.
    groups: List[List[_Info]] = []
    size = 0
    for info in infos:
        if info.name not in owners:
            continue
        if not groups or size + info.nbytes > _BATCH:
            groups.append([])
            size = 0
        groups[-1].append(info)
        size += info.nbytes
    for group in groups:
        wholes: Dict[str, Any] = {}
        batch = []
        for info in group:
            owner = owners[info.name]
            if owner not in local:
                continue
            slot = local.index(owner)
            t = target_of(slot, info.name)
            if splits[info.name] is None and t is not None:
                wholes[info.name] = _dlbridge.from_dlpack(t, copy=False)  # read above
            else:
                whole = _dlbridge.empty(info.shape, info.dtype, device=devices[slot])
                batch.append((info.name, (), whole))
                wholes[info.name] = whole
        if batch:
            read += ckpt.load_parts_into(batch, threads, direct_io, None)
        del batch
        for info in group:
            hand_out(info, wholes.pop(info.name, None))
            done += info.nbytes
            report(done, total)
    report(total, total)
    return out, read


_BATCH = 1 << 30
"""The most bytes of tensors read by their owners that one run of the reader reads (a larger
tensor alone): the memory a load holds above its results while it hands them out."""


def _devices(device: Any) -> List[Device]:
    from .safetensors import _device

    if isinstance(device, (list, tuple)):
        return [_device(d) for d in device]
    return [_device(device)]


def _ranks(devices: Sequence[Device], shard: Any, rank: Optional[int],
           world_size: Optional[int], group: Any) -> Tuple[List[int], int, Any]:
    """The local ranks, the world size and the transport of a load."""
    if rank is None and world_size is None:
        if group is not None:
            raise ValueError("group= needs rank= and world_size=")
        return list(range(len(devices))), len(devices), None
    if rank is None or world_size is None:
        raise ValueError("rank= and world_size= go together")
    if len(devices) != 1:
        raise ValueError(
            "one process per rank loads onto its one device: give device= one device with rank="
        )
    if shard is None:
        raise ValueError("rank= and world_size= load a rank's part: give shard= a plan")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    return [int(rank)], int(world_size), (_transport(group) if world_size > 1 else None)


def load_sharded(
    path: Any, device: Any, shard: Any, rank: Optional[int], world_size: Optional[int],
    group: Any, keys: Optional[Sequence[str]], threads: Optional[int],
    direct_io: Optional[bool], progress: Optional[Callable[[int, int], Any]],
) -> Tuple[List[Dict[str, Any]], bool, int]:
    """``load_file`` with a device list or a shard plan: a dict of arrays per local device,
    whether one process drives several devices, and the bytes of the file this process read
    (each byte of the checkpoint once over all ranks)."""
    from .safetensors import _target

    devices = _devices(device)
    if shard == "targets":
        raise ValueError("shard='targets' builds the plan from load_into's targets")
    local, world, transport = _ranks(devices, shard, rank, world_size, group)
    ckpt = _dlbridge._Checkpoint(_target(path))
    if keys is not None:
        missing = [k for k in keys if k not in set(ckpt.keys())]
        if missing:
            raise KeyError(f"no tensor named {missing[0]!r} in the checkpoint")
    out, read = _run(ckpt, devices, local, world, shard, None, transport, threads, direct_io,
                     progress, keys)
    return out, rank is None, read


def load_into(
    targets: Any,
    checkpoint: Any,
    *,
    strict: bool = True,
    device: Any = None,
    shard: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    group: Any = None,
    threads: Optional[int] = None,
    direct_io: Optional[bool] = None,
    progress: Any = None,
) -> IncompatibleKeys:
    """Loads a checkpoint (a file, a list of shards, an index or a folder, as ``load_file`` takes
    it) into existing memory: ``targets`` is a mapping of names to arrays of any DLPack producer
    (a PyTorch ``state_dict()``, CuPy, NumPy or dlbridge arrays) or a ``torch.nn.Module`` (its
    parameters and buffers). Each tensor is read straight into its target where the target is
    compact and of the checkpoint's dtype (CPU, CUDA: through the reader's pinned staging, no
    other device memory); otherwise it is read on the target's device, converted to the target's
    dtype there (as ``copy_`` converts) and copied in with the target's strides. Targets are
    written while the load runs: don't use them from another thread meanwhile.

    A module's tensors on PyTorch's ``meta`` device are created on ``device`` first (as
    ``load_state_dict(assign=True)``: each once, empty, then filled; parameters stay
    ``Parameter``s with their ``requires_grad``, tied ones tied).

    ``strict``: as ``load_state_dict``, the target names the checkpoint lacks and the checkpoint
    names no target has are returned (``IncompatibleKeys``); with ``strict=True`` (the default)
    either is a ``KeyError`` listing them, raised before anything is read. A target of another
    shape than its tensor (or, sharded, its rank's part) is a ``ValueError`` naming the tensor and
    both shapes, also raised before anything is read.

    ``shard``: a plan (:mod:`dlbridge.shard`; ``"targets"``: built from the targets' shapes).
    With ``device`` a list, ``targets`` is a list of one mapping (or module) per device, and this
    process fills them all; with ``rank``/``world_size``/``group`` (a ``dlbridge.nccl``
    communicator or a ``torch.distributed`` process group), this process fills rank ``rank``'s
    targets, the other ranks calling it with theirs. ``progress``: a callable getting
    ``(bytes_done, bytes_total)`` of the checkpoint's tensors.
    """
    from .safetensors import _progress_callback, _target

    devices = _devices(device) if device is not None else []
    many = isinstance(device, (list, tuple))
    if many:
        if not isinstance(targets, (list, tuple)) or len(targets) != len(devices):
            raise TypeError(
                f"with device= a list of {len(devices)} devices, targets is a list of as many "
                f"mappings or modules (one per device)"
            )
        groups = [_targets(t, d) for t, d in zip(targets, devices)]
    else:
        groups = [_targets(targets, devices[0] if devices else None)]
    groups = [{k: _detached(v) for k, v in g.items()} for g in groups]
    # The device of each local rank: where its targets are.
    if not devices:
        found = {d for d in (_device_of(v) for v in groups[0].values()) if d is not None}
        devices = [found.pop() if len(found) == 1 else Device("cpu")]
    ckpt = _dlbridge._Checkpoint(_target(checkpoint))
    local, world, transport = _ranks(devices, shard, rank, world_size, group)
    full = {}
    for name in ckpt.keys():
        full[name] = tuple(ckpt.info(name)[1])
    plan = shard
    if shard == "targets":
        shapes: Dict[str, Tuple[int, ...]] = {}
        for slot, g in enumerate(groups):
            for k, v in g.items():
                if k in full and _shape_of(v) != full[k]:
                    shapes.setdefault(k, _shape_of(v))
        plan = (_shard.from_targets(shapes, full, local[0], world) if len(local) == 1
                else _plan_from_many(groups, full, world))
    names = set().union(*[set(g) for g in groups]) if groups else set()
    missing = sorted(names - set(full))
    unexpected = sorted(set(full) - names)
    if strict and (missing or unexpected):
        raise KeyError(
            "load_into(strict=True): "
            + "; ".join(
                part for part in (
                    f"missing from the checkpoint: {', '.join(missing)}" if missing else "",
                    f"in the checkpoint but not in the targets: {', '.join(unexpected)}"
                    if unexpected else "",
                ) if part
            )
        )
    load_names = [n for n in ckpt.offset_keys() if n in names]
    # Shapes, before anything is read.
    for slot, g in enumerate(groups):
        for name in load_names:
            if name not in g:
                continue
            split = _shard.resolve(plan, name, full[name], world) if plan is not None else None
            want = _part_shape(full[name], split, local[slot])
            got = _shape_of(g[name])
            if got != want:
                what = f"rank {local[slot]}'s part of " if split is not None else ""
                raise ValueError(
                    f"tensor {name!r}: the target has shape {got} but {what}the checkpoint's "
                    f"tensor has shape {want}"
                )
    groups = [_untied(g, full) for g in groups]
    # One process per rank: every rank walks every tensor, so that all agree on the owners
    # whatever targets each has (a tensor a rank has no target for is handed to it and dropped).
    walk = None if transport is not None else [
        n for n in ckpt.offset_keys() if any(n in g for g in groups)]
    callback, bar = _progress_callback(progress)
    try:
        _run(ckpt, devices, local, world, plan, groups, transport, threads, direct_io, callback,
             walk)
    finally:
        if bar is not None:
            bar.close()
    return IncompatibleKeys(missing, unexpected)


def _plan_from_many(groups: Sequence[Mapping[str, Any]], full: Mapping[str, Tuple[int, ...]],
                    world: int) -> Callable[[str], Any]:
    """The plan of one process's targets for every rank: a tensor is split along the dimension
    where the targets' shapes differ from the checkpoint's."""
    per_rank = [_shard.from_targets({k: _shape_of(v) for k, v in g.items()}, full, r, world)
                for r, g in enumerate(groups)]

    def spec(name: str) -> Any:
        for s in per_rank:
            got = s(name)
            if got is not None:
                return got
        return None

    return spec
