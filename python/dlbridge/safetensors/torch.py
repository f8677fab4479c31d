"""``safetensors.torch`` over dlbridge: the same functions, signatures and errors, so that switching
is one import (``from dlbridge.safetensors.torch import load_file``).

>>> import torch, tempfile, os
>>> from dlbridge.safetensors.torch import load_file, save_file
>>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
>>> save_file({"w": torch.arange(4.0)}, path, metadata={"format": "pt"})
>>> load_file(path)["w"]
tensor([0., 1., 2., 3.])

``load_file(filename, device="cuda:0")`` reads through dlbridge's loader (parallel reads, pinned
staging, asynchronous copies) and hands PyTorch the loaded memory itself, through DLPack. On the
CPU the tensors are views of the mapped file, as ``safetensors`` gives them (a write lands in this
process's private copy-on-write pages). ``load_file`` also takes an index, a folder or a list of
shards, and ``device`` a ``torch.device``. Unlike ``safetensors``, ``save_file`` writes
non-contiguous tensors (their elements in order) instead of refusing them; tensors that share
memory are refused, as there, with a pointer to :func:`save_model`.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
from torch.utils.dlpack import from_dlpack

from .. import _dlbridge
from . import DeviceLike, _copy_for, load_file as _load_file, save_file as _save_file

__all__ = ["load", "load_file", "load_model", "save", "save_file", "save_model"]


def load_file(
    filename: Union[str, "os.PathLike[str]"],
    device: Union[str, int, torch.device, DeviceLike] = "cpu",
    *,
    backend: str = "mmap",
) -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors file (an index, a folder or a list of shards too) as
    ``torch.Tensor``s on ``device``: on the CPU views of the mapped file (``backend="pread"``:
    memory of their own), elsewhere read into device memory and handed over without a copy."""
    return _load_file(filename, device, framework="torch", copy=_copy_for(backend),
                      progress=False)


def load(data: bytes) -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes, each in CPU memory of its own."""
    _, arrays = _dlbridge._st_deserialize(data)
    return {name: from_dlpack(a) for name, a in arrays.items()}


def save_file(
    tensors: Dict[str, torch.Tensor],
    filename: Union[str, "os.PathLike[str]"],
    metadata: Optional[Dict[str, str]] = None,
) -> None:
    """Writes ``tensors`` (on any device) with ``metadata`` to ``filename``, atomically. As in
    ``safetensors``: not a dict, a value that is not a tensor, or a sparse tensor is a
    ``ValueError``; tensors sharing memory are a ``RuntimeError`` (see :func:`save_model`)."""
    _save_file(_checked(tensors), filename, metadata)


def save(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """``tensors`` with ``metadata`` in the safetensors format, as bytes (checked as
    :func:`save_file` checks them)."""
    return _dlbridge._st_serialize(_checked(tensors), None if metadata is None else dict(metadata))


def save_model(
    model: torch.nn.Module,
    filename: str,
    metadata: Optional[Dict[str, str]] = None,
    force_contiguous: bool = True,
) -> None:
    """Saves ``model.state_dict()`` keeping one name of each group of tensors that share memory
    (tied weights): the one that covers all of its memory (the first in name order), each other
    name recorded in the metadata as ``{dropped: kept}`` (entries the caller gave are kept).
    ``force_contiguous`` makes every tensor compact first (dlbridge writes strided ones as they
    are anyway)."""
    state_dict = model.state_dict()
    for kept, dropped in _duplicates(state_dict).items():
        for name in dropped:
            metadata = {} if metadata is None else metadata
            metadata.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    save_file(state_dict, filename, metadata=metadata)


def load_model(
    model: torch.nn.Module,
    filename: Union[str, "os.PathLike[str]"],
    strict: bool = True,
    device: Union[str, int, torch.device, DeviceLike] = "cpu",
    *,
    backend: str = "mmap",
) -> Tuple[List[str], List[str]]:
    """Loads a file :func:`save_model` wrote into ``model``: names it dropped as copies of shared
    tensors are filled through the tensor they share. Returns ``(missing, unexpected)``; with
    ``strict`` either is a ``RuntimeError`` naming them, as ``load_state_dict`` words it."""
    state_dict = load_file(filename, device=device, backend=backend)
    shared = _duplicates(model.state_dict(), preferred=state_dict.keys())
    result = model.load_state_dict(state_dict, strict=False)
    missing = set(result.missing_keys)
    unexpected = list(result.unexpected_keys)
    for dropped in shared.values():
        for name in dropped:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(
                f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(
                f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return sorted(missing), unexpected


def _extent(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes ``t`` addresses: from its first element's address to past its last one."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    return start, start + (reach + 1) * t.element_size()


def _shared(tensors: Dict[str, torch.Tensor]) -> List[Set[str]]:
    """The names of ``tensors`` in groups that share memory: tensors of one storage (on one
    device) whose bytes overlap. Tensors without memory (the meta device, empty storages) share
    nothing."""
    by_storage: Dict[Tuple[Any, int, int], List[str]] = defaultdict(list)
    for name, t in tensors.items():
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() == 0 or storage.nbytes() == 0:
            continue
        by_storage[(t.device, storage.data_ptr(), storage.nbytes())].append(name)
    groups: List[Set[str]] = []
    for names in by_storage.values():
        # Overlapping byte ranges, in order of their starts, make one group.
        group: Set[str] = set()
        end = 0
        for start, stop, name in sorted((*_extent(tensors[n]), n) for n in names):
            if group and start < end:
                group.add(name)
                end = max(end, stop)
            else:
                group = {name}
                groups.append(group)
                end = stop
    return groups


def _duplicates(state_dict: Dict[str, torch.Tensor],
                preferred: Iterable[str] = ()) -> Dict[str, List[str]]:
    """For each group of names sharing memory, the name kept (one whose tensor covers its whole
    storage; among those, one of ``preferred``, then the first in name order) and the others."""
    preferred = set(preferred)
    out: Dict[str, List[str]] = {}
    for group in _shared(state_dict):
        if len(group) < 2:
            continue
        complete = sorted(n for n in group if _covers_storage(state_dict[n]))
        if not complete:
            raise RuntimeError(
                f"tensors {sorted(group)} share memory and none of them covers all of it: "
                "saving one would drop the others' bytes, saving all would duplicate memory "
                "(https://huggingface.co/docs/safetensors/torch_shared_tensors)")
        kept = next((n for n in complete if n in preferred), complete[0])
        out[kept] = sorted(n for n in group if n != kept)
    return out


def _covers_storage(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    return t.data_ptr() == storage.data_ptr() and t.numel() * t.element_size() == storage.nbytes()


def _checked(tensors: Any) -> Dict[str, Any]:
    """``tensors`` checked as ``safetensors.torch`` checks what it saves, detached from autograd
    (a parameter that requires grad is saved as its values)."""
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received "
                             f"{type(t)}")
        if t.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise ValueError(f"You are trying to save sparse tensors: {sparse}, which the format "
                         "cannot hold; make them dense first (`.to_dense()`)")
    failing = [group for group in _shared(tensors) if len(group) > 1]
    if failing:
        raise RuntimeError(
            f"Some tensors share memory, this would duplicate memory on disk and load them apart: "
            f"{failing}. Save the model with `save_model` (dlbridge.safetensors.torch), which "
            "keeps one of each; see https://huggingface.co/docs/safetensors/torch_shared_tensors")
    return {name: t.detach() for name, t in tensors.items()}
