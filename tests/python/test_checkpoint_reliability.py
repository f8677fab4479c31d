"""Checkpoint files a careful or a hostile user hands dlbridge: a PyTorch write into a loaded view
(the file is mapped copy-on-write, and read-only copies where the system refuses that), FIFOs,
sockets, devices and folders where a file is expected (refused, never waited on), saves over
existing files and symbolic links, headers over the cap, and the `safetensors` package's verdict on
every malformed header, side by side with dlbridge's.

Crashes and hangs are run in a child process with a timeout, so that neither can take pytest down.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dlbridge

safetensors = pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")

# The test-only switch that makes the loader act as if the system refused a copy-on-write
# mapping (as strict overcommit, vm.overcommit_memory=2, does): the read-only fallback then runs.
REFUSE_COW = "_DLBRIDGE_TEST_REFUSE_COPY_ON_WRITE"


def _child(code: str, *args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter; a child still running after `timeout` fails the test
    (it hung) instead of hanging pytest."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                              text=True, timeout=timeout, env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child process hung for {timeout} s: {e.stdout!r} {e.stderr!r}")


def _save(path, **arrays) -> bytes:
    dlbridge.save_file(arrays, path)
    with open(path, "rb") as f:
        return f.read()


# ---------------------------------------------------------------------------------------------
# 1. Writes into loaded views: copy-on-write mappings, and the read-only fallback.

_WRITE_CHILD = """
    import sys, json, numpy as np, torch, dlbridge
    from safetensors.numpy import load_file as reference
    how, path = sys.argv[1], sys.argv[2]
    if how == "load_file":
        arrays = dlbridge.load_file(path)
    elif how == "safe_open":
        with dlbridge.safe_open(path) as f:
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    elif how == "get_tensors":
        with dlbridge.safe_open(path) as f:
            arrays = f.get_tensors()
    elif how == "get_slice":
        with dlbridge.safe_open(path) as f:
            arrays = {"w": f.get_slice("w")[:]}
    else:  # a sharded checkpoint, through its index
        arrays = dlbridge.load_file(path)
    w = arrays["w"]
    report = {"readonly": w.readonly, "view": w.is_foreign}
    # NumPy honours the read-only flag; PyTorch ignores it and writes.
    report["numpy_writeable"] = np.from_dlpack(w).flags.writeable
    t = torch.from_dlpack(w)
    t.add_(1)
    t[0] = 42
    report["torch"] = t.tolist()
    report["same_array"] = np.from_dlpack(w).tolist()
    report["another_load"] = np.from_dlpack(dlbridge.load_file(path)["w"]).tolist()
    report["reference"] = reference(path if how != "index" else sys.argv[3])["w"].tolist()
    print(json.dumps(report))
"""


def _write_case(tmp_path, how):
    w = np.arange(6, dtype=np.float32)
    if how == "index":
        shard = tmp_path / "model-00002-of-00002.safetensors"
        dlbridge.save_file({"b": np.ones(3, np.int64)}, tmp_path / "model-00001-of-00002.safetensors")
        before = _save(shard, w=w)
        index = tmp_path / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": {"b": "model-00001-of-00002.safetensors",
                                                    "w": shard.name}}))
        return [str(index), str(shard)], shard, before
    path = tmp_path / "w.safetensors"
    return [str(path)], path, _save(path, w=w)


@pytest.mark.parametrize("how", ["load_file", "safe_open", "get_tensors", "get_slice", "index"])
def test_a_torch_write_into_a_cpu_load_does_not_crash_and_stays_private(tmp_path, how):
    """`torch.from_dlpack(load_file(p)["w"]).add_(1)` killed the process (SIGSEGV: the file was
    mapped read-only and PyTorch ignores DLPack's READ_ONLY flag). The file is now mapped
    copy-on-write: the write lands in the process's own copy of the page. Views of the same load
    see it (one memory); the file on disk, another load and the `safetensors` reader do not."""
    args, path, before = _write_case(tmp_path, how)
    child = _child(_WRITE_CHILD, how, *args)
    assert child.returncode == 0, f"rc={child.returncode}\n{child.stderr[-3000:]}"
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["readonly"] and report["view"], report
    assert report["numpy_writeable"] is False
    written = [42.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert report["torch"] == written and report["same_array"] == written
    original = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert report["another_load"] == original and report["reference"] == original
    assert path.read_bytes() == before


@pytest.mark.parametrize("how", ["load_file", "safe_open", "get_slice", "index"])
def test_where_copy_on_write_is_refused_cpu_loads_are_read_only_copies(tmp_path, how):
    """Where the system refuses a writable private mapping (strict overcommit; forced here with
    the test-only switch, which takes the loader's real fallback path), the file is mapped
    read-only, and no array is a view of those pages: each is a read-only copy that a write by
    PyTorch cannot fault on."""
    args, path, before = _write_case(tmp_path, how)
    child = _child(_WRITE_CHILD, how, *args, env={REFUSE_COW: "1"})
    assert child.returncode == 0, f"rc={child.returncode}\n{child.stderr[-3000:]}"
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["readonly"] and not report["view"], report
    assert report["numpy_writeable"] is False
    assert report["torch"] == report["same_array"] == [42.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert report["another_load"] == report["reference"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert path.read_bytes() == before


def test_copy_on_write_mapping_is_private_and_writable_and_the_fallback_read_only(tmp_path):
    """The mappings themselves, as /proc/self/maps lists them: `rw-p` (private, copy-on-write),
    and `r--p` under the fallback; `copy=True` arrays are writable pool memory either way."""
    path = tmp_path / "m.safetensors"
    _save(path, w=np.zeros(1024, np.float32))
    code = """
        import sys, dlbridge
        opened = dlbridge.safe_open(sys.argv[1])  # holds the mapping while open
        copied = dlbridge.load_file(sys.argv[1], copy=True)
        maps = [line.split()[1] for line in open("/proc/self/maps") if line.rstrip().endswith(sys.argv[1])]
        print(",".join(maps), copied["w"].readonly, copied["w"].is_foreign)
    """
    for env, perms in (({}, "rw-p"), ({REFUSE_COW: "1"}, "r--p")):
        child = _child(code, str(path), env=env)
        assert child.returncode == 0, child.stderr
        assert child.stdout.split() == [perms, "False", "False"], (env, child.stdout)


_CHANGE_CHILD = """
    import os, sys, numpy as np, dlbridge
    from safetensors.numpy import save_file as reference_save
    how, path = sys.argv[1], sys.argv[2]
    view = dlbridge.load_file(path)["w"]
    copy = dlbridge.load_file(path, copy=True)["w"]
    if how == "dlbridge_save":
        dlbridge.save_file({"w": np.full(4096, -1, np.float32)}, path)
    elif how == "safetensors_save":
        reference_save({"w": np.full(4096, -1, np.float32)}, path)
    elif how == "rewrite_in_place":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 4)
            f.write(np.float32(-1).tobytes())
    elif how == "truncate":
        os.truncate(path, 64)
    print(float(np.from_dlpack(copy)[-1]), flush=True)
    print(float(np.from_dlpack(view)[-1]), flush=True)
"""


@pytest.mark.parametrize("how, last", [("dlbridge_save", 4095.0), ("safetensors_save", 4095.0),
                                       ("rewrite_in_place", -1.0), ("truncate", None)])
def test_what_a_cpu_view_sees_when_its_file_changes(tmp_path, how, last):
    """What the README says of views of a file that changes (they are the file's pages): a save
    that writes a new file and renames it (dlbridge's, and `safetensors` 0.8's) leaves a live view
    on the old pages; a rewrite in place shows through; a truncation makes reading the view raise
    SIGBUS, which kills the process (it is not an OSError). A `copy=True` array is untouched by
    all of them."""
    path = tmp_path / "w.safetensors"
    dlbridge.save_file({"w": np.arange(4096, dtype=np.float32)}, path)
    child = _child(_CHANGE_CHILD, how, str(path))
    lines = child.stdout.split()
    assert lines[0] == "4095.0", child.stdout
    if last is None:
        assert child.returncode == -signal.SIGBUS and len(lines) == 1, (child.returncode, child.stdout)
    else:
        assert child.returncode == 0, child.stderr
        assert float(lines[1]) == last


# ---------------------------------------------------------------------------------------------
# 2. FIFOs, sockets, devices and folders where a checkpoint file is expected.

_OPEN_CHILD = """
    import sys, json, dlbridge
    how, path, good = sys.argv[1:4]
    try:
        if how == "load_file":
            dlbridge.load_file(path)
        elif how == "load_file_list":
            dlbridge.load_file([good, path])
        elif how == "safe_open":
            dlbridge.safe_open(path).keys()
        elif how in ("index", "index_shard"):
            dlbridge.load_file(path)
        elif how == "save_file":
            dlbridge.save_file({"w": dlbridge.zeros(2)}, path)
        print(json.dumps(["no error"]))
    except Exception as e:
        print(json.dumps([type(e).__name__, isinstance(e, OSError), str(e)]))
"""

_KINDS = {"fifo": "is a FIFO (named pipe), not a regular file",
          "socket": "is a socket, not a regular file",
          "char_device": "is a character device, not a regular file",
          "directory": "is a directory, not a regular file"}


def _special(tmp_path, kind: str, name: str):
    """A `kind` of non-regular file at `tmp_path / name` (the character device as a link to
    /dev/null, which nothing here may replace or read from)."""
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        s.listen()
        return path, s
    elif kind == "char_device":
        os.symlink("/dev/null", path)
    else:
        path.mkdir()
    return path, None


@pytest.mark.parametrize("kind", list(_KINDS))
@pytest.mark.parametrize("how", ["load_file", "load_file_list", "safe_open", "index", "index_shard",
                                 "save_file"])
def test_a_path_that_is_not_a_regular_file_is_an_oserror_not_a_hang(tmp_path, how, kind):
    """`mkfifo f.safetensors; load_file("f.safetensors")` blocked in open() forever, and Ctrl-C did
    not stop it. Every path dlbridge opens a user's file through (a file, a list of shards, an
    index, the shards it names, a save's target) refuses anything but a regular file with an
    OSError naming the path and what it is, at once. (A folder given as the checkpoint itself
    opens the checkpoint it holds: this empty one is a FileNotFoundError saying so.)"""
    good = tmp_path / "good.safetensors"
    _save(good, g=np.ones(2, np.float32))
    name = "special.index.json" if how == "index" else "special.safetensors"
    path, keep = _special(tmp_path, kind, name)
    target = path
    if how == "index_shard":
        target = tmp_path / "model.safetensors.index.json"
        target.write_text(json.dumps({"weight_map": {"g": good.name, "x": path.name}}))
    child = _child(_OPEN_CHILD, how, str(target), str(good), timeout=30)
    assert child.returncode == 0, child.stderr[-3000:]
    error = json.loads(child.stdout.splitlines()[-1])
    assert error[:2] == [error[0], True], error
    says = _KINDS[kind]
    if kind == "directory" and how in ("load_file", "safe_open"):
        says = "is a directory holding no model.safetensors.index.json and no *.safetensors file"
    assert str(path) in error[2] and says in error[2], error
    if kind == "directory" and how in ("load_file", "safe_open"):
        # A folder given as the checkpoint opens the checkpoint in it; this one holds none.
        assert error[0] == "FileNotFoundError", error
    elif kind == "directory":
        assert error[0] == "IsADirectoryError"
    if kind == "char_device":
        assert os.path.islink(path) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    if keep is not None:
        keep.close()


# ---------------------------------------------------------------------------------------------
# 3 and 4. Saves: permissions, owners, symbolic links, and headers over the cap.

def test_a_save_keeps_an_existing_file_s_permissions(tmp_path):
    """A 0600 checkpoint became 0644 when saved over (the temporary's default mode)."""
    path = tmp_path / "private.safetensors"
    for mode in (0o600, 0o640, 0o444):
        path.write_bytes(b"old")
        os.chmod(path, mode)
        dlbridge.save_file({"w": np.ones(3, np.float32)}, path)
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, oct(mode)
        path.unlink()
    # A new file gets what any new file gets: 0o666 less the umask.
    open(tmp_path / "reference", "w").close()
    dlbridge.save_file({"w": np.ones(3, np.float32)}, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(tmp_path / "reference").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["private.safetensors", "reference"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="only root can give a file another owner to keep")
def test_a_save_as_root_keeps_the_owner(tmp_path):
    path = tmp_path / "theirs.safetensors"
    path.write_bytes(b"old")
    os.chown(path, 65534, 65534)
    os.chmod(path, 0o640)
    dlbridge.save_file({"w": np.ones(3, np.float32)}, path)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o640)


def test_a_save_to_a_hugging_face_cache_link_writes_the_blob(tmp_path):
    """The Hugging Face cache keeps `snapshots/<rev>/model.safetensors` as a link into `blobs/`:
    a save replaced the link by a regular file (and left the blob stale). The link stays a link
    and the blob gets the new content."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snapshots" / "rev").mkdir(parents=True)
    blob = tmp_path / "blobs" / "5f2a"
    dlbridge.save_file({"old": np.zeros(2, np.float32)}, blob)
    link = tmp_path / "snapshots" / "rev" / "model.safetensors"
    os.symlink("../../blobs/5f2a", link)
    dlbridge.save_file({"new": np.arange(3, dtype=np.int32)}, link)
    assert link.is_symlink() and os.readlink(link) == "../../blobs/5f2a"
    assert blob.is_file() and not blob.is_symlink()
    from safetensors.numpy import load_file as reference
    assert reference(str(blob))["new"].tolist() == [0, 1, 2]
    assert sorted(os.listdir(tmp_path / "blobs")) == ["5f2a"]
    assert sorted(os.listdir(link.parent)) == ["model.safetensors"]


def test_a_save_with_metadata_over_the_cap_is_a_value_error_and_writes_nothing(tmp_path):
    """`save_file` wrote files `load_file` refuses (a header over 100 MB); it refuses them first."""
    path = tmp_path / "big.safetensors"
    metadata = {"notes": "x" * 100_000_001}
    with pytest.raises(ValueError, match=r"100000006 bytes of metadata.*over the limit of 100000000 bytes"):
        dlbridge.save_file({"w": np.ones(2, np.float32)}, path, metadata=metadata)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# 5. Verdicts on malformed headers, side by side with the `safetensors` package.

def _t(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _raw(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def _j(obj, data: bytes = b"", pad: bytes = b"") -> bytes:
    return _raw(json.dumps(obj).encode() + pad, data)


def _z(n: int) -> bytes:
    return b"\0" * n


_F = _t("F32", [2], 0, 8)
_FB = json.dumps(_F).encode()

# name -> the file's bytes. Every case is run through both readers.
HEADERS = {
    "ok": _j({"w": _F}, _z(8)),
    "empty_header": _j({}),
    "empty_header_padded": _raw(b"{}      "),
    "empty_header_trailing_bytes": _j({}, _z(8)),
    "hole_between": _j({"a": _t("F32", [1], 0, 4), "b": _t("F32", [1], 8, 12)}, _z(12)),
    "hole_at_start": _j({"a": _t("F32", [1], 4, 8)}, _z(8)),
    "trailing_bytes": _j({"w": _F}, _z(12)),
    "trailing_one_byte": _j({"w": _F}, _z(9)),
    "overlap": _j({"a": _F, "b": _t("F32", [2], 4, 12)}, _z(12)),
    "same_range_twice": _j({"a": _F, "b": _F}, _z(8)),
    "out_of_order": _j({"b": _t("F32", [1], 4, 8), "a": _t("F32", [1], 0, 4)}, _z(8)),
    "zero_size_at_start": _j({"e": _t("F32", [0], 0, 0), "w": _F}, _z(8)),
    "zero_size_at_end": _j({"w": _F, "e": _t("F32", [0], 8, 8)}, _z(8)),
    "zero_size_between": _j({"a": _t("F32", [1], 0, 4), "e": _t("F32", [0], 4, 4),
                             "b": _t("F32", [1], 4, 8)}, _z(8)),
    "zero_size_inside": _j({"w": _F, "e": _t("F32", [0], 4, 4)}, _z(8)),
    "zero_size_past_end": _j({"w": _F, "e": _t("F32", [0], 16, 16)}, _z(8)),
    "zero_size_only": _j({"e": _t("F32", [0, 3], 0, 0)}),
    "zero_size_only_at_4": _j({"e": _t("F32", [0], 4, 4)}),
    "zero_size_only_trailing": _j({"e": _t("F32", [0], 0, 0)}, _z(4)),
    "two_zero_size_same_offset": _j({"e": _t("F32", [0], 0, 0), "f": _t("U8", [0], 0, 0)}),
    "shape_zero_extent": _j({"e": _t("F32", [0, 5], 0, 0)}),
    "shape_zero_times_2_62": _j({"e": _t("F32", [0, 2**62], 0, 0)}),
    "shape_zero_times_2_63": _j({"e": _t("F32", [0, 2**63], 0, 0)}),
    "shape_2_64": _j({"w": _t("F32", [2**64], 0, 8)}, _z(8)),
    "shape_negative": _j({"w": _t("F32", [-2], 0, 8)}, _z(8)),
    "shape_float": _j({"w": _t("F32", [2.0], 0, 8)}, _z(8)),
    "shape_string": _j({"w": _t("F32", ["2"], 0, 8)}, _z(8)),
    "shape_not_a_list": _j({"w": _t("F32", 2, 0, 8)}, _z(8)),
    "shape_overflow": _j({"w": _t("F32", [2**32, 2**32], 0, 0)}),
    "shape_bytes_overflow": _j({"w": _t("F64", [2**62], 0, 0)}),
    "scalar": _j({"s": _t("F32", [], 0, 4)}, _z(4)),
    "shape_wrong_length": _j({"w": _t("F32", [3], 0, 8)}, _z(8)),
    "begin_after_end": _j({"w": _t("F32", [2], 8, 0)}, _z(8)),
    "three_offsets": _raw(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', _z(8)),
    "one_offset": _raw(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[8]}}', _z(8)),
    "offsets_2_64": _j({"w": _t("F32", [2], 0, 2**64)}, _z(8)),
    "offsets_2_63": _j({"w": _t("U8", [2**63], 0, 2**63)}, _z(8)),
    "offsets_float": _raw(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}}', _z(8)),
    "offsets_exponent": _raw(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8e0]}}', _z(8)),
    "offsets_strings": _raw(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}}', _z(8)),
    "duplicate_tensor": _raw(b'{"w":%s,"w":%s}' % (_FB, _FB), _z(8)),
    "duplicate_tensor_hiding_a_hole": _raw(b'{"w":%s,"w":%s}' % (_FB, json.dumps(_t("F32", [2], 8, 16)).encode()),
                                           _z(16)),
    "duplicate_field": _raw(b'{"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', _z(8)),
    "duplicate_metadata": _raw(b'{"__metadata__":{"a":"1"},"__metadata__":{"a":"2"},"w":%s}' % _FB, _z(8)),
    "duplicate_metadata_key": _raw(b'{"__metadata__":{"a":"1","a":"2"},"w":%s}' % _FB, _z(8)),
    "metadata_int_value": _j({"__metadata__": {"a": 1}, "w": _F}, _z(8)),
    "metadata_null_value": _j({"__metadata__": {"a": None}, "w": _F}, _z(8)),
    "metadata_nested": _j({"__metadata__": {"a": {"b": "c"}}, "w": _F}, _z(8)),
    "metadata_null": _j({"__metadata__": None, "w": _F}, _z(8)),
    "metadata_empty": _j({"__metadata__": {}, "w": _F}, _z(8)),
    "metadata_list": _j({"__metadata__": ["a"], "w": _F}, _z(8)),
    "metadata_string": _j({"__metadata__": "a", "w": _F}, _z(8)),
    "metadata_last": _j({"w": _F, "__metadata__": {"format": "pt"}}, _z(8)),
    "metadata_only": _j({"__metadata__": {"format": "pt"}}),
    "metadata_unicode": _j({"__metadata__": {"ключ": "値\u0000"}, "w": _F}, _z(8)),
    "metadata_tensor_like": _j({"__metadata__": _F}, _z(8)),
    "header_not_8_aligned": _raw(json.dumps({"w": _F}).encode() + b" ", _z(8)),
    "header_padded_with_spaces": _j({"w": _F}, _z(8), pad=b" " * 13),
    "header_padded_with_newlines": _j({"w": _F}, _z(8), pad=b"\n\t\r "),
    "header_padded_with_nul": _j({"w": _F}, _z(8), pad=b"\0" * 3),
    "header_leading_space": _raw(b" " + json.dumps({"w": _F}).encode(), _z(8)),
    "header_leading_newline": _raw(b"\n" + json.dumps({"w": _F}).encode(), _z(8)),
    "header_bom": _raw("\ufeff".encode() + json.dumps({"w": _F}).encode(), _z(8)),
    "header_trailing_garbage": _raw(json.dumps({"w": _F}).encode() + b" x", _z(8)),
    "header_two_objects": _raw(json.dumps({"w": _F}).encode() + b"{}", _z(8)),
    "header_comment": _raw(b'{"w":%s /* c */}' % _FB, _z(8)),
    "header_length_zero": _raw(b"", _z(8)),
    "header_length_past_end": _raw(b"{}", length=100),
    "header_length_over_limit": _raw(b"{}", length=100_000_001),
    "header_length_absurd_zip": b"PK\x03\x04\x14\x00\x00\x00" + _z(40),
    "file_7_bytes": _z(7),
    "file_empty": b"",
    "file_8_zero_bytes": _z(8),
    "json_array": _raw(b"[]"),
    "json_number": _raw(b"1"),
    "json_string": _raw(b'"x"'),
    "json_null": _raw(b"null"),
    "bad_utf8": _raw(b'{"\xff": 1}'),
    "bad_utf8_in_padding": _raw(b"{}\xff"),
    "unknown_dtype": _j({"w": _t("F13", [2], 0, 8)}, _z(8)),
    "lowercase_dtype": _j({"w": _t("f32", [2], 0, 8)}, _z(8)),
    "dtype_not_a_string": _j({"w": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}}, _z(8)),
    "missing_dtype": _j({"w": {"shape": [2], "data_offsets": [0, 8]}}, _z(8)),
    "missing_shape": _j({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, _z(8)),
    "missing_offsets": _j({"w": {"dtype": "F32", "shape": [2]}}, _z(8)),
    "extra_field": _j({"w": dict(_F, extra=1)}, _z(8)),
    "extra_field_deep": _raw(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}'
                             % (b"[" * 100 + b"]" * 100), _z(8)),
    "extra_field_too_deep": _raw(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}'
                                 % (b"[" * 200 + b"]" * 200), _z(8)),
    "entry_not_an_object": _j({"w": [0, 8]}, _z(8)),
    "entry_null": _j({"w": None}, _z(8)),
    "empty_name": _j({"": _F}, _z(8)),
    "nul_in_name": _j({"a\u0000b": _F}, _z(8)),
    "lone_surrogate_name": _raw(b'{"\\ud800":%s}' % _FB, _z(8)),
    "f4_whole_bytes": _j({"w": _t("F4", [4], 0, 2)}, _z(2)),
    "f4_half_byte": _j({"w": _t("F4", [3], 0, 2)}, _z(2)),
    "f6_whole_bytes": _j({"w": _t("F6_E2M3", [4], 0, 3)}, _z(3)),
    "f6_partial_byte": _j({"w": _t("F6_E3M2", [2], 0, 2)}, _z(2)),
    "bool": _j({"w": _t("BOOL", [3], 0, 3)}, _z(3)),
    "c64": _j({"w": _t("C64", [2], 0, 16)}, _z(16)),
    "64_axes": _j({"w": _t("U8", [1] * 64, 0, 1)}, _z(1)),
    "65_axes": _j({"w": _t("U8", [1] * 65, 0, 1)}, _z(1)),
    "1000_axes": _j({"w": _t("U8", [1] * 1000, 0, 1)}, _z(1)),
    "misaligned_tensor": _j({"a": _t("U8", [1], 0, 1), "b": _t("F32", [1], 1, 5)}, _z(5)),
}

# The cases dlbridge refuses on purpose where `safetensors` accepts, and why. Each must still be
# accepted by the reference (else the entry is stale) and refused by dlbridge.
STRICTER = {
    # A name or key given twice: `safetensors` keeps the last silently, so two readers may see
    # different tensors in one file; dlbridge refuses a key repeated at any depth.
    "duplicate_tensor": "duplicate key `w`",
    "duplicate_metadata_key": "duplicate key `a`",
    # Tensors dlbridge cannot hold: a layout's extents fit in isize, and it has at most 64 axes.
    "shape_zero_times_2_63": "overflows",
    "65_axes": "dlbridge holds at most 64",
    "1000_axes": "dlbridge holds at most 64",
}


def _reference_verdict(data: bytes, path) -> tuple[bool, str]:
    """Whether `safetensors` reads the file, from its bytes and from the file; both must agree."""
    try:
        safetensors.deserialize(data)
        from_bytes = (True, "")
    except Exception as e:  # noqa: BLE001 - SafetensorError and JSON errors alike
        from_bytes = (False, str(e))
    try:
        with safetensors.safe_open(str(path), "np") as f:
            f.keys()
        from_file = True
    except Exception:  # noqa: BLE001
        from_file = False
    assert from_bytes[0] == from_file, f"the reference disagrees with itself: {from_bytes}"
    return from_bytes


@pytest.mark.parametrize("name", list(HEADERS))
def test_verdicts_match_the_safetensors_package(tmp_path, name):
    """Every malformed or edge-case header gets the same accept/refuse verdict from dlbridge as
    from the `safetensors` package, except the deliberate, listed stricter checks. Holes between
    tensors and trailing bytes (room for a second format in one file) used to be accepted."""
    data = HEADERS[name]
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(data)
    reference_ok, reference_error = _reference_verdict(data, path)
    try:
        with dlbridge.safe_open(path) as f:
            keys, offset_keys, metadata = f.keys(), f.offset_keys(), f.metadata()
            ranges = {k: f._open().info(k)[2] for k in keys}
        dlbridge.load_file(path)
        ours, error = True, None
    except ValueError as e:
        ours, error = False, e
    if name in STRICTER:
        assert reference_ok, f"{name}: the reference refuses it now ({reference_error}): drop it from STRICTER"
        assert not ours and STRICTER[name] in str(error), error
        return
    assert ours == reference_ok, f"{name}: safetensors {'accepts' if reference_ok else 'refuses'} " \
                                 f"({reference_error}), dlbridge says {error}"
    if ours:
        with safetensors.safe_open(str(path), "np") as f:
            assert keys == sorted(f.keys())
            # In file order; tensors at the same range (empty ones) may come in either order.
            assert sorted(offset_keys) == keys
            assert [ranges[k] for k in offset_keys] == [ranges[k] for k in f.offset_keys()]
            assert metadata == f.metadata()
    else:
        assert str(path) in str(error)


def test_a_file_that_is_not_safetensors_says_so(tmp_path):
    """A PyTorch checkpoint (a ZIP archive, or an older pickle) given to load_file said "header
    length 8367736964726416744 exceeds the limit": now it says it is not a safetensors file and
    what it looks like."""
    for name, kwargs, kind in (("zip.pt", {}, "a ZIP archive"),
                               ("pickle.pt", {"_use_new_zipfile_serialization": False}, "a Python pickle")):
        path = tmp_path / name
        torch.save({"w": torch.zeros(3)}, path, **kwargs)
        with pytest.raises(ValueError, match="not a safetensors file: it begins b\"") as info:
            dlbridge.load_file(path)
        assert kind in str(info.value) and name in str(info.value)
    path = tmp_path / "array.safetensors"
    path.write_bytes(_raw(b"[1, 2, 3]"))
    with pytest.raises(ValueError, match="not a safetensors file: .*does not begin with `{`"):
        dlbridge.load_file(path)


# ---------------------------------------------------------------------------------------------
# 7. safe_open as `safetensors.safe_open` has it.

def test_safe_open_has_the_reference_methods_and_return_types(tmp_path):
    path = tmp_path / "api.safetensors"
    from safetensors.numpy import save_file as reference_save
    reference_save({"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.zeros(2, np.int8)}, str(path))
    public = {m for m in dir(safetensors.safe_open) if not m.startswith("_")}
    assert public <= {m for m in dir(dlbridge.safe_open) if not m.startswith("_")}
    with safetensors.safe_open(str(path), "np") as ref, dlbridge.safe_open(path, "np") as ours:
        assert ref.metadata() is None and ours.metadata() is None
        assert ours.keys() == ref.keys() == ["a", "b"]
        assert ours.offset_keys() == ref.offset_keys() == ["b", "a"]
        assert list(ours.get_tensors()) == list(ref.get_tensors()) == ["b", "a"]
        for name in ref.keys():
            ref_slice, our_slice = ref.get_slice(name), ours.get_slice(name)
            assert our_slice.get_shape() == ref_slice.get_shape() and type(our_slice.get_shape()) is list
            assert our_slice.get_dtype() == ref_slice.get_dtype() and type(our_slice.get_dtype()) is str
            np.testing.assert_array_equal(np.from_dlpack(ours.get_tensor(name)), ref.get_tensor(name))
        np.testing.assert_array_equal(np.asarray(ours.get_slice("b")[1]), ref.get_slice("b")[1])
        with pytest.raises(KeyError, match="zz"):
            ours.get_tensor("zz")
        with pytest.raises(KeyError, match="zz"):
            ours.get_slice("zz")
    for metadata in ({}, {"format": "np"}):
        reference_save({"a": np.zeros(2, np.int8)}, str(path), metadata=metadata)
        with safetensors.safe_open(str(path), "np") as ref, dlbridge.safe_open(path) as ours:
            assert ours.metadata() == ref.metadata() == metadata
    # backend="pread" reads into memory of its own; "mmap" (the default) views the file.
    with dlbridge.safe_open(path, "dlbridge", backend="pread") as f:
        assert not f.get_tensor("a").readonly and not f.get_tensor("a").is_foreign
    with dlbridge.safe_open(path, "dlbridge", backend="mmap") as f:
        assert f.get_tensor("a").readonly and f.get_tensor("a").is_foreign
    # In NumPy's arrays: writable memory of its own, or read-only views.
    with dlbridge.safe_open(path, "np", backend="pread") as f:
        assert f.get_tensor("a").flags.writeable and f.get_slice("a")[1:].flags.writeable
    with dlbridge.safe_open(path, "np", backend="mmap") as f:
        assert not f.get_tensor("a").flags.writeable and not f.get_slice("a")[1:].flags.writeable
    with pytest.raises(ValueError, match="backend 'disk'"):
        dlbridge.safe_open(path, backend="disk")


def test_safe_open_of_an_index_gives_its_metadata_or_none(tmp_path):
    from safetensors.numpy import save_file as reference_save
    reference_save({"a": np.zeros(2, np.int8)}, str(tmp_path / "s.safetensors"), metadata={"format": "np"})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s.safetensors"}}))
    assert dlbridge.safe_open(index).metadata() is None
    index.write_text(json.dumps({"metadata": {"total_size": 2}, "weight_map": {"a": "s.safetensors"}}))
    assert dlbridge.safe_open(index).metadata() == {"total_size": "2"}
    # Several files given as a list: no one metadata (each shard has its own).
    assert dlbridge.safe_open([tmp_path / "s.safetensors"]).metadata() == {"format": "np"}
