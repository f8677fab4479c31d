"""Every script in examples/ runs to the end (exit 0) as a user would run it; the parts that need
a device they do not find say they were skipped."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import dlbridge

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = [
    "cpu_interop.py",
    "cuda_streams.py",
    "memory_pool.py",
    "kernels.py",
    "load_checkpoint.py",
    "ray_actors.py",
    "multiprocessing_shared.py",
]


def test_every_example_is_listed():
    # demo.py is the timed demo scripts/demo.sh runs; the others run here.
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(SCRIPTS + ["demo.py"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    name = script[: -len(".py")]
    if script == "ray_actors.py" and importlib.util.find_spec("ray") is None:
        assert out.startswith("ray_actors: skipped, Ray is not installed")
        return
    if dlbridge.cuda.is_available():
        assert f"{name}: ok" in out
    elif script == "cuda_streams.py":
        assert out.startswith("cuda_streams: skipped, no CUDA device: ")
    else:
        assert f"{name}: ok" in out
        if script in ("memory_pool.py", "kernels.py", "load_checkpoint.py", "ray_actors.py",
                      "multiprocessing_shared.py"):
            assert "skipped, no CUDA device" in out
