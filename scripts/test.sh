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
