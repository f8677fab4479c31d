"""`dlbridge.load_npy` / `load_npz`: NumPy files through the loading engine, against `numpy.load`.

Every dtype dlbridge has, 0-d and empty shapes, Fortran order, big-endian data, `np.savez`
archives of several members, the refusals (compressed members, objects, structured and void
dtypes, truncated and malformed files, paths that are not regular files), zero-copy CPU loads
(the array is the mapped file's bytes, and a write through PyTorch lands in a private page
without crashing), and the same files on CUDA and Metal where those devices are present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dlbridge

CUDA = dlbridge.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
METAL = dlbridge.metal.is_available()
needs_metal = pytest.mark.skipif(not METAL, reason="needs a Metal device")

DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
SHAPES = [(), (0,), (5,), (2, 3, 4), (0, 3), (1, 1, 7)]
# The devices every file is loaded onto: the CPU here, CUDA and Metal where present.
DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=needs_cuda),
    pytest.param("metal:0", marks=needs_metal),
]


def _values(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -(2**40)), min(info.max, 2**40), size=shape, dtype=np.int64).astype(dtype)
    real = rng.standard_normal(size=shape)
    if dtype.kind == "c":
        return (real + 1j * rng.standard_normal(size=shape)).astype(dtype)
    return real.astype(dtype)


def _host(a: dlbridge.Array) -> np.ndarray:
    """`a`'s values as a NumPy array, copied to the CPU first where it lives on a device."""
    if a.device.type != "cpu":
        a = a.to("cpu")
    return np.asarray(a)


def _check(got: dlbridge.Array, want: np.ndarray, device: str) -> None:
    assert str(got.device) == device
    host = _host(got)
    assert host.dtype == want.dtype.newbyteorder("=") and host.shape == want.shape
    np.testing.assert_array_equal(host, want)


def _child(code: str, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter; a child still running after `timeout` fails the test
    (it hung) instead of hanging pytest."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                              capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child process hung for {timeout} s: {e.stdout!r} {e.stderr!r}")


def _npy(path, dict_text: str, data: bytes = b"", version=(1, 0)) -> None:
    """A `.npy` file with a hand-written header (numpy's padding) and `data`."""
    header = dict_text.encode("latin1")
    length_bytes = 2 if version == (1, 0) else 4
    pad = -(6 + 2 + length_bytes + len(header) + 1) % 64
    header += b" " * pad + b"\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY" + bytes(version) + len(header).to_bytes(length_bytes, "little") + header + data)


# ---------------------------------------------------------------------------------------------
# What numpy.load gives.


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_shape_equals_numpy_load(tmp_path, dtype, device):
    for i, shape in enumerate(SHAPES):
        want = _values(shape, dtype, seed=i)
        path = tmp_path / f"a{i}.npy"
        np.save(path, want)
        reference = np.load(path)
        got = dlbridge.load_npy(path, device)
        assert tuple(got.shape) == reference.shape, shape
        _check(got, reference, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f4", "i2", "c16", "?"])
def test_fortran_order_keeps_numpy_s_strides(tmp_path, dtype, device):
    want = np.asfortranarray(_values((3, 4, 5), dtype))
    path = tmp_path / "f.npy"
    np.save(path, want)
    reference = np.load(path)
    assert reference.flags.f_contiguous and not reference.flags.c_contiguous
    got = dlbridge.load_npy(path, device)
    _check(got, reference, device)
    if device == "cpu":
        itemsize = reference.dtype.itemsize
        assert tuple(got.strides) == tuple(s // itemsize for s in reference.strides)
        assert got.is_foreign and got.readonly  # a view of the mapped file


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [">f4", ">i8", ">u2", ">f2", ">c8", ">c16", ">f8", ">i1", ">?"])
@pytest.mark.parametrize("fortran", [False, True])
def test_big_endian_data_is_swapped_on_load(tmp_path, dtype, fortran, device):
    want = _values((4, 3), dtype).astype(dtype)
    if fortran:
        want = np.asfortranarray(want)
    path = tmp_path / "b.npy"
    np.save(path, want)
    reference = np.load(path)
    assert reference.dtype.str == np.dtype(dtype).str
    got = dlbridge.load_npy(path, device)
    _check(got, reference.astype(reference.dtype.newbyteorder("=")), device)
    if device == "cpu":
        # Swapped in memory of its own; single bytes have no order: a view of the file.
        assert got.readonly and got.is_foreign == (reference.dtype.itemsize == 1)
        assert not dlbridge.load_npy(path, copy=True).readonly


@pytest.mark.parametrize("device", DEVICES)
def test_npz_members_by_the_keys_numpy_gives(tmp_path, device):
    arrays = {f"m{i}_{d}": _values(SHAPES[i % len(SHAPES)], d, seed=i) for i, d in enumerate(DTYPES)}
    arrays["fortran"] = np.asfortranarray(_values((3, 5), "f8"))
    arrays["big"] = _values((6,), ">i4").astype(">i4")
    arrays["dotted.name"] = np.arange(3, dtype=np.int16)
    path = tmp_path / "all.npz"
    positional = np.arange(4, dtype=np.uint8)
    np.savez(path, positional, **arrays)
    got = dlbridge.load_npz(path, device)
    with np.load(path) as reference:
        assert sorted(got) == sorted(reference.files)
        assert "arr_0" in got and "dotted.name" in got
        for key in reference.files:
            want = reference[key]
            _check(got[key], want.astype(want.dtype.newbyteorder("=")), device)


def test_npz_of_no_members_and_of_an_empty_member(tmp_path):
    np.savez(tmp_path / "none.npz")
    assert dlbridge.load_npz(tmp_path / "none.npz") == {}
    np.savez(tmp_path / "empty.npz", e=np.zeros((0, 4), np.float32))
    e = dlbridge.load_npz(tmp_path / "empty.npz")["e"]
    assert tuple(e.shape) == (0, 4)


def test_headers_of_versions_two_and_three(tmp_path):
    data = np.arange(6, dtype="<i4").tobytes()
    for version in [(2, 0), (3, 0)]:
        path = tmp_path / f"v{version[0]}.npy"
        _npy(path, "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }", data, version)
        np.testing.assert_array_equal(np.asarray(dlbridge.load_npy(path)), np.load(path))
    # numpy writes version 2.0 itself for a header past 64 KiB... of field names only, which
    # dlbridge refuses (a structured dtype); a long shape stays in 1.0. Trailing bytes after
    # the data are ignored, as numpy.load ignores them.
    path = tmp_path / "trailing.npy"
    _npy(path, "{'descr': '<i4', 'fortran_order': False, 'shape': (6,), }", data + b"extra")
    np.testing.assert_array_equal(np.asarray(dlbridge.load_npy(path)), np.arange(6))


# ---------------------------------------------------------------------------------------------
# CPU loads are the file's bytes.


_MAPPING_CHILD = """
    import json, sys, numpy as np, dlbridge
    path = sys.argv[1]
    a = dlbridge.load_npy(path)
    starts = [int(line.split("-")[0], 16) for line in open("/proc/self/maps")
              if line.rstrip().endswith(path)]
    perms = [line.split()[1] for line in open("/proc/self/maps") if line.rstrip().endswith(path)]
    with open(path, "rb") as f:
        f.seek(8)
        offset = 10 + int.from_bytes(f.read(2), "little")
    print(json.dumps({"ptr": a.data_ptr, "starts": starts, "perms": perms, "offset": offset,
                      "readonly": a.readonly, "foreign": a.is_foreign,
                      "numpy_writeable": np.from_dlpack(a).flags.writeable}))
"""


def test_a_cpu_load_is_a_view_of_the_file_mapped_copy_on_write(tmp_path):
    """The array's first element is the mapped file's byte at the data offset (pointer equality
    with the mapping /proc/self/maps lists), the mapping is private and writable (`rw-p`:
    copy-on-write), and NumPy sees the view read-only."""
    path = tmp_path / "w.npy"
    np.save(path, np.arange(1000, dtype=np.float32))
    child = _child(_MAPPING_CHILD, str(path))
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["perms"] == ["rw-p"], report
    assert report["ptr"] == report["starts"][0] + report["offset"], report
    assert report["readonly"] and report["foreign"] and not report["numpy_writeable"], report


_WRITE_CHILD = """
    import json, sys, numpy as np, torch, dlbridge
    path, how = sys.argv[1], sys.argv[2]
    a = dlbridge.load_npy(path) if how == "npy" else dlbridge.load_npz(path)["w"]
    t = torch.from_dlpack(a)
    t.add_(1)
    t[0] = 42
    print(json.dumps({"torch": t.tolist(), "same_array": np.from_dlpack(a).tolist(),
                      "view": a.is_foreign,
                      "another_load": np.asarray(dlbridge.load_npy(path) if how == "npy"
                                                 else dlbridge.load_npz(path)["w"]).tolist()}))
"""


@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("how", ["npy", "npz"])
def test_a_torch_write_into_a_cpu_load_does_not_crash_and_stays_private(tmp_path, how, refused):
    """PyTorch ignores DLPack's read-only flag and writes: the write lands in this process's own
    copy of the page (seen by the same array), never in the file or another load. Where the
    system refuses a copy-on-write mapping (strict overcommit; forced by the loader's test-only
    switch, which takes its real fallback), the file is mapped read-only and the array is a copy
    that the write cannot fault on."""
    path = tmp_path / f"w.{how}"
    w = np.arange(6, dtype=np.float32)
    np.save(path, w) if how == "npy" else np.savez(path, w=w)
    before = path.read_bytes()
    env = {"_DLBRIDGE_TEST_REFUSE_COPY_ON_WRITE": "1"} if refused else None
    child = _child(_WRITE_CHILD, str(path), how, env=env)
    assert child.returncode == 0, f"rc={child.returncode}\n{child.stderr[-3000:]}"
    report = json.loads(child.stdout.splitlines()[-1])
    written = [42.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert report["torch"] == written and report["same_array"] == written
    assert report["another_load"] == w.tolist()
    assert path.read_bytes() == before
    if how == "npy":
        # np.save aligns the data: a view of the file, unless the mapping is read-only.
        assert report["view"] == (not refused)
    elif refused:
        assert not report["view"]


def test_copy_gives_writable_memory_of_its_own(tmp_path):
    path = tmp_path / "w.npy"
    np.save(path, np.arange(4, dtype=np.int64))
    a = dlbridge.load_npy(path, copy=True)
    assert not a.readonly and not a.is_foreign
    view = np.from_dlpack(a)
    view[0] = 7
    assert np.asarray(a)[0] == 7 and np.load(path)[0] == 0


def _data_offset(path, name: str) -> int:
    """Where member `name`'s array data begins in the archive (as its local header and its .npy
    header say)."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    raw = path.read_bytes()
    local = info.header_offset
    name_len = int.from_bytes(raw[local + 26:local + 28], "little")
    extra_len = int.from_bytes(raw[local + 28:local + 30], "little")
    member = local + 30 + name_len + extra_len
    assert raw[member:member + 6] == b"\x93NUMPY" and raw[member + 6] == 1
    return member + 10 + int.from_bytes(raw[member + 8:member + 10], "little")


def test_npz_members_are_views_where_aligned_and_read_only_copies_elsewhere(tmp_path):
    """np.savez does not align its members' data: a member whose data happens to be aligned for
    its element type is a view of the mapped archive, another a read-only copy (as every CPU load
    without copy=True); both equal numpy.load's."""
    path = tmp_path / "m.npz"
    # With numpy's ZIP64 local headers, "ab.npy"'s data lands 8-aligned, "a.npy"'s after it not.
    np.savez(path, ab=np.arange(5, dtype=np.float64), a=np.arange(7, dtype=np.float64))
    got = dlbridge.load_npz(path)
    offsets = {key: _data_offset(path, key + ".npy") for key in ("a", "ab")}
    assert {o % 8 == 0 for o in offsets.values()} == {True, False}, offsets
    with np.load(path) as reference:
        for key, offset in offsets.items():
            a = got[key]
            assert a.readonly and a.is_foreign == (offset % 8 == 0), (key, offset)
            np.testing.assert_array_equal(np.asarray(a), reference[key])


# ---------------------------------------------------------------------------------------------
# Refusals.


def test_a_compressed_member_is_a_valueerror_naming_the_cause(tmp_path):
    path = tmp_path / "z.npz"
    np.savez_compressed(path, a=np.arange(10))
    with pytest.raises(ValueError, match=r"savez_compressed") as e:
        dlbridge.load_npz(path)
    assert "a.npy" in str(e.value)


@pytest.mark.parametrize("make, match", [
    (lambda p: np.save(p, np.array([{"x": 1}, None], dtype=object), allow_pickle=True), "pickle"),
    (lambda p: np.save(p, np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")])), "structured"),
    (lambda p: np.save(p, np.array(["ab", "c"])), "string"),
    (lambda p: np.save(p, np.zeros(2, dtype="M8[s]")), "date"),
    (lambda p: np.save(p, np.zeros(2, dtype="V4")), "void"),
    (lambda p: np.save(p, np.zeros(2, dtype=np.longdouble)), "extended"),
])
def test_types_without_a_dlbridge_type_are_valueerrors(tmp_path, make, match):
    path = tmp_path / "t.npy"
    make(path)
    with pytest.raises(ValueError, match=match):
        dlbridge.load_npy(path)


def test_ml_dtypes_bfloat16_saved_by_numpy_is_refused_saying_why(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    path = tmp_path / "bf.npy"
    np.save(path, np.ones(3, ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="ml_dtypes"):
        dlbridge.load_npy(path)


def _truncated(path):
    np.save(path, np.arange(100, dtype=np.float32))
    data = path.read_bytes()
    path.write_bytes(data[:-4])


@pytest.mark.parametrize("make, match", [
    (_truncated, "truncated"),
    (lambda p: p.write_bytes(b""), "shorter"),
    (lambda p: p.write_bytes(b"\x93NUM"), "shorter"),
    (lambda p: p.write_bytes(b"PK\x03\x04" + b"\0" * 100), "not a .npy file"),
    (lambda p: p.write_bytes(b"\x93NUMPY\x01\x00\xff\x00{'descr'"), "truncated"),
    (lambda p: p.write_bytes(b"\x93NUMPY\x09\x00\x10\x00"), "version 9.0"),
    (lambda p: _npy(p, "{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904, 4)}"),
     "overflow"),
    (lambda p: _npy(p, "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}"), "non-negative"),
    (lambda p: _npy(p, "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000,)}", b"\0" * 16),
     "truncated"),
    (lambda p: _npy(p, "{'descr': '<f4', 'fortran_order': 'no', 'shape': ()}"), "fortran_order"),
    (lambda p: _npy(p, "{'descr': '<f4', 'shape': ()}"), "fortran_order"),
    (lambda p: _npy(p, "__import__('os').system('true')"), "Python literal"),
    (lambda p: _npy(p, "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "1," * 65 + ")}"),
     "axes"),
    (lambda p: _npy(p, "{" + " " * 20000 + "}", version=(2, 0)), "limit"),
])
def test_malformed_files_are_valueerrors(tmp_path, make, match):
    path = tmp_path / "bad.npy"
    make(path)
    with pytest.raises(ValueError, match=match):
        dlbridge.load_npy(path)


@pytest.mark.parametrize("make, match", [
    (lambda p: p.write_bytes(b"not a zip at all" * 4), "not a ZIP"),
    (lambda p: (np.savez(p, a=np.arange(4)), p.write_bytes(p.read_bytes()[:-30])), "ZIP"),
    (lambda p: (np.savez(p, a=np.arange(400)), p.write_bytes(p.read_bytes()[:200] + p.read_bytes()[-200:])),
     "past"),
])
def test_malformed_archives_are_valueerrors(tmp_path, make, match):
    path = tmp_path / "bad.npz"
    make(path)
    with pytest.raises(ValueError, match=match):
        dlbridge.load_npz(path)


def test_a_member_that_is_not_npy_is_a_valueerror(tmp_path):
    import zipfile
    path = tmp_path / "x.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a.npy", b"hello, not numpy")
    with pytest.raises(ValueError, match=r"a\.npy.*not a \.npy file"):
        dlbridge.load_npz(path)


_CORRUPT_CHILD = """
    import os, sys, random, numpy as np, dlbridge
    folder = sys.argv[1]
    np.save(os.path.join(folder, "g.npy"), np.arange(12, dtype=">f4").reshape(3, 4))
    np.savez(os.path.join(folder, "g.npz"), a=np.arange(5), b=np.ones((2, 2)))
    rng = random.Random(7)
    outcomes = {}
    for name, load in (("g.npy", dlbridge.load_npy), ("g.npz", dlbridge.load_npz)):
        good = open(os.path.join(folder, name), "rb").read()
        for k in range(600):
            data = bytearray(good)
            if k % 3 == 0:
                data = data[:rng.randrange(len(data))]
            else:
                for _ in range(rng.randrange(1, 4)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
            path = os.path.join(folder, "c" + name)
            open(path, "wb").write(bytes(data))
            try:
                load(path)
                outcome = "ok"
            except (ValueError, OSError, MemoryError, BufferError) as e:
                outcome = type(e).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(outcomes)
"""


def test_corrupted_files_give_errors_never_a_crash(tmp_path):
    """Truncations and random byte changes of a `.npy` and an `.npz` file: each load gives arrays
    or a typed error; the process never crashes or hangs (run in a child with a timeout)."""
    child = _child(_CORRUPT_CHILD, str(tmp_path), timeout=120)
    assert child.returncode == 0, f"rc={child.returncode}\n{child.stderr[-3000:]}"
    assert "ValueError" in child.stdout, child.stdout


_OPEN_CHILD = """
    import json, sys, dlbridge
    how, path = sys.argv[1], sys.argv[2]
    try:
        (dlbridge.load_npy if how == "npy" else dlbridge.load_npz)(path)
        print(json.dumps(None))
    except Exception as e:
        print(json.dumps([type(e).__name__, isinstance(e, OSError), str(e)]))
"""


@pytest.mark.parametrize("how", ["npy", "npz"])
@pytest.mark.parametrize("kind, says", [("fifo", "FIFO"), ("directory", "directory"),
                                        ("missing", "No such file")])
def test_a_path_that_is_not_a_regular_file_is_an_oserror_not_a_hang(tmp_path, how, kind, says):
    path = tmp_path / f"special.{how}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    child = _child(_OPEN_CHILD, how, str(path), timeout=30)
    assert child.returncode == 0, child.stderr[-3000:]
    error = json.loads(child.stdout.splitlines()[-1])
    assert error is not None and error[1], error
    assert str(path) in error[2] and says in error[2], error


def test_the_public_api(tmp_path):
    assert dlbridge.load_npy is dlbridge.npy.load_npy
    assert dlbridge.load_npz is dlbridge.npy.load_npz
    assert {"load_npy", "load_npz", "npy"} <= set(dlbridge.__all__)
    np.save(tmp_path / "a.npy", np.arange(3))
    assert tuple(dlbridge.load_npy(str(tmp_path / "a.npy")).shape) == (3,)
    with pytest.raises((ValueError, TypeError)):
        dlbridge.load_npy(tmp_path / "a.npy", "nowhere:0")


def test_the_module_s_examples_run_as_written():
    import doctest
    result = doctest.testmod(dlbridge.npy)
    assert result.attempted >= 4 and result.failed == 0, result


def test_the_other_loader_is_named_when_a_file_is_of_the_other_kind(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(3))
    np.savez(tmp_path / "a.npz", a=np.arange(3))
    with pytest.raises(ValueError, match="load_npz"):
        dlbridge.load_npy(tmp_path / "a.npz")
    with pytest.raises(ValueError, match="load_npy"):
        dlbridge.load_npz(tmp_path / "a.npy")
