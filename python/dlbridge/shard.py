"""Shard plans: which dimension of each tensor of a checkpoint is split across the ranks of a
tensor-parallel group, and how, or that it is replicated.

A plan is given to ``dlbridge.load_file(..., shard=plan)`` and ``dlbridge.load_into(...,
shard=plan)`` as one of:

- a mapping of name patterns to specs, tried in the mapping's order, the first that matches
  wins; a ``str`` pattern is matched whole with :func:`fnmatch.fnmatchcase` (``*`` crosses dots:
  ``"*.q_proj.weight"``), a compiled :class:`re.Pattern` with ``fullmatch``; a name no pattern
  matches is replicated;
- a callable ``name -> spec``;
- ``"targets"`` (``load_into`` only): built from the targets, a target smaller than the tensor
  along one dimension has that dimension split (:func:`from_targets`). With one process per
  rank, each rank builds it from its own targets, so every rank must come to the same plan: a
  rank whose chunk is the whole dimension (a dimension shorter than the ranks) cannot tell it is
  split; give such a plan explicitly.

A spec is ``None`` or ``"replicate"`` (every rank gets the whole tensor), an ``int`` ``d`` (split
dimension ``d`` evenly, as :func:`torch.chunk` splits it), or :class:`Split` (``Split(d)``, or
``Split(d, ranges=[(start, stop), ...])`` with one range per rank).

An even split divides a dimension of ``n`` as ``torch.chunk(n, world_size)`` does: every rank
gets ``ceil(n / world_size)`` elements, the last ones fewer, and ranks past the end none (``n = 5``
over 4 ranks: 2, 2, 1, 0), so rank ``r``'s part is ``tensor.narrow(d, start, stop - start)`` with
``(start, stop)`` from :func:`chunk_ranges`.

>>> from dlbridge.shard import chunk_ranges, Split, resolve
>>> chunk_ranges(5, 4)
[(0, 2), (2, 4), (4, 5), (5, 5)]
>>> resolve({"*.q_proj.weight": 0, "*.o_proj.weight": 1}, "layers.0.o_proj.weight", (8, 8), 2)
Split(dim=1, ranges=((0, 4), (4, 8)))
>>> resolve({"*.q_proj.weight": 0}, "norm.weight", (8,), 2) is None
True
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Callable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = ["Split", "chunk_ranges", "from_targets", "resolve"]


class Split(NamedTuple):
    """Dimension ``dim`` split across the ranks: evenly (``ranges=None``, as :func:`torch.chunk`
    does) or rank ``r`` taking ``ranges[r] = (start, stop)``."""

    dim: int
    ranges: Optional[Tuple[Tuple[int, int], ...]] = None


Spec = Union[None, str, int, Split]
Plan = Union[Mapping[Any, Spec], Callable[[str], Spec], str]


def chunk_ranges(n: int, world_size: int) -> List[Tuple[int, int]]:
    """The ``(start, stop)`` each of ``world_size`` ranks takes of a dimension of ``n``, as
    :func:`torch.chunk` splits it (ranks past its last chunk get an empty range at ``n``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    step = -(-n // world_size) if n else 0
    return [(min(r * step, n), min((r + 1) * step, n)) for r in range(world_size)]


def _spec(plan: Plan, name: str) -> Spec:
    if callable(plan):
        return plan(name)
    if isinstance(plan, Mapping):
        for pattern, spec in plan.items():
            if isinstance(pattern, re.Pattern):
                if pattern.fullmatch(name):
                    return spec
            elif isinstance(pattern, str):
                if fnmatch.fnmatchcase(name, pattern):
                    return spec
            else:
                raise TypeError(
                    f"shard plan pattern {pattern!r}: expected a str (fnmatch) or a compiled "
                    f"re.Pattern"
                )
        return None
    raise TypeError(
        f"shard plan must be a mapping of name patterns, a callable or 'targets', not "
        f"{type(plan).__name__}"
    )


def resolve(plan: Plan, name: str, shape: Sequence[int], world_size: int) -> Optional[Split]:
    """Tensor ``name`` (of ``shape``) under ``plan`` for ``world_size`` ranks: ``None`` where it
    is replicated, else a :class:`Split` with its ranges; a ``ValueError`` naming the tensor for
    a dimension it does not have, or ranges that are not one per rank inside the dimension."""
    spec = _spec(plan, name)
    if spec is None or (isinstance(spec, str) and spec == "replicate"):
        return None
    if isinstance(spec, bool) or not isinstance(spec, (int, Split)):
        raise TypeError(
            f"shard spec of tensor {name!r} is {spec!r}: expected None, 'replicate', a dimension "
            f"(int) or dlbridge.shard.Split"
        )
    split = spec if isinstance(spec, Split) else Split(spec)
    ndim = len(shape)
    dim = split.dim + ndim if -ndim <= split.dim < 0 else split.dim
    if not 0 <= dim < ndim:
        raise ValueError(
            f"tensor {name!r} of shape {tuple(shape)} has no dimension {split.dim} to split"
        )
    n = shape[dim]
    if split.ranges is None:
        return Split(dim, tuple(chunk_ranges(n, world_size)))
    ranges = tuple((int(a), int(b)) for a, b in split.ranges)
    if len(ranges) != world_size or any(not 0 <= a <= b <= n for a, b in ranges):
        raise ValueError(
            f"tensor {name!r}: split ranges {list(ranges)} are not {world_size} ranges (start, "
            f"stop) inside its dimension {dim} of {n}"
        )
    return Split(dim, ranges)


def from_targets(
    shapes: Mapping[str, Sequence[int]],
    checkpoint_shapes: Mapping[str, Sequence[int]],
    rank: int,
    world_size: int,
) -> Callable[[str], Spec]:
    """The plan a rank's targets imply: a target whose shape is the checkpoint tensor's but
    smaller along one dimension has that dimension split, evenly as :func:`chunk_ranges` splits
    it (the target must be rank ``rank``'s chunk); others are replicated (a shape that differs
    otherwise is reported by the load as a shape mismatch)."""

    def spec(name: str) -> Spec:
        want, full = shapes.get(name), checkpoint_shapes.get(name)
        if want is None or full is None or tuple(want) == tuple(full) or len(want) != len(full):
            return None
        differ = [d for d, (a, b) in enumerate(zip(want, full)) if a != b]
        if len(differ) != 1 or want[differ[0]] > full[differ[0]]:
            return None
        dim = differ[0]
        a, b = chunk_ranges(full[dim], world_size)[rank]
        if b - a != want[dim]:
            raise ValueError(
                f"tensor {name!r}: the target has shape {tuple(want)}, which is not rank {rank}'s "
                f"chunk of {tuple(full)} along dimension {dim} over {world_size} ranks "
                f"({b - a} of {full[dim]}); give the plan explicitly"
            )
        return Split(dim)

    return spec
