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


def test_no_line_is_over_100_characters_outside_tables():
    long = [(n, len(line)) for n, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > 100 and not line.startswith("|")]
    assert long == [], f"README lines over 100 characters (line, length): {long}"


def test_the_numpy_files_example_runs_on_the_cpu(tmp_path):
    """The NumPy files example with its device arguments dropped (CI has no GPU), in a scratch
    folder."""
    text = README.read_text()
    start = text.index("### Loading NumPy files")
    block = re.search(r"```python\n(.*?)```", text[start:], flags=re.S).group(1)
    block = block.replace(', "cuda:0")', ")").replace(', "cuda")', ")")
    result = subprocess.run([sys.executable, "-c", block + "\nassert sorted(arrays) == ['a', 'b']"
                             "\nassert w.shape == (2, 3) and float(w_gpu[1, 2]) == 5.0\n"],
                            capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
