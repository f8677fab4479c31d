"""The README's examples run as written: the first screen's, and the CPU ones of the doors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def run(source: str, extra: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", source + extra], capture_output=True, text=True,
                          timeout=300, cwd=str(README.parent))


def test_the_first_example_shares_one_buffer_in_three_libraries():
    first = python_blocks()[0]
    result = run(first, "\nassert host[0, 1] == -1.0 and a.data_ptr == host.ctypes.data\n")
    assert result.returncode == 0, result.stdout + result.stderr
