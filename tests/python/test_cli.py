"""`python -m dlbridge`: exit codes and what it prints, run as a user runs it (a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dlbridge


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlbridge", *args], capture_output=True, text=True, timeout=120
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
