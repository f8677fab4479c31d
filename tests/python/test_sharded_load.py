"""Tensor-parallel loads (`load_file(..., shard=)`, `load_into(..., shard=)`): every rank's parts
bit for bit as `safetensors` + `narrow` (as `torch.chunk` splits), in one process driving several
devices and in one process per rank (two real processes over a `torch.distributed` group: gloo
on the CPU here, NCCL and `dlbridge.nccl` on a machine of two GPUs); plans that do not divide
evenly, 0-d, empty, replicated and mixed-dtype tensors, a cast; each byte of the checkpoint read
once over all ranks; a rank that dies makes the others fail, not hang.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

import dlbridge
from dlbridge import _load
from dlbridge.shard import Split, chunk_ranges, resolve

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
dist = pytest.importorskip("torch.distributed")

cuda = dlbridge.cuda.is_available() and torch.cuda.is_available()
gpus = torch.cuda.device_count() if cuda else 0
needs_cuda = pytest.mark.skipif(not cuda, reason="needs a CUDA device (and PyTorch with CUDA)")
needs_two_gpus = pytest.mark.skipif(
    gpus < 2, reason=f"needs two CUDA devices (this machine: {gpus})")
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

# q/k/v/embedding split on dim 0, o/down on dim 1 (one run per row), a 3-d tensor on its last
# dim, a [1, n] tensor on dim 1 (one run: only a length-1 dim before it), the rest replicated.
PLAN = {
    "*.q.weight": 0,
    "*.o.weight": 1,
    "embed": 0,
    re.compile(r"conv\.w[0-9]"): 2,
    "row": 1,
    "explicit": Split(0, ((0, 1), (1, 4), (4, 4), (4, 7))),
    "wide.*.wq": 0,
    "wide.*.wo": 1,
}


def plan_for(world):
    """PLAN, its explicit ranges (four ranks') left out for other world sizes."""
    return PLAN if world == 4 else {k: v for k, v in PLAN.items() if k != "explicit"}


def _checkpoint(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "layers.0.q.weight": torch.randn(10, 6, generator=g).to(torch.bfloat16),
        "layers.0.o.weight": torch.randn(6, 9, generator=g),
        "layers.1.q.weight": torch.randn(5, 3, generator=g).to(torch.float16),
        "layers.1.o.weight": torch.randn(3, 5, generator=g).to(torch.float64),
        "layers.2.q.weight": torch.randn(6, 4, generator=g).to(torch.float8_e4m3fn),
        "embed": torch.arange(7 * 4, dtype=torch.int32).reshape(7, 4),
        "conv.w1": torch.randn(2, 3, 5, generator=g),
        "row": torch.randn(1, 11, generator=g),
        "explicit": torch.randn(7, 2, generator=g),
        "norm": torch.randn(6, generator=g),
        "scalar": torch.tensor(2.5),
        "count": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "empty.q.weight": torch.zeros(0, 3),
        "flags": torch.tensor([True, False, True]),
    }
    path = os.path.join(tmp_path, "model.safetensors")
    st.save_file(tensors, path)
    return path


def _many(tmp_path, layers=24):
    """Many small tensors: per layer a dim-0 split, a dim-1 split (strided parts, uneven over 3
    or 4 ranks) and a replicated one, in mixed dtypes."""
    g = torch.Generator().manual_seed(2)
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.q.weight"] = torch.randn(5, 3, generator=g).to(torch.bfloat16)
        tensors[f"layers.{i}.o.weight"] = torch.randn(3, 7 + i % 3, generator=g)
        tensors[f"layers.{i}.norm"] = torch.randn(3, generator=g).to(torch.float16)
    path = os.path.join(tmp_path, "many.safetensors")
    st.save_file(tensors, path)
    return path


def _wide(tmp_path, big=False, rows=False):
    """A Llama-like checkpoint (`wide.*`): per layer a dim-0 split and a dim-1 split whose rows'
    runs are 512 bytes or more for up to 4 ranks (uneven over 3), in mixed dtypes, and small
    replicated tensors (a norm, a 0-d, an empty one); with `big`, a replicated tensor of 64 KiB;
    with `rows`, the dim-0 splits only."""
    g = torch.Generator().manual_seed(4)
    tensors = {}
    for i in range(3):
        dtype = [torch.float32, torch.bfloat16, torch.float16][i]
        tensors[f"wide.{i}.wq"] = torch.randn(7, 300, generator=g).to(dtype)
        if rows:
            continue
        tensors[f"wide.{i}.wo"] = torch.randn(5, 1100 + i, generator=g).to(dtype)
        tensors[f"wide.{i}.norm"] = torch.randn(300, generator=g).to(dtype)
    if not rows:
        tensors["wide.scalar"] = torch.tensor(1.5, dtype=torch.float64)
        tensors["wide.empty"] = torch.zeros(0, 4)
        tensors["wide.0.ids"] = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    if big:
        tensors["wide.table"] = torch.randn(64, 256, generator=g)
    path = os.path.join(tmp_path, "wide.safetensors")
    st.save_file(tensors, path)
    return path


def _replicated_bytes(path, world):
    """The bytes of the tensors `path` holds whole on every rank under `PLAN`."""
    return sum(t.numel() * t.element_size() for name, t in st.load_file(path).items()
               if resolve(plan_for(world), name, tuple(t.shape), world) is None)


def _expected(path, rank, world, plan=None):
    """Rank `rank`'s parts, as `safetensors` + `narrow` give them (`torch.chunk`'s split)."""
    plan = plan_for(world) if plan is None else plan
    out = {}
    for name, t in st.load_file(path).items():
        split = resolve(plan, name, tuple(t.shape), world)
        if split is None:
            out[name] = t
        else:
            a, b = split.ranges[rank]
            out[name] = t.narrow(split.dim, a, b - a)
    return out


def _bits(t):
    t = torch.as_tensor(t).detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).tolist()


def _same(got, want, where=""):
    assert set(got) == set(want), where
    for k in want:
        g = torch.from_dlpack(got[k]) if not isinstance(got[k], torch.Tensor) else got[k]
        assert g.dtype == want[k].dtype and tuple(g.shape) == tuple(want[k].shape), (where, k)
        assert _bits(g) == _bits(want[k]), (where, k)


def test_chunk_ranges_are_torch_chunk():
    for n in [0, 1, 3, 5, 7, 8, 13]:
        for world in [1, 2, 3, 4, 8]:
            t = torch.arange(n)
            chunks = list(torch.chunk(t, world)) if n else []
            ranges = chunk_ranges(n, world)
            assert len(ranges) == world
            for r, (a, b) in enumerate(ranges):
                want = chunks[r].tolist() if r < len(chunks) else []
                assert t[a:b].tolist() == want, (n, world, r)


def test_the_shard_module_examples_run():
    import doctest

    import dlbridge.shard

    result = doctest.testmod(dlbridge.shard)
    assert result.attempted >= 3 and result.failed == 0


def test_plans_resolve_patterns_callables_and_refuse_bad_specs():
    assert resolve(PLAN, "layers.3.q.weight", (8, 2), 2) == Split(0, ((0, 4), (4, 8)))
    assert resolve(PLAN, "conv.w1", (2, 3, 5), 2) == Split(2, ((0, 3), (3, 5)))
    assert resolve(PLAN, "conv.w", (2, 3, 5), 2) is None  # the regex is matched whole
    assert resolve({"*": "replicate"}, "x", (4,), 2) is None
    assert resolve(lambda name: -1, "x", (4, 6), 3) == Split(1, ((0, 2), (2, 4), (4, 6)))
    with pytest.raises(ValueError, match="'x'.*no dimension 2"):
        resolve({"x": 2}, "x", (4, 6), 2)
    with pytest.raises(ValueError, match="'x'.*ranges"):
        resolve({"x": Split(0, ((0, 2),))}, "x", (4, 6), 2)
    with pytest.raises(ValueError, match="'x'.*ranges"):
        resolve({"x": Split(0, ((0, 2), (2, 5)))}, "x", (4, 6), 2)
    with pytest.raises(TypeError, match="'x'"):
        resolve({"x": "rows"}, "x", (4, 6), 2)
    with pytest.raises(TypeError, match="pattern"):
        resolve({3: 0}, "x", (4, 6), 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_one_process_on_the_cpu(tmp_path, world):
    path = _checkpoint(tmp_path)
    plan = plan_for(world)
    got = dlbridge.load_file(path, device=["cpu"] * world, shard=plan)
    assert isinstance(got, list) and len(got) == world
    for rank in range(world):
        _same(got[rank], _expected(path, rank, world, plan), f"rank {rank}")
    torch_out = dlbridge.load_file(path, device=["cpu"] * world, shard=plan, framework="pt")
    assert all(isinstance(v, torch.Tensor) for v in torch_out[0].values())


@pytest.mark.parametrize("batch", [1, 64, 1 << 30])
def test_owners_read_in_batches(tmp_path, monkeypatch, batch):
    """The tensors owners read are read by one run of the reader per group of at most `_BATCH`
    bytes (a larger tensor alone): any grouping gives the same parts."""
    monkeypatch.setattr(_load, "_BATCH", batch)
    path = _checkpoint(tmp_path)
    got = dlbridge.load_file(path, device=["cpu"] * 3, shard=plan_for(3))
    for rank in range(3):
        _same(got[rank], _expected(path, rank, 3), f"rank {rank}")


def _plan_of(path, world):
    """`path`'s tensors as `_Info`s, their splits under `plan_for(world)`, and the owners."""
    ckpt = dlbridge._dlbridge._Checkpoint(path)
    infos = []
    for name in ckpt.offset_keys():
        dtype, shape, (a, b), _ = ckpt.info(name)
        infos.append(_load._Info(name, ckpt.dtype(name), tuple(shape), b - a))
    splits = {i.name: resolve(plan_for(world), i.name, i.shape, world) for i in infos}
    return infos, splits, _load._owners(infos, splits, world)


def test_which_tensors_ranks_read_themselves(monkeypatch):
    """The rule: a split's parts are read by their ranks where each is one run, or its runs (one
    per row) are at least `_MIN_RUN` bytes; a replicated tensor by every rank up to
    `_REPLICATED_READ` bytes; anything else by one owner, which hands the parts out."""
    info = lambda shape, dtype="float32": _load._Info(  # noqa: E731
        "t", dlbridge.DType(dtype), shape, 4 * int(torch.tensor(shape).prod()))
    by_ranks = _load._read_by_ranks
    assert by_ranks(info((8, 128)), resolve({"t": 1}, "t", (8, 128), 1))  # whole rows: 512 B
    assert by_ranks(info((8, 256)), resolve({"t": 1}, "t", (8, 256), 2))  # 512 B runs
    assert not by_ranks(info((8, 255)), resolve({"t": 1}, "t", (8, 255), 2))  # 512, 508 B
    assert by_ranks(info((8, 2)), resolve({"t": 0}, "t", (8, 2), 2))  # one run per rank
    assert by_ranks(info((1, 8, 2)), resolve({"t": 1}, "t", (1, 8, 2), 2))  # one run too
    assert by_ranks(info((2, 4, 64)), resolve({"t": 1}, "t", (2, 4, 64), 2))  # 2 rows: 512 B
    assert not by_ranks(info((2, 4, 32)), resolve({"t": 1}, "t", (2, 4, 32), 2))  # 256 B
    # Ranks past the end (empty parts) are not counted; a split with no bytes at all is read.
    assert by_ranks(info((4, 130)), resolve({"t": Split(1, ((0, 130), (130, 130)))}, "t",
                                            (4, 130), 2))
    assert by_ranks(info((0, 5)), resolve({"t": 1}, "t", (0, 5), 2))
    assert by_ranks(info((4, 1024), "int4"), resolve({"t": 0}, "t", (4, 1024), 2))
    assert not by_ranks(info((4, 1024), "int4"), resolve({"t": 1}, "t", (4, 1024), 2))
    small, big = info((4 << 20,)), info(((4 << 20) + 1,))  # 16 MiB, 16 MiB + 4
    assert by_ranks(small, None) and not by_ranks(big, None)
    monkeypatch.setattr(_load, "_REPLICATED_READ", 0)
    assert not by_ranks(small, None)
    monkeypatch.setattr(_load, "_MIN_RUN", 1 << 40)
    assert not by_ranks(info((8, 256)), resolve({"t": 1}, "t", (8, 256), 2))
    assert by_ranks(info((8, 2)), resolve({"t": 0}, "t", (8, 2), 2))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_reads_its_parts_and_the_small_replicated_tensors(tmp_path, world,
                                                                    monkeypatch):
    """A Llama-like plan (dim-0 and dim-1 splits with rows of 512 bytes or more, small replicated
    tensors): no owners, and the bytes the ranks read add up to the checkpoint's tensors plus
    one more copy of the replicated ones per extra rank (each rank's are its parts, about 1/P).
    With replicated tensors read by owners (`_REPLICATED_READ = 0`), each byte is read once."""
    path = _wide(tmp_path)
    total = sum(t.numel() * t.element_size() for t in st.load_file(path).values())
    assert _plan_of(path, world)[2] == {}
    got, _, read = _load.load_sharded(path, ["cpu"] * world, plan_for(world), None, None, None,
                                      None, None, None, None)
    assert read == total + (world - 1) * _replicated_bytes(path, world)
    for rank in range(world):
        _same(got[rank], _expected(path, rank, world), f"rank {rank}")
    monkeypatch.setattr(_load, "_REPLICATED_READ", 0)
    infos, _, owners = _plan_of(path, world)
    assert set(owners) == {i.name for i in infos if i.nbytes
                           and resolve(plan_for(world), i.name, i.shape, world) is None}
    got, _, read = _load.load_sharded(path, ["cpu"] * world, plan_for(world), None, None, None,
                                      None, None, None, None)
    assert read == total
    for rank in range(world):
        _same(got[rank], _expected(path, rank, world), f"rank {rank}")


def test_owners_share_what_ranks_do_not_read_by_bytes(tmp_path):
    """Tensors whose parts are many tiny runs are read by one owner: owners balanced by bytes,
    and each byte read once apart from the small replicated tensors every rank reads."""
    path = _checkpoint(tmp_path)
    total = sum(t.numel() * t.element_size() for t in st.load_file(path).values())
    _, _, read = _load.load_sharded(path, ["cpu"] * 4, PLAN, None, None, None, None, None,
                                    None, None)
    assert read == total + 3 * _replicated_bytes(path, 4)
    infos, _, owners = _plan_of(path, 4)
    assert "layers.0.q.weight" not in owners and "row" not in owners  # read by their ranks
    assert "norm" not in owners  # small and replicated: read by every rank
    assert {"layers.0.o.weight", "conv.w1"} <= set(owners)  # runs of 12 to 36 bytes
    load = [sum(i.nbytes for i in infos if owners.get(i.name) == r) for r in range(4)]
    assert max(load) - min(load) <= max(i.nbytes for i in infos)


def test_a_packed_block_holds_parts_as_the_receiver_lays_them_out():
    """`_pack` copies parts (strided, mixed dtypes, empty, 0-d) into one block at the offsets
    `_layout` computes from shapes and dtypes alone, which the receiver computes too; the block's
    typed views (`_nccl_views`) read back bit-exact."""
    g = torch.Generator().manual_seed(3)
    base = dlbridge.asarray(torch.randn(6, 10, generator=g))
    parts = [base[:, 3:7], dlbridge.asarray(torch.arange(5, dtype=torch.int16)),
             dlbridge.asarray(torch.zeros(0, 4)), dlbridge.asarray(torch.tensor(2.5)),
             dlbridge.asarray(torch.randn(3, 5, generator=g).to(torch.bfloat16))[:, ::2]]
    block, packed = _load._pack(parts, dlbridge.Device("cpu"))
    total, views = _load._layout([(p.shape, p.dtype) for p in parts])
    assert block.shape == (total,) and str(block.dtype) == "uint8"
    assert all(v[4] % 256 == 0 for v in views) and views[2][0] == -1  # the empty part: no run
    assert total >= sum(p.nbytes for p in parts)
    again = dlbridge._dlbridge._nccl_views(block, views)  # as the receiver's `recv` builds them
    for part, a, b in zip(parts, packed, again):
        assert a.shape == b.shape == part.shape and a.dtype == b.dtype == part.dtype
        assert a.is_contiguous and _bits(torch.from_dlpack(b)) == _bits(torch.from_dlpack(part.copy()))


def test_views_of_a_packed_block_are_checked():
    block = dlbridge.empty((512,), "uint8")
    with pytest.raises((ValueError, IndexError), match="outside|out of bounds"):
        dlbridge._dlbridge._nccl_views(block, [(0, "float32", [100], [1], 256, False)])
    with pytest.raises((ValueError, IndexError), match="outside|out of bounds"):
        dlbridge._dlbridge._nccl_views(block[:256], [(0, "float32", [65], [1], 0, False)])
    with pytest.raises(ValueError, match="uint8"):
        dlbridge._dlbridge._nccl_views(dlbridge.empty((64,), "float32"), [])
    with pytest.raises(ValueError, match="run 1"):
        dlbridge._dlbridge._nccl_views(block, [(1, "float32", [1], [1], 0, False)])
    ro = dlbridge._dlbridge._nccl_views(block, [(0, "int32", [2], [1], 0, True)])[0]
    assert ro.readonly


def test_load_into_one_process_several_targets(tmp_path):
    """`load_into` with a list of devices fills each rank's targets: the plan given, or built from
    the targets' shapes; a cast where a target's dtype differs."""
    path = _checkpoint(tmp_path)
    world = 2
    for shard in [plan_for(world), "targets"]:
        want = [_expected(path, r, world) for r in range(world)]
        targets = [{k: torch.full_like(v, 0) for k, v in w.items()} for w in want]
        targets[1]["norm"] = torch.zeros(6, dtype=torch.float64)  # converted
        ptrs = [{k: v.data_ptr() for k, v in t.items()} for t in targets]
        result = dlbridge.load_into(targets, path, device=["cpu"] * world, shard=shard)
        assert result == ([], [])
        for r in range(world):
            for k, v in want[r].items():
                assert targets[r][k].data_ptr() == ptrs[r][k], (r, k)
                if r == 1 and k == "norm":
                    assert torch.equal(targets[r][k], v.double())
                else:
                    assert _bits(targets[r][k]) == _bits(v), (shard, r, k)


def test_a_target_of_the_wrong_part_shape(tmp_path):
    path = _checkpoint(tmp_path)
    targets = [{"layers.0.q.weight": torch.zeros(5, 6, dtype=torch.bfloat16)},
               {"layers.0.q.weight": torch.zeros(4, 6, dtype=torch.bfloat16)}]
    with pytest.raises(ValueError, match=r"'layers.0.q.weight'.*\(4, 6\).*rank 1.*\(5, 6\)"):
        dlbridge.load_into(targets, path, device=["cpu", "cpu"], shard={"*.q.weight": 0},
                           strict=False)
    assert torch.count_nonzero(targets[0]["layers.0.q.weight"]) == 0


def test_argument_errors(tmp_path):
    path = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match="go together"):
        dlbridge.load_file(path, shard=PLAN, rank=0)
    with pytest.raises(ValueError, match="one device"):
        dlbridge.load_file(path, device=["cpu", "cpu"], shard=PLAN, rank=0, world_size=2)
    with pytest.raises(ValueError, match="not in a world"):
        dlbridge.load_file(path, shard=PLAN, rank=2, world_size=2)
    with pytest.raises(ValueError, match="torch.distributed is not initialised|group="):
        dlbridge.load_file(path, shard=PLAN, rank=0, world_size=2)
    with pytest.raises(TypeError, match="group must be"):
        dlbridge.load_file(path, shard=PLAN, rank=0, world_size=2, group=object())
    with pytest.raises(KeyError, match="nope"):
        dlbridge.load_file(path, device=["cpu"], shard=PLAN, keys=["nope"])


# ---------------------------------------------------------------------------------------------
# One process per rank

RANK = textwrap.dedent(r"""
    import datetime, os, sys, time, traceback
    import torch, torch.distributed as dist
    import dlbridge
    sys.path.insert(0, {tests!r})
    from test_sharded_load import plan_for, _expected, _same

    rank, world, mode, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    backend, device = {{"gloo": ("gloo", "cpu"), "nccl": ("nccl", f"cuda:{{rank}}"),
                       "dlnccl": (None, f"cuda:{{rank}}")}}[mode.split("-")[0]]
    group = None
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    if backend:
        limit = float(os.environ["DLBRIDGE_NCCL_TIMEOUT"])
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=limit))
    else:
        import dlbridge.nccl as nccl
        uid_path = path + ".uid"
        if rank == 0:
            uid = nccl.unique_id()
            with open(uid_path + ".tmp", "wb") as f:
                f.write(uid)
            os.replace(uid_path + ".tmp", uid_path)
        else:
            while not os.path.exists(uid_path):
                time.sleep(0.05)
            uid = open(uid_path, "rb").read()
        group = nccl.Communicator(uid, world, rank, device=rank,
                                  timeout=float(os.environ["DLBRIDGE_NCCL_TIMEOUT"]))
    from dlbridge import _load
    if os.environ.get("TEST_BATCH"):
        _load._BATCH = int(os.environ["TEST_BATCH"])
    if os.environ.get("TEST_REPLICATED"):
        _load._REPLICATED_READ = int(os.environ["TEST_REPLICATED"])
    calls = []
    if os.environ.get("TEST_COUNT"):
        # Each step's hand-out is one batched exchange, never a blocking send per tensor.
        batched = dist.batch_isend_irecv
        def counted(ops):
            calls.append(len(ops))
            return batched(ops)
        def refused(*args, **kwargs):
            raise AssertionError("a blocking send or recv per tensor")
        dist.batch_isend_irecv = counted
        dist.send = dist.recv = refused
    if "-stream" in mode and mode.endswith("-fails") and rank == 1:
        # The stream's loading thread fails at its first step.
        def failing(self, *args, **kwargs):
            raise ValueError("this rank fails")
        _load._Engine.start = failing
    dies = mode.endswith("-dies")
    if dies and rank == 1:
        os._exit(3)  # before the load: its peers wait for transfers it never makes
    def progress(done, total):
        if mode.endswith("-dies-midway") and rank == 1 and done > 0:
            os._exit(3)
        if mode.endswith("-fails") and rank == 1 and done > 0:
            raise ValueError("this rank fails")
    read = None
    began = time.monotonic()
    try:
        if "-stream" in mode:
            # Streamed by layer: each group this rank's parts of its tensors, delivered in order.
            want = _expected(path, rank, world)
            targets = None
            if mode.endswith("-into"):
                targets = {{k: torch.zeros_like(v, device=device) for k, v in want.items()}}
            stream = dlbridge.stream_file(path, device, shard=plan_for(world), rank=rank,
                                          world_size=world, group=group, targets=targets,
                                          framework="pt", ahead=1)
            got, seen = {{}}, []
            for name, tensors, ready in stream:
                if ready is not None:
                    ready.synchronize()
                seen.append((name, list(tensors)))
                got.update(tensors)
                if targets is not None:
                    assert all(tensors[k] is targets[k] for k in tensors)
            assert seen == [(g, names) for g, names in stream.groups], (seen, stream.groups)
        elif mode.endswith("-into"):
            want = _expected(path, rank, world)
            targets = {{k: torch.zeros_like(v, device=device) for k, v in want.items()}}
            dlbridge.load_into(targets, path, shard=plan_for(world), rank=rank,
                               world_size=world, group=group, progress=progress)
            got = targets
        elif os.environ.get("TEST_COUNT"):
            # The bytes this rank read from the file, too.
            got, _, read = _load.load_sharded(path, device, plan_for(world), rank, world, group,
                                              None, None, None, progress)
            got = got[0]
        else:
            got = dlbridge.load_file(path, device=device, shard=plan_for(world), rank=rank,
                                     world_size=world, group=group, progress=progress)
        _same(got, _expected(path, rank, world), f"rank {{rank}}")
        print(f"rank {{rank}} ok, {{len(calls)}} exchanges, {{read}} read", flush=True)
    except Exception as e:
        kind = "transfer" if isinstance(e, RuntimeError) else "other"
        print(f"rank {{rank}} error ({{kind}}) {{type(e).__name__}} after "
              f"{{time.monotonic() - began:.1f}} s: {{e}}", flush=True)
        if "-stream" in mode and mode.endswith("-fails") and rank == 1:
            time.sleep(16)  # alive: its peers learn nothing from a closed connection
        os._exit(5)
    if backend:
        dist.destroy_process_group()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(tmp_path, mode, world=4, timeout=120, path=None, limit=20, **extra):
    """`world` ranks of the RANK script, each `(returncode, output)`; `limit`: the transfer and
    process group timeout, seconds."""
    path = _checkpoint(tmp_path) if path is None else path
    script = RANK.format(tests=os.path.dirname(__file__))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               DLBRIDGE_NCCL_TIMEOUT=str(limit), **extra)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), mode, path],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@needs_gloo
@pytest.mark.parametrize("how", ["file", "into"])
def test_one_process_per_rank_over_gloo(tmp_path, how):
    mode = "gloo" if how == "file" else "gloo-into"
    for rank, (rc, out) in enumerate(_ranks(tmp_path, mode)):
        assert rc == 0 and f"rank {rank} ok" in out, out


def _steps(path, world, batch):
    """The steps of a load of `path` over `world` ranks with `_BATCH = batch`."""
    ckpt = dlbridge._dlbridge._Checkpoint(path)
    saved = _load._BATCH
    _load._BATCH = batch
    try:
        return len(_load._Engine(ckpt, [dlbridge.Device("cpu")], [0], world, plan_for(world),
                                 None, None, None, None).batches())
    finally:
        _load._BATCH = saved


@needs_gloo
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batch", [1 << 30, 200])
@pytest.mark.parametrize("how", ["file", "into"])
def test_each_step_is_one_batched_exchange_over_gloo(tmp_path, world, batch, how):
    """Many small tensors (dim-1 splits whose parts are strided and uneven, replicated ones, a
    step with parts for several peers), in one step or in many: every rank's parts bit-exact,
    each step handed out by at most one `batch_isend_irecv` per rank and no blocking send or
    receive per tensor (the hand-out sent each tensor by its own `dist.send` before)."""
    path = _many(tmp_path)
    steps = _steps(path, world, batch)
    assert (steps == 1) == (batch == 1 << 30)
    mode = "gloo" if how == "file" else "gloo-into"
    outs = _ranks(tmp_path, mode, world=world, path=path, TEST_BATCH=str(batch), TEST_COUNT="1")
    for rank, (rc, out) in enumerate(outs):
        found = re.search(rf"rank {rank} ok, (\d+) exchanges", out)
        assert rc == 0 and found, out
        assert 1 <= int(found.group(1)) <= steps, out


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("how", ["stream", "stream-into"])
def test_streaming_one_process_per_rank_over_gloo(tmp_path, world, how):
    """`stream_file(shard=, rank=, world_size=, group=)`, into new arrays or into targets: each
    group this rank's parts, in the planned order, bit-exact."""
    for rank, (rc, out) in enumerate(_ranks(tmp_path, f"gloo-{how}", world=world)):
        assert rc == 0 and f"rank {rank} ok" in out, out


@needs_gloo
@pytest.mark.parametrize("when", ["dies", "dies-midway"])
def test_a_rank_that_dies_ends_the_others_with_an_error_over_gloo(tmp_path, when):
    outs = _ranks(tmp_path, f"gloo-{when}", world=2, timeout=90)
    assert outs[1][0] == 3, outs[1][1]
    rc, out = outs[0]
    assert rc == 5 and "rank 0 error (transfer)" in out, out


def _own_bytes(path, rank, world):
    """The bytes of rank `rank`'s parts and of every replicated tensor."""
    return sum(t.numel() * t.element_size() for t in _expected(path, rank, world).values())


@needs_gloo
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("how", ["file", "into"])
def test_ranks_read_their_own_parts_with_no_exchange_over_gloo(tmp_path, world, how):
    """A Llama-like plan (dim-1 parts of rows of 512 bytes or more, uneven over 3; small
    replicated tensors; mixed dtypes, 0-d, empty): every rank reads its own parts and the
    replicated tensors and exchanges nothing (the dim-1 and replicated tensors were read by an
    owner and handed out before); bit-exact, and each rank reads its parts' bytes only."""
    path = _wide(tmp_path)
    mode = "gloo" if how == "file" else "gloo-into"
    outs = _ranks(tmp_path, mode, world=world, path=path, TEST_COUNT="1")
    for rank, (rc, out) in enumerate(outs):
        found = re.search(rf"rank {rank} ok, (\d+) exchanges, (\w+) read", out)
        assert rc == 0 and found, out
        assert found.group(1) == "0", out
        if how == "file":
            assert int(found.group(2)) == _own_bytes(path, rank, world), out


@needs_gloo
@pytest.mark.parametrize("world", [2, 4])
def test_a_big_replicated_tensor_is_read_once_and_handed_out_over_gloo(tmp_path, world):
    """A replicated tensor over `_REPLICATED_READ` bytes (64 KiB over a limit of 32 KiB) is read
    by one owner and handed out by one batched exchange; the others read only their parts and the
    small replicated tensors."""
    path = _wide(tmp_path, big=True)
    table = 64 * 256 * 4
    infos, splits, owners = _plan_of(path, world)
    outs = _ranks(tmp_path, "gloo", world=world, path=path, TEST_COUNT="1",
                  TEST_REPLICATED=str(32 << 10))
    owner = None
    for rank, (rc, out) in enumerate(outs):
        found = re.search(rf"rank {rank} ok, (\d+) exchanges, (\w+) read", out)
        assert rc == 0 and found, out
        assert found.group(1) == "1", out
        read = int(found.group(2))
        if read == _own_bytes(path, rank, world):
            assert owner is None, outs
            owner = rank
        else:
            assert read == _own_bytes(path, rank, world) - table, out
    assert owner is not None, outs


@needs_gloo
@pytest.mark.parametrize("when", ["dies", "dies-midway", "fails"])
@pytest.mark.parametrize("rows", [False, True])
def test_a_rank_that_fails_ends_the_others_with_an_error_with_no_exchange_over_gloo(
        tmp_path, when, rows):
    """With no exchange in the plan, the other ranks would finish their own parts: the final
    agreement makes their loads fail too (a rank that dies: at the timeout, 20 s here, or when
    gloo sees its connection close; a rank that raises: at once). `rows`: dim-0 splits only,
    which had no exchange before either (the others then finished without an error)."""
    path = _wide(tmp_path, rows=rows)
    outs = _ranks(tmp_path, f"gloo-{when}", world=3, timeout=90, path=path)
    if when == "fails":
        assert outs[1][0] == 5 and "rank 1 error (other) ValueError" in outs[1][1], outs[1][1]
    else:
        assert outs[1][0] == 3, outs[1][1]
    for rank in (0, 2):
        rc, out = outs[rank]
        assert rc == 5 and f"rank {rank} error (transfer)" in out, out
        if when == "fails":
            assert "another rank's tensor-parallel load failed" in out, out
            seconds = float(re.search(r"after ([0-9.]+) s", out).group(1))
            assert seconds < 15, out  # not the 20 s timeout


@needs_gloo
def test_a_stream_whose_rank_fails_ends_the_others_at_once_over_gloo(tmp_path):
    """`stream_file` over a group: a rank whose loading thread raises tells the others at the
    agreement, and their iterations raise at once (they agreed once: no second agreement, which
    the failed rank, still alive, never joins: they would wait 10 s or more)."""
    path = _wide(tmp_path)
    outs = _ranks(tmp_path, "gloo-stream-fails", world=3, timeout=90, path=path)
    assert outs[1][0] == 5 and "rank 1 error (other) ValueError" in outs[1][1], outs[1][1]
    for rank in (0, 2):
        rc, out = outs[rank]
        assert rc == 5 and "another rank's tensor-parallel load failed" in out, out
        seconds = float(re.search(r"after ([0-9.]+) s", out).group(1))
        assert seconds < 5, out  # not a second agreement's wait (10 s at least)


@needs_cuda
@pytest.mark.parametrize("wide", [False, True])
def test_one_process_on_gpus(tmp_path, wide):
    """Rank i on GPU i (every rank on GPU 0 where there is one): parts copied between devices
    (owned tensors), or (`wide`) every device's parts read straight to it."""
    path = _wide(tmp_path) if wide else _checkpoint(tmp_path)
    world = 4
    if wide:
        assert _plan_of(path, world)[2] == {}
    devices = [f"cuda:{r % gpus}" for r in range(world)]
    got = dlbridge.load_file(path, device=devices, shard=PLAN)
    for rank in range(world):
        assert all(str(a.device) == devices[rank] for a in got[rank].values())
        _same(got[rank], _expected(path, rank, world), f"rank {rank}")
    targets = [{k: torch.zeros_like(v, device=devices[r]) for k, v in
                _expected(path, r, world).items()} for r in range(world)]
    dlbridge.load_into(targets, path, device=devices, shard=PLAN)
    for rank in range(world):
        _same(targets[rank], _expected(path, rank, world), f"into rank {rank}")


@needs_two_gpus
@pytest.mark.parametrize("mode", ["nccl", "nccl-into", "dlnccl", "dlnccl-into", "nccl-stream",
                                  "nccl-stream-into", "dlnccl-stream", "dlnccl-stream-into"])
def test_one_process_per_rank_on_gpus(tmp_path, mode):
    for rank, (rc, out) in enumerate(_ranks(tmp_path, mode, world=2)):
        assert rc == 0 and f"rank {rank} ok" in out, out


@needs_two_gpus
@pytest.mark.parametrize("world", sorted({2, max(2, min(gpus, 4))}))
@pytest.mark.parametrize("mode", ["nccl", "nccl-into", "dlnccl", "dlnccl-into"])
def test_ranks_read_their_own_parts_on_gpus(tmp_path, mode, world):
    """The Llama-like plan on GPUs: no exchange, bit-exact, each rank reads its own bytes."""
    path = _wide(tmp_path)
    for rank, (rc, out) in enumerate(_ranks(tmp_path, mode, world=world, path=path,
                                            TEST_COUNT="1")):
        found = re.search(rf"rank {rank} ok, (\d+) exchanges, (\w+) read", out)
        assert rc == 0 and found and found.group(1) == "0", out
        if not mode.endswith("-into"):
            assert int(found.group(2)) == _own_bytes(path, rank, world), out


@needs_two_gpus
@pytest.mark.parametrize("mode", ["nccl-dies", "dlnccl-dies", "dlnccl-dies-midway",
                                  "nccl-dies-wide", "dlnccl-dies-wide", "nccl-fails-wide"])
def test_a_rank_that_dies_on_gpus(tmp_path, mode):
    """A rank that dies (or raises): the other ends with an error within the timeout (10 s) plus
    start-up: in a transfer, or (`-wide`: nothing exchanged) in the final agreement, over a
    torch NCCL group created lazily (its communicator's creation waits for the dead rank: the
    load bounds it) or a dlbridge.nccl communicator."""
    wide = mode.endswith("-wide")
    mode = mode[:-len("-wide")] if wide else mode
    outs = _ranks(tmp_path, mode, world=2, timeout=60, path=_wide(tmp_path) if wide else None,
                  limit=10)
    assert outs[1][0] == (5 if mode.endswith("-fails") else 3), outs[1][1]
    rc, out = outs[0]
    assert rc == 5 and "rank 0 error (transfer)" in out, out
