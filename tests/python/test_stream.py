"""Streaming loads (dlbridge.stream_file): groups in the caller's order, bit-exact tensors, ready
events a consumer's stream waits on, errors mid-stream, and an abandoned stream freeing what it
loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import dlbridge

torch = pytest.importorskip("torch")
from safetensors.torch import load_file as st_load_torch  # noqa: E402
from safetensors.torch import save_file as st_save_torch  # noqa: E402

_needs_torch_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and dlbridge.cuda.is_available()), reason="needs a CUDA GPU and PyTorch with CUDA"
)


def _model(layers=6, width=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(100, width, generator=gen)}
    for i in range(layers):
        tensors[f"model.layers.{i}.attn.weight"] = torch.randn(width, width, generator=gen).to(torch.bfloat16)
        tensors[f"model.layers.{i}.mlp.weight"] = torch.randn(width, 2 * width, generator=gen)
        tensors[f"model.layers.{i}.norm"] = torch.randn(width, generator=gen).to(torch.float16)
    tensors["model.norm.weight"] = torch.randn(width, generator=gen)
    tensors["lm_head.weight"] = torch.randn(100, width, generator=gen)
    return tensors


def _execution_order(layers=6):
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        names += [f"model.layers.{i}.norm", f"model.layers.{i}.attn.weight", f"model.layers.{i}.mlp.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


@pytest.fixture()
def checkpoint(tmp_path):
    tensors = _model()
    path = tmp_path / "model.safetensors"
    st_save_torch(tensors, str(path))
    return path, tensors


def test_groups_come_by_layer_in_the_given_order_bit_exact(checkpoint):
    path, tensors = checkpoint
    order = _execution_order()
    got = list(dlbridge.stream_file(path, order=order, framework="pt"))
    assert [g for g, _, _ in got] == (
        ["model.embed_tokens.weight"] + [f"model.layers.{i}" for i in range(6)] + ["model.norm.weight", "lm_head.weight"]
    )
    assert [n for _, ts, _ in got for n in ts] == order
    reference = st_load_torch(str(path))
    for _, ts, ready in got:
        assert ready is None  # the CPU: ready when handed out
        for name, t in ts.items():
            assert t.dtype == reference[name].dtype and torch.equal(t, reference[name]), name


def test_the_files_order_and_other_groupings(checkpoint):
    path, tensors = checkpoint
    file_order = dlbridge.safe_open(path).offset_keys()
    got = [n for _, ts, _ in dlbridge.stream_file(path, groups=lambda n: n) for n in ts]
    assert got == file_order
    by_kind = dlbridge.stream_file(path, groups=r"\.(attn|mlp|norm)\b", order=_execution_order())
    groups = {g: list(ts) for g, ts, _ in by_kind}
    assert groups["attn"] == [f"model.layers.{i}.attn.weight" for i in range(6)]
    assert groups["norm"][0] == "model.layers.0.norm"
    assert "lm_head.weight" in groups  # not matched: a group of its own


def test_a_sharded_checkpoint_streams_across_shards(tmp_path):
    tensors = _model(layers=8)
    dlbridge.save_file(tensors, tmp_path / "ckpt", max_shard_size="40kB")
    assert len([n for n in os.listdir(tmp_path / "ckpt") if n.startswith("model-")]) > 2
    order = _execution_order(8)
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "model.safetensors.index.json"):
        got = {}
        for _, ts, _ in dlbridge.stream_file(path, order=order, framework="pt", copy=True):
            got.update(ts)
        assert list(got) == order
        for name in order:
            assert torch.equal(got[name], tensors[name]), name


def test_bad_arguments_are_clear_errors(checkpoint):
    path, _ = checkpoint
    with pytest.raises(KeyError, match="nope"):
        dlbridge.stream_file(path, order=["nope"])
    with pytest.raises(ValueError, match="twice"):
        dlbridge.stream_file(path, order=["lm_head.weight", "lm_head.weight"])
    with pytest.raises(ValueError, match="ahead"):
        dlbridge.stream_file(path, ahead=0)
    with pytest.raises(TypeError, match="groups"):
        dlbridge.stream_file(path, groups=3)
    with pytest.raises(TypeError, match="not a str"):
        list(dlbridge.stream_file(path, groups=lambda n: 1))


_TRUNCATED = """
import os, sys, dlbridge
path = sys.argv[1]
stream = dlbridge.stream_file(path, "cuda:0", order=sys.argv[2:], groups=lambda n: n, ahead=1)
first = next(stream)
print("first", first[0], flush=True)
os.truncate(path, 200)  # the rest of the file is gone under the stream
try:
    for group, tensors, ready in stream:
        print("group", group, flush=True)
except OSError as e:
    print("OSError", e.errno, flush=True)
print("end", flush=True)
"""


@_needs_torch_cuda
def test_a_file_truncated_mid_stream_raises_from_the_iterator(tmp_path):
    """In a child, so that nothing the truncation does can take the test down: the group being
    read when the file shrank raises OSError from the iteration (the device reader's reads come
    short); groups already taken were fine. (On the CPU the tensors are views of the mapped file,
    which a truncation turns into SIGBUS on reading, as load_file's views; the engine's test
    `a_truncated_file_ends_the_stream_with_an_error` covers a plan past the end there.)"""
    tensors = {f"t{i}": torch.full((256 * 1024,), float(i)) for i in range(8)}  # 1 MB each
    path = tmp_path / "t.safetensors"
    st_save_torch(tensors, str(path))
    order = [f"t{i}" for i in range(8)]
    out = subprocess.run([sys.executable, "-c", _TRUNCATED, str(path), *order], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "first t0"
    assert any(line.startswith("OSError") for line in lines), out.stdout
    assert lines[-1] == "end"


def test_abandoning_a_stream_frees_what_it_loaded(checkpoint):
    path, _ = checkpoint
    dlbridge.empty_cache("cpu")
    before = dlbridge.memory_stats("cpu")["active_bytes"]
    stream = dlbridge.stream_file(path, order=_execution_order(), copy=True, ahead=3)
    name, tensors, _ = next(stream)
    del tensors
    stream.close()
    assert dlbridge.memory_stats("cpu")["active_bytes"] == before
    with dlbridge.stream_file(path, copy=True) as s:
        next(s)
    assert dlbridge.memory_stats("cpu")["active_bytes"] == before
    assert list(s) == []  # closed: nothing more


def _layered(tmp_path, layers, cols):
    """A file of `layers` layers, each a float32 `w` (1024 x cols) and a bfloat16 `b` (cols),
    written by the safetensors package: its tensors and their names in layer order."""
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.w"] = torch.randn(1024, cols)
        tensors[f"layers.{i}.b"] = torch.randn(cols).to(torch.bfloat16)
    path = tmp_path / "m.safetensors"
    st_save_torch(tensors, str(path))
    return path, tensors, [f"layers.{i}.{k}" for i in range(layers) for k in ("w", "b")]


def _bit_sum(t):
    """The sum of `t`'s elements' bit patterns as integers (on `t`'s device, on its current
    stream)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(bits).to(torch.int64).sum()


@_needs_torch_cuda
def test_cuda_groups_are_bit_exact_and_their_events_order_a_consumer(tmp_path):
    """A consumer kernel on PyTorch's stream reads each layer right after waiting its event
    (not the host): every layer's sum matches the file's, for every group."""
    path, tensors, order = _layered(tmp_path, 16, 1024)
    consumer = torch.cuda.Stream()
    sums = []
    kept = []  # until the consumer's stream is done with them (see stream_file's docstring)
    with torch.cuda.stream(consumer):
        for group, ts, ready in dlbridge.stream_file(path, "cuda:0", order=order, framework="pt"):
            assert isinstance(ready, dlbridge.cuda.Event) and ready.handle
            ready.wait(consumer)
            # Integer sums of the bits: exact in any order, so the device's reduction and the
            # host's agree to the last bit when (and only when) every byte arrived.
            sums.append((group, _bit_sum(ts[f"{group}.w"]), _bit_sum(ts[f"{group}.b"])))
            kept.append(ts)
    torch.cuda.synchronize()
    assert [g for g, _, _ in sums] == [f"layers.{i}" for i in range(16)]
    for group, w, b in sums:
        assert w.item() == _bit_sum(tensors[f"{group}.w"]).item()
        assert b.item() == _bit_sum(tensors[f"{group}.b"]).item()


@_needs_torch_cuda
def test_cuda_ready_events_do_not_wait_for_a_consumer_stream(tmp_path):
    """A long kernel on a stream of the consumer's own (where a forward pass that overlaps the
    load computes) does not keep the later groups' ready events from completing: the loads wait
    only for the work queued on the loading thread's current stream (the legacy default one,
    whose pool hands its memory out), and the events are recorded on the stream's own queue."""
    tensors = {f"layers.{i}.w": torch.randn(512, 1024) for i in range(6)}
    path = tmp_path / "m.safetensors"
    st_save_torch(tensors, str(path))
    stream = dlbridge.stream_file(path, "cuda:0", framework="pt", ahead=1)
    _, _, ready = next(stream)
    ready.synchronize()
    torch.cuda.synchronize()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        # About 1 s on a GPU clocked near 2 GHz; then a marker.
        torch.cuda._sleep(2_000_000_000)
        after_sleep = torch.cuda.Event()
        after_sleep.record()
    groups = list(stream)
    assert len(groups) == 5
    for group, ts, ready in groups:
        ready.synchronize()  # the host waits for the group's own event
    # Groups 2 onwards were loaded (and their events recorded) after the sleep was queued.
    assert not after_sleep.query(), "a ready event waited for the consumer stream's kernel"
    torch.cuda.synchronize()
    for group, ts, _ in groups:
        name = f"{group}.w"
        assert torch.equal(ts[name].cpu(), tensors[name])


@_needs_torch_cuda
def test_a_load_into_reused_memory_waits_for_its_earlier_users_kernels(tmp_path):
    """Memory a load hands out and the consumer frees while a kernel of its still reads it (on the
    legacy default stream, PyTorch's default) goes back to the pool, which hands it to the next
    load at once (stream order keeps the old kernel first on that stream): the next load's reads,
    on streams of the reader's own, must still start after that kernel. Before, they did not, and
    the kernel read the next checkpoint's bytes."""
    n = 8 << 20
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    st_save_torch({"w": torch.full((n,), 1.0)}, str(first))
    st_save_torch({"w": torch.full((n,), 2.0)}, str(second))
    torch.cuda.synchronize()
    assert torch.cuda.current_stream().cuda_stream == 0, "PyTorch's default is the legacy stream"
    a = dlbridge.load_file(first, "cuda:0", framework="pt")["w"]
    ptr = a.data_ptr()
    torch.cuda._sleep(1_000_000_000)  # about 0.5 s, then a kernel that reads `a`
    copy = a.clone()
    del a  # back to the pool while the clone is still queued behind the sleep
    b = dlbridge.load_file(second, "cuda:0", framework="pt")["w"]
    assert b.data_ptr() == ptr, "the second load did not reuse the freed block (nothing tested)"
    torch.cuda.synchronize()
    assert torch.equal(copy, torch.full((n,), 1.0, device="cuda:0")), "the kernel read new bytes"
    assert torch.equal(b, torch.full((n,), 2.0, device="cuda:0"))


@_needs_torch_cuda
def test_cuda_stream_with_dtype_events_cover_the_conversion(tmp_path):
    tensors = {f"layers.{i}.w": torch.randn(2048, 2048) for i in range(4)}
    path = tmp_path / "m.safetensors"
    st_save_torch(tensors, str(path))
    for group, ts, ready in dlbridge.stream_file(path, "cuda:0", framework="pt", dtype="bfloat16"):
        ready.synchronize()
        name = f"{group}.w"
        assert ts[name].dtype == torch.bfloat16
        assert torch.equal(ts[name].cpu(), tensors[name].to(torch.bfloat16))


@_needs_torch_cuda
def test_abandoning_a_cuda_stream_frees_the_device_memory(tmp_path):
    tensors = {f"layers.{i}.w": torch.randn(1024, 1024) for i in range(12)}
    path = tmp_path / "m.safetensors"
    st_save_torch(tensors, str(path))
    import gc
    gc.collect()  # arrays an earlier test left in reference cycles go now, not mid-measurement
    torch.cuda.synchronize()
    dlbridge.empty_cache("cuda:0")
    before = dlbridge.memory_stats("cuda:0")["active_bytes"]
    stream = dlbridge.stream_file(path, "cuda:0", ahead=4)
    next(stream)
    stream.close()
    gc.collect()
    assert dlbridge.memory_stats("cuda:0")["active_bytes"] == before


def _reader_threads():
    """The ids of this process's threads named as the loader's reader threads."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "dlbridge-reader":
                    out.add(int(tid))
        except OSError:
            pass  # ended meanwhile
    return out


def _until(predicate, seconds=10.0):
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@_needs_torch_cuda
def test_a_cuda_stream_keeps_its_reader_across_groups_and_a_consumer_sees_each_group(tmp_path):
    """The reader's threads (and with them their streams, events and staging) are made once for
    the whole stream: the same threads are alive at every group, and gone once it ended. A
    consumer kernel on a stream of its own, waiting each group's event (not the host) and reading
    the group at once, sees the file's bytes: no group waits on the host for its copies, so the
    event is all that orders the kernel after them. Before, each group started its threads anew
    (and none were named so)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("threads are listed from /proc")
    assert _until(lambda: not _reader_threads()), "reader threads left by an earlier load"
    path, tensors, order = _layered(tmp_path, 12, 2048)
    consumer = torch.cuda.Stream()
    sums, kept, seen = [], [], []
    with torch.cuda.stream(consumer):
        for group, ts, ready in dlbridge.stream_file(path, "cuda:0", order=order, framework="pt",
                                                     ahead=1, threads=4):
            seen.append(_reader_threads())
            ready.wait(consumer)
            sums.append((group, _bit_sum(ts[f"{group}.w"]), _bit_sum(ts[f"{group}.b"])))
            kept.append(ts)
    torch.cuda.synchronize()
    assert [g for g, _, _ in sums] == [f"layers.{i}" for i in range(12)]
    for group, w, b in sums:
        assert w.item() == _bit_sum(tensors[f"{group}.w"]).item(), group
        assert b.item() == _bit_sum(tensors[f"{group}.b"]).item(), group
    # Groups 0 to 9 were handed out while a later group was still to load (at most one waits for
    # the caller): the reader was alive, the same four threads each time.
    assert len(seen[0]) == 4 and all(s == seen[0] for s in seen[:10]), seen
    assert _until(lambda: not _reader_threads()), "the stream's reader outlived it"


@_needs_torch_cuda
def test_closing_a_cuda_stream_mid_way_frees_its_reader_and_staging(tmp_path):
    """Closing a stream with groups loaded and not taken and more to load ends its reader's
    threads and returns its pinned staging and the groups' device memory to their pools."""
    if not sys.platform.startswith("linux"):
        pytest.skip("threads are listed from /proc")
    tensors = {f"layers.{i}.w": torch.randn(1024, 1024) for i in range(24)}
    path = tmp_path / "m.safetensors"
    st_save_torch(tensors, str(path))
    import gc
    gc.collect()
    torch.cuda.synchronize()
    assert _until(lambda: not _reader_threads()), "reader threads left by an earlier load"
    dlbridge.empty_cache("cuda:0")
    pinned = dlbridge.memory_stats("cuda_host:0")["active_bytes"]
    device = dlbridge.memory_stats("cuda:0")["active_bytes"]
    stream = dlbridge.stream_file(path, "cuda:0", ahead=4, threads=3)
    next(stream)
    assert len(_reader_threads()) == 3
    assert dlbridge.memory_stats("cuda_host:0")["active_bytes"] > pinned, "no staging held"
    stream.close()
    gc.collect()
    assert _until(lambda: not _reader_threads()), "the stream's reader outlived close()"
    assert dlbridge.memory_stats("cuda_host:0")["active_bytes"] == pinned
    assert dlbridge.memory_stats("cuda:0")["active_bytes"] == device


@_needs_torch_cuda
def test_a_load_session_keeps_one_reader_for_reads_into_targets_and_orders_its_stream(tmp_path):
    """Reads into a model's parameters, one step per group as a stream into targets makes them,
    inside a load session: the same reader threads serve every step and end with the session, and
    each step returns with the thread's current stream ordered after its copies (the host does
    not wait for them): a consumer kernel waiting an event recorded there sees the file's bytes.
    Without a session each step starts and ends a reader of its own."""
    if not sys.platform.startswith("linux"):
        pytest.skip("threads are listed from /proc")
    assert _until(lambda: not _reader_threads()), "reader threads left by an earlier load"
    tensors = {f"layers.{i}.w": torch.randn(512, 2048) for i in range(8)}
    path = tmp_path / "m.safetensors"
    st_save_torch(tensors, str(path))
    ckpt = dlbridge._dlbridge._Checkpoint(str(path))
    targets = {k: torch.empty_like(v, device="cuda:0") for k, v in tensors.items()}
    own = dlbridge.cuda.Stream("cuda:0")
    consumer = torch.cuda.Stream()
    seen, sums = [], []
    torch.cuda.synchronize()
    ckpt.load_parts_into([("layers.0.w", (), targets["layers.0.w"])], 2, None, None, True)
    assert not _reader_threads(), "a read outside a session keeps its reader"
    with dlbridge.cuda.stream(own), dlbridge._dlbridge._LoadSession():
        for i, name in enumerate(tensors):
            ckpt.load_parts_into([(name, (), targets[name])], 2, None, None, i == 0)
            seen.append(_reader_threads())
            ready = dlbridge.cuda.Event("cuda:0")
            ready.record(own)
            ready.wait(consumer)
            with torch.cuda.stream(consumer):
                sums.append(_bit_sum(targets[name]))
    assert len(seen[0]) == 2 and all(s == seen[0] for s in seen), seen
    assert _until(lambda: not _reader_threads()), "the session's reader outlived it"
    torch.cuda.synchronize()
    for name, got in zip(tensors, sums):
        assert got.item() == _bit_sum(tensors[name]).item(), name


def test_a_load_session_on_the_cpu_reads_targets_and_nests(checkpoint):
    """On the CPU a session changes nothing a caller sees: the targets get the file's bytes, and
    a session entered inside another restores it when left."""
    path, tensors = checkpoint
    ckpt = dlbridge._dlbridge._Checkpoint(str(path))
    name = next(iter(tensors))
    target = torch.zeros_like(tensors[name])
    with dlbridge._dlbridge._LoadSession() as outer:
        with dlbridge._dlbridge._LoadSession():
            ckpt.load_parts_into([(name, (), target)], 2, None, None, True)
        assert torch.equal(target, tensors[name])
        target.zero_()
        ckpt.load_parts_into([(name, (), target)], 2, None, None, True)
    assert isinstance(outer, dlbridge._dlbridge._LoadSession)
    assert torch.equal(target, tensors[name])


@_needs_torch_cuda
def test_a_cuda_stream_into_targets_keeps_one_reader_and_a_consumer_sees_each_group(tmp_path):
    """A stream into a model's parameters reads every group with one reader (the same threads at
    every group, gone once it ended), and each group's event orders a consumer kernel after its
    copies, which the host no longer waits for. Before, each group started its own reader."""
    if not sys.platform.startswith("linux"):
        pytest.skip("threads are listed from /proc")
    assert _until(lambda: not _reader_threads()), "reader threads left by an earlier load"
    tensors = {f"layers.{i}.w": torch.randn(1024, 2048) for i in range(12)}
    path = tmp_path / "m.safetensors"
    st_save_torch(tensors, str(path))
    targets = {k: torch.empty_like(v, device="cuda:0") for k, v in tensors.items()}
    consumer = torch.cuda.Stream()
    seen, sums = [], []
    with torch.cuda.stream(consumer):
        for group, ts, ready in dlbridge.stream_file(path, "cuda:0", order=list(tensors),
                                                     targets=targets, ahead=1, threads=3):
            seen.append(_reader_threads())
            ready.wait(consumer)
            sums.append((group, _bit_sum(ts[f"{group}.w"])))
            assert ts[f"{group}.w"] is targets[f"{group}.w"]
    torch.cuda.synchronize()
    assert [g for g, _ in sums] == [f"layers.{i}" for i in range(12)]
    for group, got in sums:
        assert got.item() == _bit_sum(tensors[f"{group}.w"]).item(), group
    assert len(seen[0]) == 3 and all(s == seen[0] for s in seen[:10]), seen
    assert _until(lambda: not _reader_threads()), "the stream's reader outlived it"


# Streaming into targets and by a shard plan (the loader's engine; one process per rank is in
# test_sharded_load.py: gloo here, NCCL and dlbridge.nccl on a machine of two GPUs).


def _meta_module(tensors):
    """A module on PyTorch's `meta` device with a parameter per tensor, under its name."""
    with torch.device("meta"):
        root = torch.nn.Module()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype)))
    return root


def _stream_into_module(path, tensors, device):
    model = _meta_module(tensors)
    stream = dlbridge.stream_file(path, device, targets=model, order=_execution_order())
    seen = []
    params = dict(model.named_parameters())
    for group, ts, ready in stream:
        if ready is not None:
            ready.synchronize()
        for name, t in ts.items():
            assert t is params[name] and isinstance(t, torch.nn.Parameter)  # the module's own
            assert torch.equal(t.detach().cpu(), tensors[name]), name
        seen.append((group, list(ts)))
    assert seen == stream.groups
    assert [g for g, _ in seen][:2] == ["model.embed_tokens.weight", "model.layers.0"]
    assert all(p.device.type == torch.device(device).type for p in model.parameters())


def test_streaming_into_a_meta_module_group_by_group(checkpoint):
    """`stream_file(targets=module)`: the module's `meta` parameters created on the device, each
    layer's filled in place and handed out (the module's own Parameters) as its group comes."""
    path, tensors = checkpoint
    _stream_into_module(path, tensors, "cpu")


@_needs_torch_cuda
def test_streaming_into_a_meta_module_on_cuda(checkpoint):
    path, tensors = checkpoint
    _stream_into_module(path, tensors, "cuda:0")


def test_streaming_into_targets_checks_before_reading(checkpoint):
    path, tensors = checkpoint
    targets = {k: torch.zeros_like(v) for k, v in tensors.items()}
    targets["extra"] = torch.zeros(1)
    with pytest.raises(KeyError, match="stream_file.*extra"):
        dlbridge.stream_file(path, targets=targets)
    assert all(torch.count_nonzero(t) == 0 for t in targets.values())
    del targets["extra"]
    targets["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'model.norm.weight'.*shape"):
        dlbridge.stream_file(path, targets=targets)
    partial = {"lm_head.weight": torch.zeros(100, 64)}
    got = list(dlbridge.stream_file(path, targets=partial, strict=False))
    assert [(g, list(ts)) for g, ts, _ in got] == [("lm_head.weight", ["lm_head.weight"])]
    assert torch.equal(partial["lm_head.weight"], tensors["lm_head.weight"])


def test_streaming_a_shard_plan_and_its_argument_errors(checkpoint):
    """A plan on one device (one rank: every part is the whole tensor), cast targets, and the
    arguments a sharded stream refuses."""
    path, tensors = checkpoint
    plan = {"*.mlp.weight": 1, "*.attn.weight": 0}
    got = {}
    for _, ts, _ in dlbridge.stream_file(path, shard=plan, framework="pt", copy=True):
        got.update(ts)
    assert set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
    targets = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in tensors.items()}
    list(dlbridge.stream_file(path, targets=targets, shard=plan))
    assert all(torch.equal(targets[k], tensors[k].double()) for k in tensors)
    with pytest.raises(ValueError, match="one device"):
        dlbridge.stream_file(path, ["cpu", "cpu"], shard=plan)
    with pytest.raises(ValueError, match="dtype"):
        dlbridge.stream_file(path, shard=plan, dtype="float16")
    with pytest.raises(ValueError, match="go together"):
        dlbridge.stream_file(path, shard=plan, rank=0)
    with pytest.raises(ValueError, match="targets="):
        dlbridge.stream_file(path, shard="targets")


def test_closing_a_sharded_stream_ends_its_thread(checkpoint):
    path, _ = checkpoint
    stream = dlbridge.stream_file(path, shard={"*.attn.weight": 0}, copy=True, ahead=1)
    next(stream)
    stream.close()
    thread = stream._native._thread
    assert not thread.is_alive()
    assert list(stream) == []
