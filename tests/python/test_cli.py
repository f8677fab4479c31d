"""`python -m dlbridge`: exit codes and what it prints, run as a user runs it (a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import dlbridge


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    # A command that hangs (it used to, on a FIFO) fails the test after the timeout.
    return subprocess.run(
        [sys.executable, "-m", "dlbridge", *args], capture_output=True, text=True, timeout=60
    )


def test_version():
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"dlbridge {dlbridge.__version__}"


def test_help():
    for flag in ("--help", "-h"):
        result = _cli(flag)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: python -m dlbridge")
        assert "info" in result.stdout and "--version" in result.stdout


def test_unknown_command_is_a_usage_error():
    result = _cli("frobnicate")
    assert result.returncode == 2
    assert "usage: python -m dlbridge" in result.stderr
    assert "frobnicate" in result.stderr


def test_info_says_what_is_compiled_in_and_found():
    for args in (("info",), ()):
        result = _cli(*args)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        build = dlbridge.build_info()
        assert lines[0].startswith(f"dlbridge {dlbridge.__version__} (DLPack 1.")
        assert lines[1] == f"backends compiled in: {', '.join(build['backends'])}"
        assert lines[2] == f"devices found: {', '.join(build['devices'])}"


def test_info_says_why_a_compiled_in_backend_has_no_device():
    out = _cli("info").stdout
    assert "cuda" in dlbridge.build_info()["backends"], "every wheel carries the CUDA backend"
    if dlbridge.cuda.is_available():
        major, minor = dlbridge.cuda.driver_version()
        assert f"  CUDA: driver for CUDA {major}.{minor}, " in out
        assert f"  cuda:0: {dlbridge.cuda.device_name(0)} (" in out
    else:
        reason = dlbridge.cuda.unavailable_reason()
        assert reason
        # The reason itself, without the "CUDA backend not available: " lead of the exception.
        line = next(line for line in out.splitlines() if line.startswith("  CUDA: "))
        assert line.startswith("  CUDA: compiled in; no device: ")
        assert line.split("no device: ", 1)[1] in reason
        assert "not available: " not in line
        assert ("libcuda" in line) or ("found no devices" in line) or ("failed" in line), line
    if "metal" in dlbridge.build_info()["backends"]:
        if not dlbridge.metal.is_available():
            assert "  Metal: compiled in; no device: " in out
    else:
        assert "  Metal: not compiled in" in out


def test_cuda_unavailable_reason_and_driver_version_agree():
    reason = dlbridge.cuda.unavailable_reason()
    assert (reason == "") == dlbridge.cuda.is_available()
    if "libcuda" in reason:
        with pytest.raises(RuntimeError, match="libcuda"):
            dlbridge.cuda.driver_version()
    elif not reason or "found no devices" in reason:
        major, minor = dlbridge.cuda.driver_version()
        assert major >= 11 and minor >= 0


def test_every_command_has_its_own_help():
    for command, says in (("info", "devices found"), ("inspect", "FILE"), ("load", "--device")):
        result = _cli(command, "--help")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: python -m dlbridge {command}"), result.stdout
        assert says in result.stdout
    top = _cli("--help").stdout
    assert all(command in top for command in ("info", "inspect", "load"))


@pytest.mark.parametrize("args", [
    ("inspect",), ("load",), ("info", "extra"), ("load", "f.safetensors", "--threads", "0"),
    ("load", "f.safetensors", "--threads", "many"), ("load", "f.safetensors", "--direct-io", "maybe"),
    ("inspect", "f.safetensors", "--device", "cpu"), ("frobnicate",),
])
def test_usage_errors_exit_with_2_and_no_traceback(args):
    result = _cli(*args)
    assert result.returncode == 2, (args, result.stderr)
    assert "usage: python -m dlbridge" in result.stderr and "Traceback" not in result.stderr


def _bad_inputs(tmp_path):
    """Inputs each command must turn into one line on stderr: name → (path, what the line says)."""
    np = pytest.importorskip("numpy")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a checkpoint at all, only words")
    hole = tmp_path / "hole.safetensors"
    header = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    hole.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"w": "../outside.safetensors"}}')
    good = tmp_path / "good.safetensors"
    dlbridge.save_file({"w": np.zeros(2, np.float32)}, good)
    return {
        "garbage": ([str(garbage)], "not a safetensors file"),
        "hole": ([str(hole)], "no gaps"),
        "missing": ([str(tmp_path / "missing.safetensors")], "No such file"),
        "fifo": ([str(fifo)], "is a FIFO (named pipe), not a regular file"),
        "folder": ([str(folder)], "is a directory"),
        "index": ([str(index)], "not a path inside the index's folder"),
        "duplicate": ([str(good), str(good)], "a name may be in one shard only"),
        "device": ([str(good), "--device", "tpu:0"], "tpu"),
    }


@pytest.mark.parametrize("command", ["inspect", "load"])
def test_every_error_of_a_command_is_one_line_and_exit_1(tmp_path, command):
    """`python -m dlbridge inspect bad.safetensors` printed a traceback; every failure is now one
    line `dlbridge: <message>` with exit status 1 (a FIFO among them: refused, not waited on)."""
    for name, (args, says) in _bad_inputs(tmp_path).items():
        if name == "device" and command == "inspect":
            continue
        result = _cli(command, *args)
        assert result.returncode == 1, (name, result.returncode, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dlbridge: "), (name, result.stderr)
        assert says in lines[0], (name, lines[0])
        assert result.stdout == "", (name, result.stdout)


def test_inspect_says_what_a_good_file_holds_and_none_for_no_metadata(tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "g.safetensors"
    dlbridge.save_file({"w": np.zeros((2, 3), np.float32)}, path)
    result = _cli("inspect", str(path))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "metadata" not in result.stdout and "1 tensors, 24 B (24 bytes)" in result.stdout
    dlbridge.save_file({"w": np.zeros((2, 3), np.float32)}, path, metadata={"format": "np"})
    assert "metadata: format=np" in _cli("inspect", str(path)).stdout
