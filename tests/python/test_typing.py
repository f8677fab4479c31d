"""The type stubs: mypy --strict on a typed user script and on calls it must reject, stubtest of the
stubs against the built module, and `dlbridge.bool` kept out of `from dlbridge import *`.

mypy reads the stubs of this checkout (MYPYPATH=python); stubtest compares them with the module
installed in this environment (scripts/test.sh builds it from the same checkout).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dlbridge

ROOT = Path(__file__).resolve().parents[2]
TYPING = ROOT / "tests" / "typing"


def _mypy_env() -> dict[str, str]:
    env = dict(os.environ)
    env["MYPYPATH"] = str(ROOT / "python")
    return env


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy", reason="mypy is not installed (scripts/env.sh TEST_PACKAGES has it)")
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_mypy_env(), capture_output=True, text=True,
        timeout=600,
    )


def test_star_import_keeps_the_builtin_bool():
    namespace: dict = {}
    exec("from dlbridge import *\nresult = bool(0)", namespace)
    assert namespace["result"] is False
    assert "bool" not in namespace, "from dlbridge import * must not shadow the built-in bool"
    assert "bool" not in dlbridge.__all__
    assert isinstance(dlbridge.bool, dlbridge.DType) and dlbridge.bool == "bool"
    assert "float32" in dlbridge.__all__ and "from_dlpack" in dlbridge.__all__


def test_public_names_exist():
    missing = [name for name in dlbridge.__all__ if not hasattr(dlbridge, name)]
    assert missing == []


def test_user_script_passes_and_rejected_calls_fail_under_mypy_strict(tmp_path):
    # rejected.py marks each line mypy must refuse with `# type: ignore[code]`. Checked as it is,
    # --strict reports any of those comments that is unused; checked without them, each line must
    # give exactly the error code its comment names (so the refusal is for the expected reason).
    rejected = (TYPING / "rejected.py").read_text()
    expected: dict[int, set[str]] = {}
    stripped = []
    for number, line in enumerate(rejected.splitlines(), start=1):
        m = re.search(r"\s*# type: ignore\[([a-z-]+)\]$", line)
        if m:
            expected[number] = {m.group(1)}
            line = line[: m.start()]
        stripped.append(line)
    assert len(expected) >= 10
    bare = tmp_path / "rejected_bare.py"
    bare.write_text("\n".join(stripped) + "\n")

    as_is = _run("-m", "mypy", "--strict", "--no-color-output",
                 str(TYPING / "user_script.py"), str(TYPING / "rejected.py"))
    assert as_is.returncode == 0, as_is.stdout + as_is.stderr

    without = _run("-m", "mypy", "--strict", "--no-color-output", "--show-error-codes", str(bare))
    found: dict[int, set[str]] = {}
    for m in re.finditer(r"^.*rejected_bare\.py:(\d+): error: .*\[([a-z-]+)\]$", without.stdout, re.M):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    assert found == expected, without.stdout
    # The error the issue reported: a string where copy takes a bool or None.
    assert 'Argument "copy" to "from_dlpack" has incompatible type "str"; expected "bool | None"' \
        in without.stdout


def test_stubs_match_the_built_module():
    result = _run(
        "-m", "mypy.stubtest", "dlbridge",
        "--mypy-config-file", str(ROOT / "pyproject.toml"),
        "--allowlist", str(TYPING / "stubtest-allowlist.txt"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
