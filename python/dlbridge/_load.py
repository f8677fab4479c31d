"""Loading a checkpoint into existing memory and across the ranks of a tensor-parallel group:
``dlbridge.load_into`` and ``dlbridge.load_file(..., shard=...)``.

One engine for every mode. Each tensor of the checkpoint, in file order, is either

- *read by every rank itself* (:func:`_read_by_ranks`), only its part's bytes, by
  ``_Checkpoint.load_part``/``load_parts_into`` (into targets or new arrays, all of a step by one
  run of the reader per device):

  - a split whose ranks' parts are each one run of the file (dimension 0, or a dimension with
    only length-1 dimensions before it);
  - a split of an inner dimension (a dim-1 split: one run per row) whose non-empty parts' runs
    are each at least ``_MIN_RUN`` (512) bytes: each rank reads its own columns, row by row, so
    each byte is still read once over all ranks;
  - a replicated tensor of at most ``_REPLICATED_READ`` (16 MiB) bytes: every rank reads it
    (a Llama's norms), so these bytes are read once per rank;

- or *read once by its owner*: replicated tensors over ``_REPLICATED_READ`` bytes and splits of
  an inner dimension with runs under ``_MIN_RUN`` bytes (many tiny reads). Owners are chosen by
  bytes (each such tensor to the rank with the fewest bytes so far, in file order: the same
  answer on every rank); the owner reads the whole tensor once and hands every other rank its
  part only, by a copy between devices (one process driving several devices) or one batched
  point-to-point exchange per step (one process per rank, over a ``dlbridge.nccl`` communicator
  or a ``torch.distributed`` process group) -- never an all-gather.

So each byte of the checkpoint is read from the file once over all ranks, apart from the
replicated tensors of at most ``_REPLICATED_READ`` bytes, which every rank reads; a plan without
big replicated tensors or tiny-run splits (a Llama's) exchanges nothing.

Every rank walks the tensors in the same order and each send has its one matching receive, so
the transfers cannot deadlock. With one process per rank, the load ends with an agreement over
the group (one all-reduce of each rank's status; over a ``dlbridge.nccl`` communicator, a status
to rank 0 and its verdict back): a rank that failed, or did not take part within
``DLBRIDGE_NCCL_TIMEOUT`` seconds (default 300), makes every rank's load raise ``RuntimeError``,
also where nothing was exchanged; a transfer that fails or times out raises at once.
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


_MIN_RUN = 512
"""A split whose ranks' parts are runs of the file (one per row: an inner dimension split) is read
by each rank itself where every non-empty part's run is at least this many bytes; below, by one
owner, which hands the parts out. Each run is a read of its own (a ``pread``, and on CUDA one
staged copy: a few microseconds each whatever its length), so a run of 512 bytes moves at about
0.1 GB/s per reader thread, slower than reading the whole tensor once and handing it out; a
Llama's o/down projections over 2 to 8 ranks have runs of 1 to 14 KiB."""

_REPLICATED_READ = 16 << 20
"""A replicated tensor of at most this many bytes is read by every rank itself (a Llama's norms:
8 to 16 KiB); a larger one by one owner, which hands it to the others. Reading 16 MiB costs a rank
about a millisecond from the page cache, far less than a hand-out's first point-to-point transfer
(NCCL connects each pair on its first one: tens to hundreds of milliseconds); above it, each rank
would read the bytes again (from the disk when the files are read with direct I/O)."""


def _read_by_ranks(info: "_Info", split: Optional[_shard.Split]) -> bool:
    """Whether every rank reads its part of ``info`` itself (the rule of the module's
    documentation), else one owner reads it whole and hands the parts out."""
    if split is None:
        return info.nbytes <= _REPLICATED_READ
    if _one_run(info.shape, split) or info.nbytes == 0:
        return True
    bits = _dlbridge.DType(info.dtype).bits * _dlbridge.DType(info.dtype).lanes
    if bits % 8:
        return False  # a part of a sub-byte type may not start on a byte
    inner = 1
    for n in info.shape[split.dim + 1:]:
        inner *= n
    runs = [(b - a) * inner * bits // 8 for a, b in split.ranges]  # type: ignore[union-attr]
    return min((r for r in runs if r), default=_MIN_RUN) >= _MIN_RUN


def _owners(infos: Sequence[_Info], splits: Mapping[str, Optional[_shard.Split]],
            world: int) -> Dict[str, int]:
    """The rank that reads each tensor no rank reads a part of itself (:func:`_read_by_ranks`),
    balanced by bytes (in file order, each to the rank with the fewest so far, the lowest such
    rank on a tie)."""
    load = [0] * world
    owners: Dict[str, int] = {}
    for info in infos:
        if _read_by_ranks(info, splits[info.name]):
            continue
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[info.name] = rank
        load[rank] += info.nbytes
    return owners


class _Recv(NamedTuple):
    """A part this process receives: for local slot ``slot``, tensor ``name``'s part of
    ``shape`` and ``dtype``, into ``target`` where it has one."""

    slot: int
    name: str
    shape: Tuple[int, ...]
    dtype: Any
    target: Any


_ALIGN = 256
"""Where each part of a packed block starts: a multiple of this many bytes (NCCL's run phase)."""


def _layout(specs: Sequence[Tuple[Sequence[int], Any]]) -> Tuple[int, List[Tuple[Any, ...]]]:
    """The block that holds arrays of ``specs`` (shape, dtype) one after another, compact, each
    at a multiple of ``_ALIGN`` bytes: its length, and each array as a view tuple of its one run
    (``NcclCommunicator.recv``'s and ``_nccl_views``'s form). Sender and receiver compute it
    from the same shapes, so a block travels as one run with no plan sent ahead."""
    views = []
    cursor = 0
    for shape, dtype in specs:
        dt = _dlbridge.DType(dtype)
        count = 1
        for n in shape:
            count *= int(n)
        nbytes = -(-count * dt.bits * dt.lanes // 8)
        at = -(-cursor // _ALIGN) * _ALIGN
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(int(n), 1)
        views.append((0 if nbytes else -1, dt.name, [int(n) for n in shape], strides[::-1], at,
                      False))
        cursor = at + nbytes
    return max(cursor, _ALIGN), views


def _pack(arrays: Sequence[Array], device: Device) -> Tuple[Array, List[Array]]:
    """``arrays`` copied into one new block of ``device`` laid out as :func:`_layout` says: the
    block and the arrays' copies in it (typed views of the block)."""
    total, views = _layout([(a.shape, a.dtype) for a in arrays])
    block = _dlbridge.empty((total,), "uint8", device=device)
    packed = _dlbridge._nccl_views(block, views)
    for dst, src in zip(packed, arrays):
        if src.size:
            dst[...] = src
    return block, packed


_abandoned: List[Any] = []
"""The memory of transfers that timed out: kept for the life of the process, since a transfer
that never finished may still write it."""


class _TransferError(RuntimeError):
    """A tensor-parallel transfer or the final agreement failed or timed out, or the agreement
    said another rank failed: the group is broken or has agreed already, so no agreement is tried
    after it."""


def _deadline_text(limit: Optional[float]) -> str:
    return "" if limit is None else f" within {limit:.1f} s"


def _bounded(issue: Callable[[], Any], limit: Optional[float], what: str, keep: Any) -> Any:
    """``issue()`` (a ``torch.distributed`` call that starts transfers) on a thread of its own,
    waited for up to ``limit`` seconds: where the process group's NCCL communicator is created
    lazily, the first call creates it, and ``ncclCommInitRank`` waits with no limit for a rank
    that died. A call that outlives the limit is left to its (daemon) thread and this is a
    ``RuntimeError``; ``keep`` (what its transfers read and write) is then kept for the life of
    the process, since the call may still start them (a slow peer, not a dead one)."""
    import threading

    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = issue()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="dlbridge-tp-issue", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        _abandoned.append(keep)
        raise _TransferError(
            f"{what} did not start{_deadline_text(limit)}: a peer did not take part (it may have "
            f"failed or exited)"
        )
    if "error" in box:
        raise _TransferError(f"{what} failed: {box['error']}") from box["error"]
    return box["value"]


class _TorchGroup:
    """Point-to-point transfers over a ``torch.distributed`` process group (NCCL for CUDA
    tensors, gloo for CPU ones): a step's parts for every peer, sent and received by one
    ``batch_isend_irecv`` (NCCL: one group of operations, in any order without deadlock), each
    part a message of its bytes. Contiguous parts are sent from where they are, strided ones from
    one block packed per step; parts are received straight into their targets where those are
    compact, of the part's dtype and on the device, else into new arrays."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def _peer(self, rank: int) -> int:
        import torch.distributed as dist

        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return int(dist.get_global_rank(self.group, rank))

    def start(self, device: Device, sends: Mapping[int, List[Array]],
              recvs: Mapping[int, List[_Recv]]) -> Any:
        import torch
        import torch.distributed as dist
        from torch.utils.dlpack import from_dlpack

        def message(array: Any) -> Any:
            # Bytes, so that any dtype travels (NCCL knows no float8 before 2.24, gloo no bfloat16
            # reductions): a view of the array's memory.
            return from_dlpack(array).reshape(-1).view(torch.uint8)

        ops: List[Any] = []
        keep: List[Any] = []
        got: List[Tuple[_Recv, Optional[Array]]] = []
        for peer in sorted(set(sends) | set(recvs)):
            parts = sends.get(peer, [])
            strided = [p for p in parts if not p.is_contiguous]
            packed: Dict[int, Array] = {}
            if strided:
                block, copies = _pack(strided, device)
                keep.append(block)
                packed = {id(p): c for p, c in zip(strided, copies)}
            for part in parts:
                msg = message(packed.get(id(part), part))
                keep.append(msg)
                ops.append(dist.P2POp(dist.isend, msg, self._peer(peer), self.group))
            for recv in recvs.get(peer, []):
                dst = None
                if recv.target is not None:
                    t = _dlbridge.from_dlpack(recv.target, copy=False)
                    if (t.is_contiguous and t.device == device
                            and t.dtype == _dlbridge.DType(recv.dtype)):
                        dst = t
                into = dst is not None
                if not into:
                    dst = _dlbridge.empty(recv.shape, recv.dtype, device=device)
                msg = message(dst)
                keep.append(msg)
                ops.append(dist.P2POp(dist.irecv, msg, self._peer(peer), self.group))
                got.append((recv, None if into else dst))
        if not ops:
            return None
        from .nccl import _timeout

        works = _bounded(lambda: self._on(device, lambda: dist.batch_isend_irecv(ops)),
                         _timeout(), "a tensor-parallel transfer", (ops, keep, got))
        return works, keep, got, device.type == "cuda"

    @staticmethod
    def _on(device: Device, call: Callable[[], Any]) -> Any:
        """``call()`` with ``device`` PyTorch's current CUDA device (on the calling thread)."""
        if device.type != "cuda":
            return call()
        import torch

        with torch.cuda.device(device.index):
            return call()

    @staticmethod
    def _wait(works: Sequence[Any], cuda: bool, limit: Optional[float], began: float,
              keep: Any, what: str) -> None:
        """Waits for ``works``: NCCL's polled on the host up to ``limit`` seconds from ``began``
        (its ``wait`` only orders PyTorch's current stream, and the results are used next on
        streams PyTorch does not know), gloo's by ``wait`` with the time left (its works tell
        completion only from ``wait``). ``keep``: what the works read and write, kept for the
        life of the process where they time out."""
        import datetime
        import time

        for work in works:
            while cuda and not work.is_completed():
                if limit is not None and time.monotonic() - began > limit:
                    _abandoned.append(keep)
                    raise _TransferError(
                        f"{what} did not finish{_deadline_text(limit)}: a peer did not take "
                        f"part (it may have failed or exited)"
                    )
                time.sleep(5e-5)
            try:
                if cuda or limit is None:
                    work.wait()
                else:
                    left = max(limit - (time.monotonic() - began), 1e-3)
                    work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                _abandoned.append(keep)
                raise _TransferError(f"{what} failed: {e}") from e

    def agree(self, device: Device, ok: bool, limit: Optional[float]) -> bool:
        """Whether every rank's load succeeded: one all-reduce (maximum) of each rank's status,
        a 4-byte tensor on ``device`` (on the current CUDA device where the group has no CPU
        backend and ``device`` is the CPU), over the group; ``RuntimeError`` where a rank does not
        take part within ``limit`` seconds (``None``: no limit). The limit also bounds how far
        apart the ranks reach it: a rank that reaches it later than that fails too."""
        import time

        import torch
        import torch.distributed as dist

        began = time.monotonic()
        if device.type == "cpu" and not any(
                b in str(dist.get_backend(self.group)) for b in ("gloo", "mpi", "cpu:")):
            # An NCCL-only group carries CUDA tensors alone.
            device = Device(f"cuda:{torch.cuda.current_device()}")
        flag = torch.full((1,), 0 if ok else 1, dtype=torch.int32, device=str(device))
        if device.type == "cuda":
            # Filled before the all-reduce, which another thread issues (its current stream).
            torch.cuda.current_stream(device.index).synchronize()
        work = _bounded(
            lambda: self._on(device, lambda: dist.all_reduce(
                flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)),
            limit, "the ranks' agreement on the load", flag)
        self._wait([work], device.type == "cuda", limit, began, flag,
                   "the ranks' agreement on the load")
        return int(flag.item()) == 0

    def finish(self, pending: Any) -> List[Tuple[_Recv, Optional[Array]]]:
        """Waits for a started step's transfers: each part received, ``None`` for one received
        into its target (``RuntimeError`` after the transfer timeout of
        :mod:`dlbridge.nccl`, ``DLBRIDGE_NCCL_TIMEOUT``, or the process group's own error)."""
        if pending is None:
            return []
        import time

        from .nccl import _timeout

        works, keep, got, cuda = pending
        self._wait(works, cuda, _timeout(), time.monotonic(), pending,
                   "a tensor-parallel transfer")
        received: List[Tuple[_Recv, Optional[Array]]] = got
        return received


class _NcclComm:
    """Point-to-point transfers over a ``dlbridge.nccl`` communicator: a step's parts for one
    peer packed into one block, sent by one ``send`` and received by one ``recv`` as typed views
    of one new block (the layout both sides compute from the parts' shapes, :func:`_layout`).
    ``send`` and ``recv`` each wait until done, so the pairs go in one order on every rank (by
    sender, then receiver): each send meets its receive."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def start(self, device: Device, sends: Mapping[int, List[Array]],
              recvs: Mapping[int, List[_Recv]]) -> Any:
        me = self.comm.rank
        got: List[Tuple[_Recv, Array]] = []
        for src, dst in sorted([(me, p) for p in sends] + [(p, me) for p in recvs]):
            if src == me:
                block, _ = _pack(sends[dst], device)
                self.comm.send([block], dst)
            else:
                specs = recvs[src]
                total, views = _layout([(r.shape, r.dtype) for r in specs])
                got.extend(zip(specs, self.comm.recv([(total, 0)], views, src)))
        return got

    def finish(self, pending: Any) -> List[Tuple[_Recv, Optional[Array]]]:
        received: List[Tuple[_Recv, Optional[Array]]] = pending
        return received

    def agree(self, device: Device, ok: bool, limit: Optional[float]) -> bool:
        """Whether every rank's load succeeded: rank 0 receives each rank's status (one byte)
        and sends each the verdict, by the communicator's ``send``/``recv`` (a star: rank 0's
        pairs only; each waits up to the communicator's own timeout, whatever ``limit`` says)."""
        me, size = self.comm.rank, self.comm.size
        spec = [((1,), "uint8")]
        total, views = _layout(spec)

        def block(value: int) -> Array:
            return _dlbridge.full((total,), value, "uint8").to(device)

        def value(got: Sequence[Array]) -> int:
            return int(got[0].to("cpu").tolist()[0])

        status = 0 if ok else 1
        if me == 0:
            for peer in range(1, size):
                status = max(status, value(self.comm.recv([(total, 0)], views, peer)))
            for peer in range(1, size):
                self.comm.send([block(status)], peer)
        else:
            self.comm.send([block(status)], 0)
            status = value(self.comm.recv([(total, 0)], views, 0))
        return status == 0


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


class _Step(NamedTuple):
    """A step read and kept, its hand-out started: per local slot ``{name: part}`` so far, and the
    transport's pending transfers."""

    out: List[Dict[str, Any]]
    pending: Any


class _Engine:
    """One load's plan (see the module's documentation) and the steps that carry it out: each
    step reads this process's bytes of some tensors by one run of the reader, keeps each local
    rank's parts and hands the others theirs (:meth:`start`), then receives (:meth:`finish`).

    ``names``: the tensors to walk (all, in file order, by default); every rank walks the same
    ones, so that all agree on the owners."""

    def __init__(self, ckpt: Any, devices: Sequence[Device], local: Sequence[int], world: int,
                 plan: Any, targets: Optional[Sequence[Mapping[str, Any]]], transport: Any,
                 threads: Optional[int], direct_io: Optional[bool],
                 names: Optional[Sequence[str]] = None, copy: bool = False) -> None:
        self.ckpt, self.devices, self.local, self.world = ckpt, devices, list(local), world
        self.targets, self.transport = targets, transport
        self.threads, self.direct_io, self.copy = threads, direct_io, copy
        wanted = None if names is None else set(names)
        self.infos: List[_Info] = []
        for name in ckpt.offset_keys():
            if wanted is not None and name not in wanted:
                continue
            _, shape, (begin, end), _ = ckpt.info(name)
            self.infos.append(_Info(name, ckpt.dtype(name), tuple(shape), end - begin))
        self.splits = {i.name: (_shard.resolve(plan, i.name, i.shape, world) if plan is not None
                                else None) for i in self.infos}
        self.owners = _owners(self.infos, self.splits, world)
        self.total = sum(i.nbytes for i in self.infos)
        self.read = 0
        """The bytes of the files this process needed so far."""
        self.waited: set[int] = set()
        """The local slots whose device a step waited for (the work queued there before the load,
        which the reader's streams do not wait for): the first step with targets on a device
        does; later steps need not (their waits would also wait for the previous steps'
        transfers and, in a stream, the consumer's compute). New arrays need no wait."""

    def target_of(self, slot: int, name: str) -> Any:
        return None if self.targets is None else self.targets[slot].get(name)

    def batches(self) -> List[List[_Info]]:
        """The tensors in file order, in steps: a step ends where the tensors read by their owners
        would pass ``_BATCH`` bytes (a larger one alone)."""
        steps: List[List[_Info]] = [[]]
        owned = 0
        for info in self.infos:
            if info.name in self.owners:
                if owned and owned + info.nbytes > _BATCH:
                    steps.append([])
                    owned = 0
                owned += info.nbytes
            steps[-1].append(info)
        return [s for s in steps if s]

    def _store(self, out: List[Dict[str, Any]], slot: int, name: str, value: Any,
               compact: bool) -> None:
        """``value`` (a part) kept for slot ``slot``: copied into its target where it has one,
        else as it is (``compact``: a compact copy, so that a whole tensor is not kept for one
        part of it)."""
        t = self.target_of(slot, name)
        if t is not None:
            _copy_into(t, value)
            out[slot][name] = t
        else:
            out[slot][name] = value.copy() if compact and not value.is_contiguous else value

    def start(self, infos: Sequence[_Info],
              progress: Optional[Callable[[int, int], Any]] = None) -> _Step:
        """Reads this process's bytes of ``infos`` (its parts of one run, and the whole tensors it
        owns) by one run of the reader, keeps each local rank's parts, copies other local ranks
        theirs and starts sending the other ranks theirs and receiving this process's."""
        ckpt, devices, local = self.ckpt, self.devices, self.local
        out: List[Dict[str, Any]] = [{} for _ in local]
        items = []
        targeted: set[int] = set()
        wholes: Dict[str, Any] = {}
        for info in infos:
            name, split, owner = info.name, self.splits[info.name], self.owners.get(info.name)
            if owner is None:
                for slot, rank in enumerate(local):
                    t = self.target_of(slot, name)
                    if self.targets is not None and t is None:
                        continue  # no target here (a tied name, or a rank without it)
                    key = _key(info.shape, split, rank)
                    if t is not None:
                        items.append((name, key, t))
                        targeted.add(slot)
                        out[slot][name] = t
                    elif devices[slot].type == "cpu":
                        # A view of the mapped file (unless copy): nothing is read.
                        got = ckpt.load_part(name, key, devices[slot], self.copy)
                        self.read += got.nbytes
                        out[slot][name] = got
                    else:
                        got = _dlbridge.empty(_part_shape(info.shape, split, rank), info.dtype,
                                              device=devices[slot])
                        items.append((name, key, got))
                        out[slot][name] = got
            elif owner in local:
                slot = local.index(owner)
                t = self.target_of(slot, name)
                if split is None and t is not None:
                    items.append((name, (), t))  # the owner's own copy is its target
                    targeted.add(slot)
                    wholes[name] = _dlbridge.from_dlpack(t, copy=False)
                else:
                    whole = _dlbridge.empty(info.shape, info.dtype, device=devices[slot])
                    items.append((name, (), whole))
                    wholes[name] = whole
        if items:
            self.read += ckpt.load_parts_into(items, self.threads, self.direct_io, progress,
                                              wait=not targeted <= self.waited)
            self.waited |= targeted
        del items
        sends: Dict[int, List[Array]] = {}
        recvs: Dict[int, List[_Recv]] = {}
        for info in infos:
            name, split, owner = info.name, self.splits[info.name], self.owners.get(info.name)
            if owner is None:
                continue
            if owner in local:
                slot = local.index(owner)
                whole = wholes.pop(name)
                for rank in range(self.world):
                    part = whole[_key(info.shape, split, rank)]
                    if rank == owner:
                        if split is None and self.target_of(slot, name) is not None:
                            out[slot][name] = self.target_of(slot, name)
                        else:
                            self._store(out, slot, name, part, compact=True)
                    elif rank in local:
                        other = local.index(rank)
                        self._store(out, other, name, part.to(devices[other], copy=True),
                                    compact=False)
                    elif part.size:
                        sends.setdefault(rank, []).append(part)
                continue
            for slot, rank in enumerate(local):
                shape = _part_shape(info.shape, split, rank)
                t = self.target_of(slot, name)
                if 0 in shape:
                    # Nothing is sent for an empty part.
                    out[slot][name] = (t if t is not None else
                                       _dlbridge.empty(shape, info.dtype, device=devices[slot]))
                    continue
                recvs.setdefault(owner, []).append(_Recv(slot, name, shape, info.dtype, t))
        pending = None
        if sends or recvs:
            # One process per rank: one device.
            pending = _transferring(lambda: self.transport.start(devices[0], sends, recvs))
        return _Step(out, pending)

    def finish(self, step: _Step) -> List[Dict[str, Any]]:
        """Waits for a started step's transfers and keeps what this process received: per local
        slot, ``{name: part}`` of the step's tensors."""
        if step.pending is not None:
            for recv, got in _transferring(lambda: self.transport.finish(step.pending)):
                if recv.target is None:
                    step.out[recv.slot][recv.name] = got
                else:
                    if got is not None:
                        _copy_into(recv.target, got)
                    step.out[recv.slot][recv.name] = recv.target
        return step.out

    def conclude(self, error: Optional[BaseException]) -> None:
        """Ends a load of one process per rank on every rank alike: with no error here, the
        ranks agree (:meth:`_TorchGroup.agree`, :meth:`_NcclComm.agree`) and a rank that failed
        or did not take part within ``DLBRIDGE_NCCL_TIMEOUT`` is a ``RuntimeError`` here too;
        with a local error (not a transfer's), this rank tells the others, then raises it; a
        transfer's error is raised at once (the group is broken: the peers' transfers fail
        too). A load of one process (no transport) raises its error, if any."""
        global _last_agreement_seconds
        if self.transport is None or isinstance(error, _TransferError) or (
                error is not None and not isinstance(error, Exception)):
            if error is not None:
                raise error
            return
        import time

        from .nccl import _timeout

        began = time.perf_counter()
        limit = _timeout()
        if error is not None:
            # This rank's own error, raised once the others were told, or after a short wait
            # where they are not there to hear it (stuck in a step's transfers from this rank):
            # its status stays queued for them.
            short = _FAILED_AGREEMENT_SECONDS if limit is None else min(
                limit, _FAILED_AGREEMENT_SECONDS)
            try:
                self.transport.agree(self.devices[0], False, short)
            except Exception:
                pass  # the peers time out instead
            raise error
        if not _transferring(lambda: self.transport.agree(self.devices[0], True, limit)):
            # Already agreed: no second agreement after it (a _TransferError).
            raise _TransferError(
                "another rank's tensor-parallel load failed (it raised an error there): this "
                "rank's parts are loaded, but the group's load is not complete"
            )
        _last_agreement_seconds = time.perf_counter() - began


_last_agreement_seconds: Optional[float] = None

#: How long a rank whose own load failed waits at the agreement to tell the others before it
#: raises its error (its status stays queued for them where they come later).
_FAILED_AGREEMENT_SECONDS = 10.0
"""How long the last load's final agreement took in this process (for the benchmark)."""


def _transferring(call: Callable[[], Any]) -> Any:
    """``call()``, a transport's, its ``RuntimeError`` a :class:`_TransferError`."""
    try:
        return call()
    except _TransferError:
        raise
    except RuntimeError as e:
        raise _TransferError(str(e)) from e


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

    The tensors go in steps of file order (:meth:`_Engine.batches`); each step's transfers run
    while the next step is read, and are waited for after it."""
    engine = _Engine(ckpt, devices, local, world, plan, targets, transport, threads, direct_io,
                     names)
    out: List[Dict[str, Any]] = [{} for _ in local]
    total = engine.total

    def report(done: int) -> None:
        if progress is not None:
            progress(min(done, total), total)

    done = 0
    pending: Optional[_Step] = None
    try:
        for infos in engine.batches():
            size = sum(i.nbytes for i in infos)

            def reading(got: int, _total: int, base: int = done, size: int = size) -> None:
                report(base + min(got, size))

            step = engine.start(infos, reading)
            if pending is not None:
                for slot, parts in enumerate(engine.finish(pending)):
                    out[slot].update(parts)
            pending = step
            done += size
            report(done)
        if pending is not None:
            for slot, parts in enumerate(engine.finish(pending)):
                out[slot].update(parts)
    except BaseException as e:
        engine.conclude(e)
        raise
    engine.conclude(None)
    report(total)
    return out, engine.read


_BATCH = 512 << 20
"""The most bytes of tensors read by their owners in one step (a larger tensor alone). A step's
transfers run while the next step is read, so a load holds at most two steps' such tensors above
its results."""


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
    from .safetensors import _progress_callback

    into = _prepare_into(targets, checkpoint, strict, device, shard, rank, world_size, group)
    callback, bar = _progress_callback(progress)
    try:
        _run(into.ckpt, into.devices, into.local, into.world, into.plan, into.targets,
             into.transport, threads, direct_io, callback, into.walk)
    finally:
        if bar is not None:
            bar.close()
    return IncompatibleKeys(into.missing, into.unexpected)


class _Into(NamedTuple):
    """A load into targets, checked and planned (:func:`_prepare_into`)."""

    ckpt: Any
    devices: List[Device]
    local: List[int]
    world: int
    plan: Any
    targets: List[Dict[str, Any]]
    """Per local rank, name -> target (PyTorch tensors detached, tied names once)."""
    given: List[Dict[str, Any]]
    """Per local rank, name -> the target as the caller gave it (a module's ``Parameter``)."""
    transport: Any
    walk: Optional[List[str]]
    missing: List[str]
    unexpected: List[str]


def _prepare_into(targets: Any, checkpoint: Any, strict: bool, device: Any, shard: Any,
                  rank: Optional[int], world_size: Optional[int], group: Any,
                  caller: str = "load_into") -> _Into:
    """``load_into``'s arguments checked (names, shapes: before anything is read), its modules'
    ``meta`` tensors created and its plan built."""
    from .safetensors import _target

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
    given = groups
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
            f"{caller}(strict=True): "
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
    return _Into(ckpt, devices, local, world, plan, groups, given, transport, walk, missing,
                 unexpected)


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


_END = object()


class _PartStream:
    """A streaming load of parts or into targets (``stream_file`` with ``shard=`` or
    ``targets=``): a thread runs the engine's steps, one per group, each read, handed out and
    received before it is delivered as ``(group, {name: part}, ready)``, at most ``ahead``
    delivered groups waiting for the caller. On CUDA, the thread's work runs on a stream of its
    own and ``ready`` is an event recorded on it after the group's last copy."""

    def __init__(self, engine: _Engine, steps: List[Tuple[str, List[_Info]]], ahead: int,
                 given: Optional[Mapping[str, Any]]) -> None:
        import queue
        import threading

        self._engine, self._steps, self._given = engine, steps, given
        self._queue: Any = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._work, name="dlbridge-stream", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        import contextlib

        try:
            device = self._engine.devices[0]
            own = None
            scope: Any = contextlib.nullcontext()
            if device.type == "cuda":
                from . import cuda

                own = cuda.Stream(device)
                scope = cuda.stream(own)
            # Where each step reads straight into its targets (one process, no shard plan), one
            # load session for all steps: one reader (threads, streams, staging) for the stream,
            # no progress thread, and each step's copies ordered before `ready` on the device
            # rather than waited for on the host.
            session: Any = contextlib.nullcontext()
            if self._engine.transport is None and all(
                    s is None for s in self._engine.splits.values()):
                session = _dlbridge._LoadSession()
            with scope, session:
                for group, infos in self._steps:
                    if self._stop.is_set():
                        return
                    got = self._engine.finish(self._engine.start(infos))[0]
                    given = self._given
                    tensors = {i.name: got[i.name] if given is None else given[i.name]
                               for i in infos if given is None or i.name in given}
                    ready = None
                    if own is not None:
                        ready = cuda.Event(device)
                        ready.record(own)
                    if not self._put((group, tensors, ready)):
                        return
            self._engine.conclude(None)
            self._put(_END)
        except BaseException as e:  # handed to the caller's iteration
            try:
                self._engine.conclude(e)
            except BaseException as err:
                self._put(err)

    def __iter__(self) -> "_PartStream":
        return self

    def __next__(self) -> Tuple[str, Dict[str, Any], Any]:
        import queue

        while not self._done:
            try:
                item = self._queue.get(timeout=0.05)  # Ctrl-C is answered between waits
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                continue
            if item is _END:
                self._done = True
            elif isinstance(item, BaseException):
                self._done = True
                raise item
            else:
                return item  # type: ignore[no-any-return]
        raise StopIteration

    def close(self) -> None:
        """Stops after the group being loaded (its transfers finish); drops what waits."""
        import queue

        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    def __del__(self) -> None:
        self._stop.set()


def stream_parts(
    path: Any, device: Any, names: Optional[Sequence[str]], grouping: Any, ahead: int,
    copy: bool, threads: Optional[int], direct_io: Optional[bool], shard: Any,
    rank: Optional[int], world_size: Optional[int], group: Any, targets: Any, strict: bool,
) -> Tuple[_PartStream, List[Tuple[str, List[str]]]]:
    """``stream_file`` with a shard plan or targets: the stream and its plan of groups."""
    from .safetensors import _target
    from .safetensors._stream import plan_groups

    if isinstance(device, (list, tuple)):
        raise ValueError(
            "stream_file streams onto one device: give device= one device (one process per rank "
            "with rank=, world_size= and group=)"
        )
    if targets is not None:
        into = _prepare_into(targets, path, strict, device, shard, rank, world_size, group,
                             caller="stream_file")
        ckpt, devices, local, world = into.ckpt, into.devices, into.local, into.world
        plan, slots, transport = into.plan, into.targets, into.transport
        given: Optional[Dict[str, Any]] = {k: into.given[0][k] for k in slots[0]}
        every = into.walk if into.walk is not None else list(ckpt.offset_keys())
    else:
        if shard == "targets":
            raise ValueError("shard='targets' builds the plan from the targets: give targets=")
        devices = _devices(device)
        local, world, transport = _ranks(devices, shard, rank, world_size, group)
        ckpt = _dlbridge._Checkpoint(_target(path))
        plan, slots, given = shard, None, None
        every = list(ckpt.offset_keys())
    if names is None:
        names = every
    else:
        known = set(ckpt.keys())
        missing = [n for n in names if n not in known]
        if missing:
            raise KeyError(f"no tensor named {missing[0]!r} in the checkpoint")
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor {twice!r} is named twice in order")
    engine = _Engine(ckpt, devices, local, world, plan, slots, transport, threads, direct_io,
                     names, copy=copy)
    by_name = {i.name: i for i in engine.infos}
    planned = plan_groups(names, grouping)
    steps = [(g, [by_name[n] for n in members]) for g, members in planned]
    shown = [(g, [n for n in members if given is None or n in given]) for g, members in planned]
    return _PartStream(engine, steps, ahead, given), shown
