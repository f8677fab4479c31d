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


def test_the_processes_example_sees_the_childs_write(tmp_path):
    """The door's example, as a script (spawn needs a file to import the worker from)."""
    text = README.read_text()
    start = text.index("## Across processes")
    block = re.search(r"```python\n(.*?)```", text[start:], flags=re.S).group(1)
    script = tmp_path / "processes_example.py"
    script.write_text(block)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
