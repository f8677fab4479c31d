"""dlbridge arrays on Ray.

Two ways an array moves between Ray workers:

* **The object store** (nothing to set up). ``ray.put(a)``, task arguments and return values
  pickle a CPU :class:`dlbridge.Array` under protocol 5 with its memory out of band, so Ray writes
  the bytes into its shared-memory object store once and the receiver gets a **read-only** array
  viewing the object store's memory, without a copy (``numpy.from_dlpack`` or ``torch.from_dlpack``
  of it are views of the same memory). Views with strides arrive as equal, compact arrays (the
  sender compacts them while pickling). Arrays of other devices go by value (copied through the
  host).

  Read-only is kept by the consumers that honour DLPack's read-only flag (dlbridge, NumPy, JAX:
  a write raises). PyTorch has no read-only tensors and ignores the flag: a write through
  ``torch.from_dlpack(a)`` lands in the stored object, and every reader on the node sees it, as
  with NumPy arrays from Ray (``torch.from_numpy(ray.get(ref))``). The object store's pages are
  writable, so such a write never faults. To write, copy first:
  ``dlbridge.asarray(a, copy=True)`` or ``torch.from_dlpack(a).clone()``.

* **The dlbridge tensor transport** (``import dlbridge.ray``, then
  ``tensor_transport="dlbridge"``).
  Ray's direct transport ("RDT") keeps the array in the producing actor and hands the consumer a
  small description; this transport shares the memory itself (``Array.share``): on one node the
  consumer maps the producer's CPU or CUDA memory, so a write on either side is seen on the other
  and a CUDA consumer's stream waits for the producer's queued work (an IPC event), without a
  host synchronize. Arrays not in shareable memory are copied once, all of one call's arrays
  into **one** block per device, so a thousand small arrays cost one allocation, one descriptor
  and one mapping; views of one shareable allocation share one handle::

      import ray, dlbridge, dlbridge.ray

      dlbridge.ray.register()   # importing dlbridge.ray registers it; before defining actors

      @ray.remote(num_gpus=0.5, enable_tensor_transport=True)
      class Producer:
          @ray.method(tensor_transport="dlbridge")
          def weights(self):
              import jax.numpy as jnp
              return dlbridge.from_dlpack(jnp.ones((1024, 1024)))

      @ray.remote(num_gpus=0.5, enable_tensor_transport=True)
      class Consumer:
          def total(self, w):
              import torch
              return float(torch.from_dlpack(w).sum())   # the producer's memory, no copy

      p, c = Producer.remote(), Consumer.remote()
      print(ray.get(c.total.remote(p.weights.remote())))

  Both actors need ``enable_tensor_transport=True`` (Ray then runs transfers on a thread of
  their own; without it a second transfer to a busy actor waits forever). The transport is
  one-sided: the consumer receives the producer's descriptors from a small server in the
  producer (an abstract Unix socket, ``SCM_RIGHTS``), which needs both on one node. Between nodes it raises a
  clear error: ship such arrays through the object store, or with the NCCL transport below.

* **The dlbridge NCCL transport** (``tensor_transport="dlbridge_nccl"``), for CUDA arrays between
  GPUs that do not share memory: two GPUs of a node, or two nodes. Two-sided over NCCL: the
  producer sends, the consumer receives a copy into one new block of its own GPU memory (arrays
  of one allocation, and a pool's blocks laid end to end, travel as one NCCL operation; see
  ``dlbridge.nccl``). The actors must first be joined in a group, once, by the process that calls
  their methods::

      p, c = Producer.remote(), Consumer.remote()      # a GPU each (num_gpus=1)
      dlbridge.ray.create_nccl_group([p, c])
      ray.get(c.total.remote(p.weights_nccl.remote()))  # a method with tensor_transport="dlbridge_nccl"

Memory stays valid while the producer holds the object (until Ray's reference counting frees it,
which closes the producer's descriptors) and, after that, while any consumer still maps it.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

try:
    import ray
except ImportError as _e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "dlbridge.ray needs Ray: install it with `pip install 'dlbridge[ray]'` (or `pip install "
        "ray`)"
    ) from _e

try:
    from ray.experimental.rdt.tensor_transport_manager import (
        CommunicatorMetadata,
        TensorTransportManager,
        TensorTransportMetadata,
    )
    from ray.experimental.rdt.util import register_tensor_transport as _register
except ImportError as _e:  # pragma: no cover - depends on the installed Ray
    raise ImportError(
        f"dlbridge.ray needs a Ray with custom tensor transports "
        f"(ray.experimental.register_tensor_transport; dlbridge is tested with Ray 2.60); this is Ray "
        f"{getattr(ray, '__version__', '?')}: `pip install -U 'dlbridge[ray]'`"
    ) from _e

from . import _dlbridge
from ._dlbridge import Array, SharedHandle

__all__ = [
    "DEVICES",
    "NCCL_TRANSPORT",
    "TRANSPORT",
    "DlbridgeNcclTransport",
    "DlbridgeTransport",
    "create_nccl_group",
    "destroy_nccl_group",
    "is_registered",
    "register",
]

#: The transport's name, as ``tensor_transport=`` takes it (case does not matter).
TRANSPORT = "DLBRIDGE"

#: The device types the transport carries (``cuda_host`` is pinned host memory).
DEVICES = ("cpu", "cuda", "cuda_host")


@dataclass
class DlbridgeTransportMetadata(TensorTransportMetadata):
    """What a consumer needs to map a producer's arrays: one handle state per shared allocation
    (its descriptor comes from the producer's descriptor server), one view tuple per array, and
    where the producer runs."""

    handles: list[bytes] = field(default_factory=list)
    views: list[tuple[Any, ...]] = field(default_factory=list)
    pid: int = 0
    #: The producer's descriptor server (an abstract Unix socket address).
    address: str = ""
    node_id: str = ""
    #: The Ray GPU ids of the producer, in its CUDA device order (its ``ray.get_gpu_ids()``).
    gpu_ids: list[Any] = field(default_factory=list)


class DlbridgeTransport(TensorTransportManager):
    """Ray's ``TensorTransportManager`` for :class:`dlbridge.Array` on ``cpu`` and ``cuda``: a
    one-sided transport over shared memory (see the module's documentation)."""

    def __init__(self) -> None:
        # The producer's handles per object: their descriptors stay open (for consumers to reopen)
        # until Ray frees the object.
        self._held: dict[str, list[SharedHandle]] = {}
        self._lock = threading.Lock()
        self._server: Optional[_DescriptorServer] = None

    @property
    def tensor_transport_backend(self) -> str:  # type: ignore[override]
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        # A receive maps memory and returns; nothing can be left blocked, so aborting is a no-op.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> DlbridgeTransportMetadata:
        arrays, device_type = _arrays_of(rdt_object, "dlbridge", DEVICES)
        handles, views = _dlbridge._share_many(arrays)
        with self._lock:
            self._held[obj_id] = handles
            if self._server is None:
                self._server = _DescriptorServer(self)
        tensor_meta = _tensor_meta(arrays)
        return DlbridgeTransportMetadata(
            tensor_meta=tensor_meta,
            tensor_device=device_type,
            handles=[h._state() for h in handles],
            views=views,
            pid=os.getpid(),
            address=self._server.address,
            node_id=ray.get_runtime_context().get_node_id(),
            gpu_ids=list(ray.get_gpu_ids()) if device_type in ("cuda", "cuda_host") else [],
        )

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: Optional[str] = None
    ) -> CommunicatorMetadata:
        return CommunicatorMetadata()

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[list[Any]] = None,
    ) -> list[Any]:
        meta = tensor_transport_metadata
        if not isinstance(meta, DlbridgeTransportMetadata):
            raise TypeError(
                f"the dlbridge transport got {type(meta).__name__}, not its own metadata"
            )
        if target_buffers:
            raise ValueError(
                "the dlbridge transport maps the producer's memory; it does not receive into "
                "buffers (copy the received arrays into yours)"
            )
        if not meta.views:
            return []
        here = ray.get_runtime_context().get_node_id()
        if here != meta.node_id:
            raise ValueError(
                f"the dlbridge transport shares memory on one node: this worker runs on node "
                f"{here}, the producer on {meta.node_id}. Send CUDA arrays between nodes with "
                f"tensor_transport='dlbridge_nccl' (after dlbridge.ray.create_nccl_group), and "
                f"host arrays through the object store (a plain return value)"
            )
        fds = _fetch_descriptors(meta.address, obj_id, len(meta.handles), meta.pid)
        handles = [SharedHandle._rebuild(state, fd) for state, fd in zip(meta.handles, fds)]
        ordinal = None
        if meta.tensor_device in ("cuda", "cuda_host"):
            ordinal = _local_cuda_ordinal(meta.gpu_ids, {h.device.index for h in handles})
        return list(_dlbridge._open_many(handles, meta.views, ordinal))

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        raise NotImplementedError(
            "the dlbridge transport is one-sided: the consumer maps the memory, nothing is sent"
        )

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        with self._lock:
            self._held.pop(obj_id, None)  # closes the producer's descriptors

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        return None

    def _descriptors(self, obj_id: str) -> Optional[list[int]]:
        """The producer's descriptors of an object it holds (for the descriptor server)."""
        with self._lock:
            handles = self._held.get(obj_id)
            if handles is None:
                return None
            # Every handle owns a descriptor until it is opened, and held handles never are.
            return [fd for h in handles if (fd := h.fd) is not None]

    def held_objects(self) -> int:
        """How many objects this process holds descriptors for (a diagnostic for leak tests)."""
        with self._lock:
            return len(self._held)


def _arrays_of(
    rdt_object: list[Any], transport: str, devices: tuple[str, ...], hint: str = ""
) -> tuple[list[Array], Optional[str]]:
    """The arrays of an object a transport sends, checked: dlbridge arrays, all on one kind of
    device, one the transport carries; and that device type (``None`` for no arrays)."""
    arrays = list(rdt_object)
    for a in arrays:
        if not isinstance(a, Array):
            raise TypeError(
                f"the {transport} transport carries dlbridge.Array, not {type(a).__name__}: "
                f"wrap it with dlbridge.from_dlpack"
            )
    kinds = {a.device.type for a in arrays}
    if len(kinds) > 1:
        raise ValueError(
            f"the arrays of one object must be on one kind of device, not {sorted(kinds)}"
        )
    device_type = kinds.pop() if kinds else None
    if device_type not in (None, *devices):
        raise ValueError(
            f"the {transport} transport carries arrays on {', '.join(devices)}, not on "
            f"{device_type}{hint}"
        )
    return arrays, device_type


def _tensor_meta(arrays: list[Array]) -> list[Any]:
    """Ray's `tensor_meta` of the arrays: (shape, dtype name) each. Ray types it for PyTorch and
    NumPy dtypes; dlbridge's dtype names carry more (bfloat16, float8 kinds), so they go as
    names."""
    return [(tuple(a.shape), str(a.dtype)) for a in arrays]


#: Descriptors per message (the kernel takes at most 253 per `SCM_RIGHTS` message).
_FDS_PER_MESSAGE = 200


class _DescriptorServer:
    """Hands the descriptors of the objects a producer holds to the consumers that ask, over an
    abstract Unix socket with ``SCM_RIGHTS``: the consumer receives the producer's open files
    themselves (a CUDA VMM handle must be the exporter's file, not a reopening of its path)."""

    def __init__(self, transport: DlbridgeTransport) -> None:
        self.address = f"\0dlbridge-ray-{os.getpid()}-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._transport = transport
        threading.Thread(target=self._serve, name="dlbridge-ray-fds", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: Any) -> None:
        with conn:
            # A peer that connects and never asks (or never acknowledges) cannot hold this thread
            # for ever.
            conn.settimeout(_dlbridge._share_timeout())
            try:
                # The request first, whoever sends it: an answer written before the asker has
                # finished writing would break its write (EPIPE) instead of being read.
                obj_id = _read_line(conn)
                # Abstract socket names are visible to every user of the machine: hand
                # descriptors only to processes of this user (who could read this process's
                # memory anyway).
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                _, uid, _ = struct.unpack("3i", creds)
                if uid != os.getuid():
                    conn.sendall(b"\x02")
                    return
                fds = self._transport._descriptors(obj_id)
                if fds is None:
                    conn.sendall(b"\x00")
                    return
                for i in range(0, len(fds), _FDS_PER_MESSAGE):
                    chunk = fds[i : i + _FDS_PER_MESSAGE]
                    socket.send_fds(conn, [b"\x01"], chunk)
                _read_line(conn)  # the consumer's acknowledgement: it holds them all
            except OSError:
                return


#: The longest line either side sends (an object id, an acknowledgement).
_MAX_LINE = 1024


def _read_line(conn: Any) -> str:
    data = b""
    while not data.endswith(b"\n"):
        if len(data) > _MAX_LINE:
            raise OSError("the peer sent an over-long line")
        chunk = conn.recv(_MAX_LINE)
        if not chunk:
            raise OSError("the peer closed the connection")
        data += chunk
    return data[:-1].decode(errors="replace")


def _check_server(sock: Any, pid: int) -> None:
    """Fails unless the descriptor server at the other end of ``sock`` is the producer: its
    process ``pid``, of this user (or root). The socket's name is visible to every user
    (``/proc/net/unix``), and once the producer exited anyone may bind it."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    peer_pid, uid, _ = struct.unpack("3i", creds)
    if uid not in (os.getuid(), 0):
        raise PermissionError(
            f"the producer's descriptor socket is held by a process of another user (uid {uid}), "
            f"not by the producer (process {pid}, which has exited): refused"
        )
    if peer_pid != pid:
        raise PermissionError(
            f"the producer's descriptor socket is held by process {peer_pid}, not by the "
            f"producer (process {pid}): refused (the producer has exited, or runs in another PID "
            f"namespace)"
        )


def _fetch_descriptors(
    address: str, obj_id: str, count: int, pid: int, timeout: Optional[float] = None
) -> list[int]:
    """The descriptors of ``obj_id`` from the producer's descriptor server (owned by the caller).
    Waits at most ``timeout`` seconds (default ``DLBRIDGE_SHARE_TIMEOUT``, or 30) for the producer
    (``TimeoutError``); Ctrl-C interrupts the wait."""
    fds: list[int] = []
    wait = _dlbridge._share_timeout() if timeout is None else timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(wait)
            sock.connect(address)
            _check_server(sock, pid)
            sock.sendall(obj_id.encode() + b"\n")
            while len(fds) < count:
                msg, got, _, _ = socket.recv_fds(sock, 1, _FDS_PER_MESSAGE)
                fds.extend(got)
                if msg == b"\x02":
                    raise PermissionError(
                        f"the producer (process {pid}) runs as another user and does not hand "
                        f"its memory to this one"
                    )
                if msg != b"\x01":
                    raise OSError(
                        f"the producer (process {pid}) no longer holds the object: it was freed"
                    )
            sock.sendall(b"ok\n")
    except BaseException as e:
        for fd in fds:
            os.close(fd)
        if isinstance(e, TimeoutError):
            raise TimeoutError(
                f"the producer (process {pid}) did not hand over its memory within {wait:g} s (it "
                f"is stopped or busy): set DLBRIDGE_SHARE_TIMEOUT=<seconds> to wait longer"
            ) from e
        if isinstance(e, PermissionError) or not isinstance(e, OSError):
            raise
        raise OSError(
            f"cannot reach the producer's memory (process {pid} may have exited, or freed the "
            f"object): {e}"
        ) from e
    return fds


def _local_cuda_ordinal(producer_gpu_ids: list[Any], ordinals: set[int]) -> Optional[int]:
    """The CUDA ordinal in this process of the producer's GPU, from both sides' Ray GPU ids
    (Ray gives each actor its own ``CUDA_VISIBLE_DEVICES``, so ordinals differ between them)."""
    if len(ordinals) != 1:
        raise ValueError("the arrays of one object must be on one CUDA device")
    if not producer_gpu_ids:
        return None  # the producer was given no GPU by Ray: ordinals are the same everywhere
    (producer_ordinal,) = ordinals
    physical = str(producer_gpu_ids[producer_ordinal])
    mine = [str(g) for g in ray.get_gpu_ids()]
    if physical in mine:
        return mine.index(physical)
    if not mine and "CUDA_VISIBLE_DEVICES" not in os.environ:
        return int(physical)
    raise ValueError(
        f"this actor receives a CUDA array on GPU {physical}, which Ray did not give it (its GPUs: "
        f"{', '.join(mine) or 'none'}): give it that GPU (num_gpus; fractional GPUs share one), or "
        f"send the array through the object store"
    )



# --- Between GPUs and hosts: NCCL ------------------------------------------------------------

#: The name of the transport that copies CUDA arrays over NCCL, between GPUs and between nodes.
NCCL_TRANSPORT = "DLBRIDGE_NCCL"


@dataclass
class DlbridgeNcclMetadata(TensorTransportMetadata):
    """What a receiver needs before an NCCL transfer: the sender's runs of bytes (length, address
    phase) and each array's view of them (see ``dlbridge.nccl``)."""

    runs: list[tuple[int, int]] = field(default_factory=list)
    views: list[tuple[Any, ...]] = field(default_factory=list)
    #: The object's id (what `abort_transport` names).
    obj_id: str = ""


@dataclass
class DlbridgeNcclCommunicatorMetadata(CommunicatorMetadata):
    """The group both actors are in and their ranks there."""

    group: str = ""
    src_rank: int = -1
    dst_rank: int = -1
    #: Why the transfer cannot happen (no common group), raised by both actors.
    error: str = ""


@dataclass
class _Group:
    name: str
    #: Actor id (hex) to rank.
    ranks: dict[str, int]
    actors: list[Any]


#: The groups made by `create_nccl_group` in this process (the driver), by name.
_groups: dict[str, _Group] = {}
#: This process's communicators, by group name (in the actors).
_communicators: dict[str, Any] = {}
_groups_lock = threading.Lock()


def _actor_key(actor: Any) -> str:
    return actor._ray_actor_id.hex()


def _nccl_make_id(_self: Any) -> bytes:
    from . import nccl

    return nccl.unique_id()


def _nccl_join(
    _self: Any, name: str, uid: bytes, size: int, rank: int, device: int, timeout: Optional[float]
) -> str:
    from . import nccl

    comm = nccl.Communicator(uid, size, rank, device, timeout=timeout)
    with _groups_lock:
        _communicators[name] = comm
    return ray.get_runtime_context().get_node_id()


def _nccl_leave(_self: Any, name: str) -> None:
    with _groups_lock:
        comm = _communicators.pop(name, None)
    del comm  # destroyed here, outside the lock


def create_nccl_group(
    actors: list[Any],
    name: Optional[str] = None,
    devices: Optional[list[int]] = None,
    timeout: Optional[float] = 120.0,
) -> str:
    """Joins ``actors`` (rank = position) in one NCCL communicator for the ``dlbridge_nccl``
    transport, and returns the group's name. Call it in the process that will call the actors'
    methods (the driver), after the actors exist. Each actor uses CUDA device ``devices[rank]``
    (an ordinal as that actor numbers its GPUs; default ``0``, the first GPU Ray gave it). Every
    actor needs a GPU of its own: NCCL refuses two ranks on one GPU. Joining that takes longer
    than ``timeout`` seconds (an actor that failed or cannot start) raises ``GetTimeoutError``,
    and the actors that joined leave the group."""
    actors = list(actors)
    if len(actors) < 2:
        raise ValueError(f"an NCCL group needs at least two actors, not {len(actors)}")
    keys = [_actor_key(a) for a in actors]
    if len(set(keys)) != len(keys):
        raise ValueError("every actor of an NCCL group must be a different actor")
    devices = [0] * len(actors) if devices is None else [int(d) for d in devices]
    if len(devices) != len(actors):
        raise ValueError(f"{len(devices)} devices for {len(actors)} actors")
    name = name or f"dlbridge-nccl-{uuid.uuid4().hex}"
    with _groups_lock:
        if name in _groups:
            raise ValueError(f"an NCCL group named {name!r} exists already")
        # Reserved now (with no ranks yet, so no transfer picks it), made below.
        _groups[name] = _Group(name, {}, [])
    try:
        uid = ray.get(actors[0].__ray_call__.remote(_nccl_make_id), timeout=timeout)
        ray.get(
            [
                a.__ray_call__.remote(
                    _nccl_join, name, uid, len(actors), rank, devices[rank], timeout
                )
                for rank, a in enumerate(actors)
            ],
            timeout=timeout,
        )
    except BaseException:
        # Those that joined let go; one still in NCCL's join gives up by the same timeout (NCCL
        # 2.14 and later).
        with _groups_lock:
            _groups.pop(name, None)
        for a in actors:
            try:
                a.__ray_call__.remote(_nccl_leave, name)
            except Exception:
                pass
        raise
    with _groups_lock:
        _groups[name] = _Group(name, {k: r for r, k in enumerate(keys)}, actors)
    return name


def destroy_nccl_group(name: str) -> None:
    """Destroys the group ``name`` in its actors (those still alive) and forgets it here."""
    with _groups_lock:
        group = _groups.pop(name, None)
    if group is None:
        raise ValueError(f"no NCCL group named {name!r} was made in this process")
    refs = [a.__ray_call__.remote(_nccl_leave, name) for a in group.actors]
    for r in refs:
        try:
            ray.get(r)
        except Exception:
            pass  # an actor that died took its communicator with it


def _group_of(src: Any, dst: Any) -> Optional[tuple[_Group, int, int]]:
    s, d = _actor_key(src), _actor_key(dst)
    with _groups_lock:
        found = [g for g in _groups.values() if s in g.ranks and d in g.ranks]
    if not found:
        return None
    g = found[-1]  # the newest (one made after an abort replaces the dead one)
    return g, g.ranks[s], g.ranks[d]


_NO_GROUP = (
    "the dlbridge_nccl transport needs both actors in one NCCL group: call "
    "dlbridge.ray.create_nccl_group([producer, consumer]) in the process that calls their methods "
    "(the driver) first"
)


class DlbridgeNcclTransport(TensorTransportManager):
    """Ray's ``TensorTransportManager`` for :class:`dlbridge.Array` in CUDA device memory, over
    NCCL (two-sided: the producer sends, the consumer receives a copy into its own GPU memory).
    Works between any two GPUs NCCL connects: one host's (NVLink, PCIe) or two hosts' (InfiniBand,
    RoCE, TCP). Arrays of one allocation travel as one run of bytes (see ``dlbridge.nccl``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The object each communicator (by id) moves now, and objects aborted before their
        # transfer began here.
        self._current: dict[int, str] = {}
        self._aborted: set[str] = set()
        # Per object, an event after the producer's queued work on the arrays (recorded on the
        # producing thread's stream; the send, on Ray's transfer thread, waits for it).
        self._ready: dict[str, Any] = {}

    @property
    def tensor_transport_backend(self) -> str:  # type: ignore[override]
        return NCCL_TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return False

    @staticmethod
    def can_abort_transport() -> bool:
        # A transfer whose other side failed is interrupted (`abort_transport`): it stops waiting
        # and aborts the group's communicator, so no actor is left blocked (and Ray need not kill
        # the actors). One stuck on a peer that died ends by its timeout.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Every actor can run the transport; a pair outside a common group is refused by both
        # actors when the transfer runs (the owner's communicator metadata carries the reason,
        # which names `create_nccl_group`; Ray's own refusal here names its collective groups).
        return True

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> DlbridgeNcclMetadata:
        arrays, _ = _arrays_of(
            rdt_object,
            "dlbridge_nccl",
            ("cuda",),
            ": it copies CUDA device memory; send host arrays through the object store or the "
            "dlbridge transport",
        )
        ordinals = {a.device.index for a in arrays}
        if len(ordinals) > 1:
            raise ValueError(
                f"the arrays of one object must be on one CUDA device, not on {sorted(ordinals)}"
            )
        runs, views = _dlbridge._nccl_plan(arrays)
        if arrays:
            ready = _dlbridge.Event(arrays[0].device)
            ready.record()  # after the work queued on this thread's current stream
            with self._lock:
                self._ready[obj_id] = ready
        tensor_meta = _tensor_meta(arrays)
        return DlbridgeNcclMetadata(
            tensor_meta=tensor_meta,
            tensor_device="cuda" if arrays else None,
            runs=runs,
            views=views,
            obj_id=obj_id,
        )

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: Optional[str] = None
    ) -> DlbridgeNcclCommunicatorMetadata:
        # Never raises here (in the owner, inside Ray's scheduling of the transfer): both actors
        # raise the reason instead.
        found = _group_of(src_actor, dst_actor)
        if found is None:
            return DlbridgeNcclCommunicatorMetadata(error=_NO_GROUP)
        group, src, dst = found
        return DlbridgeNcclCommunicatorMetadata(group=group.name, src_rank=src, dst_rank=dst)

    @staticmethod
    def _communicator(meta: CommunicatorMetadata) -> Any:
        if not isinstance(meta, DlbridgeNcclCommunicatorMetadata):
            raise TypeError(f"the dlbridge_nccl transport got {type(meta).__name__}")
        if meta.error:
            raise ValueError(meta.error)
        with _groups_lock:
            comm = _communicators.get(meta.group)
        if comm is None:
            raise ValueError(
                f"this actor is not in the NCCL group {meta.group!r} (destroyed, or made "
                f"before this actor restarted)"
            )
        return comm

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        from . import nccl

        meta = tensor_transport_metadata
        if not isinstance(meta, DlbridgeNcclMetadata):
            raise TypeError(f"the dlbridge_nccl transport got {type(meta).__name__}")
        with self._lock:
            ready = self._ready.pop(meta.obj_id, None)
        if not meta.runs:
            return
        comm = self._communicator(communicator_metadata)
        if ready is not None:
            # This thread's stream waits for the producer's work on the arrays.
            device = comm.device
            handle = _dlbridge._cuda_current_stream(device) or 1  # 0: the legacy stream, 1
            stream = _dlbridge.Stream.from_handle(handle, device)
            stream.wait_event(ready)
        self._transfer(
            meta.obj_id,
            comm,
            lambda: comm.send(
                list(tensors),
                communicator_metadata.dst_rank,  # type: ignore[attr-defined]
                runs=[tuple(r) for r in meta.runs],
                timeout=nccl._timeout(),
            ),
        )

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[list[Any]] = None,
    ) -> list[Any]:
        from . import nccl

        meta = tensor_transport_metadata
        if not isinstance(meta, DlbridgeNcclMetadata):
            raise TypeError(f"the dlbridge_nccl transport got {type(meta).__name__}")
        if target_buffers:
            raise ValueError(
                "the dlbridge_nccl transport does not receive into given buffers: it receives "
                "into one new block of its own; copy the received arrays into yours"
            )
        if not meta.views:
            return []
        comm = self._communicator(communicator_metadata)
        return list(
            self._transfer(
                obj_id,
                comm,
                lambda: comm.recv(
                    [tuple(r) for r in meta.runs],
                    [tuple(v) for v in meta.views],
                    communicator_metadata.src_rank,  # type: ignore[attr-defined]
                    timeout=nccl._timeout(),
                ),
            )
        )

    def _transfer(self, obj_id: str, comm: Any, run: Any) -> Any:
        """Runs one side of the transfer of ``obj_id`` on ``comm``, where `abort_transport` can
        find it (and refuses it if the object was aborted before it began here)."""
        with self._lock:
            if obj_id in self._aborted:
                self._aborted.discard(obj_id)
                raise RuntimeError(
                    f"the transfer of object {obj_id} was aborted: its other side failed"
                )
            self._current[id(comm)] = obj_id
        try:
            return run()
        finally:
            with self._lock:
                self._current.pop(id(comm), None)

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        with self._lock:
            self._ready.pop(obj_id, None)  # an object freed unsent

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        # Interrupts this side's transfer of `obj_id` if it is waiting now (which aborts the
        # group's communicator: make a new group), or refuses it if it has not begun; other
        # objects' transfers are not touched.
        if not isinstance(communicator_metadata, DlbridgeNcclCommunicatorMetadata):
            return None
        with _groups_lock:
            comm = _communicators.get(communicator_metadata.group)
        with self._lock:
            if comm is not None and self._current.get(id(comm)) == obj_id:
                comm.interrupt()
            else:
                self._aborted.add(obj_id)
        return None


_registered = False
_registered_lock = threading.Lock()


def register() -> None:
    """Registers the dlbridge transport with Ray, for :class:`dlbridge.Array` on ``cpu``,
    ``cuda`` and ``cuda_host`` (idempotent; importing ``dlbridge.ray`` calls it). It must run in
    the driver before the classes that name the transport are defined; Ray registers it in the
    actors itself. Then ``@ray.method(tensor_transport="dlbridge")`` (or
    ``ray.put(a, _tensor_transport="dlbridge")`` in an actor) sends arrays through it."""
    global _registered
    with _registered_lock:
        if _registered:
            return
        try:
            _register(TRANSPORT, list(DEVICES), DlbridgeTransport, Array)
        except ValueError as e:
            if "already registered" not in str(e):
                raise
        try:
            _register(NCCL_TRANSPORT, ["cuda"], DlbridgeNcclTransport, Array)
        except ValueError as e:
            if "already registered" not in str(e):
                raise
        _registered = True


def is_registered() -> bool:
    """Whether the transport is registered in this process."""
    return _registered


# Importing the module registers the transport: `@ray.method(tensor_transport="dlbridge")` is
# checked when the class is defined, so it must be known by then.
register()
