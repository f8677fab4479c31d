#!/usr/bin/env bash
# Runs every test: Rust unit, integration and doc tests; the Apple-target type check of the Metal
# backend; and the Python suite against NumPy, PyTorch, JAX, MLX and TVM-FFI.
DLBRIDGE_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

step "cargo fmt --check"
cargo fmt --all -- --check

step "Rust tests (core crate: unit, integration, doc)"
cargo test -p dlbridge --quiet

step "Apple-target check (aarch64-apple-darwin, Metal backend)"
bash "$ROOT/scripts/apple-check.sh"
# The Python bindings always ask for the Metal backend: check their Metal paths too.
bash "$ROOT/scripts/apple-check.sh" -p dlbridge-py --all-targets

step "python -m dlbridge info"
"$PY" -m dlbridge info

step "Python tests"
"$PY" -m pytest tests/python -q

# The wheel is abi3 for CPython >= 3.9: load the same wheel into the oldest such interpreter and
# run the tests of its hand-written entry points and of compute (NumPy 2.0 is the newest NumPy for
# 3.9; the other files test peers' behaviour newer than that, or peers 3.9 no longer gets).
# (pyenv's shim answers `command -v` even where it cannot run 3.9, so each candidate is tried.)
PY39="${DLBRIDGE_PY39:-}"
if [ -z "$PY39" ]; then
    for candidate in "$HOME"/.pyenv/versions/3.9*/bin/python3.9 "$(command -v python3.9 || true)"; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 9)' 2>/dev/null; then
            PY39="$candidate"
            break
        fi
    done
fi
if [ -n "$PY39" ]; then
    step "Python 3.9 ($PY39): the same abi3 wheel"
    VENV39="$ROOT/.venv39"
    [ -x "$VENV39/bin/python" ] || "$PY39" -m venv "$VENV39"
    "$VENV39/bin/python" -m pip install --quiet --upgrade "numpy>=2" "pytest>=8" ml_dtypes
    "$VENV39/bin/python" -m pip install --quiet --force-reinstall --no-deps "$ROOT"/dist/dlbridge-*.whl
    "$VENV39/bin/python" -m dlbridge info
    "$VENV39/bin/python" -m pytest tests/python/test_entry_points.py tests/python/test_compute.py -q
else
    step "Python 3.9: not run, no python3.9 on this machine (set DLBRIDGE_PY39 to one)"
fi
