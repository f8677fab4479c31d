#!/usr/bin/env bash
# Runs every test: Rust unit, integration and doc tests with the platform's GPU backend (CUDA on
# Linux, Metal on macOS; its device tests run where a device exists, else they show as ignored);
# on Linux, the Apple-target type check of the Metal backend; the type stubs (mypy, stubtest); and
# the Python suite against NumPy, PyTorch, JAX, MLX and TVM-FFI, with the examples and the CLI.
DLBRIDGE_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

step "cargo fmt --check"
cargo fmt --all -- --check

step "import graph: the two Python-facing crates have no circle of more than 3 files"
python3 "$ROOT/scripts/import-graph.py" "$ROOT/crates/python-module" --max-circle 3
python3 "$ROOT/scripts/import-graph.py" "$ROOT/crates/dlbridge-pyo3" --max-circle 3

# The Rust tests that need a device are `#[ignore = "needs a ... device"]`: they are compiled
# everywhere the platform has their backend and run only where a device exists, so a machine
# without one lists them as ignored instead of counting them as passed.
#   DLBRIDGE_GPU_TESTS=1  run them (a missing device then fails them);  =0  never run them.
case "$(uname -s)" in
    Darwin) backend=metal ;;
    *) backend=cuda ;;
esac
gpu_tests="${DLBRIDGE_GPU_TESTS:-}"
if [ -z "$gpu_tests" ]; then
    gpu_tests=0
    if [ "$backend" = metal ]; then
        gpu_tests=1  # every Mac dlbridge supports has a Metal device
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        gpu_tests=1
    fi
fi
rust_args=()
if [ "$gpu_tests" = 1 ]; then
    # every_source_compiles and math's exhaustive are ignored for being slow, not for a device:
    # they stay out.
    rust_args=(--include-ignored --skip every_source_compiles --skip compute::math::tests::exhaustive)
fi
step "Rust tests (core crate with features $backend and test-backend: unit, integration, doc; ${backend} device tests $([ "$gpu_tests" = 1 ] && echo included || echo ignored))"
rust_log="$(mktemp)"
trap 'rm -f "$rust_log"' EXIT
cargo test -p dlbridge --features "$backend,test-backend" --quiet -- ${rust_args[@]+"${rust_args[@]}"} 2>&1 | tee "$rust_log"
rust_ignored="$(awk '/^test result:/ { for (i = 1; i < NF; i++) if ($(i + 1) ~ /^ignored/) n += $i } END { print n + 0 }' "$rust_log")"
rust_passed="$(awk '/^test result:/ { for (i = 1; i < NF; i++) if ($(i + 1) ~ /^passed/) n += $i } END { print n + 0 }' "$rust_log")"
if [ "$gpu_tests" = 1 ]; then
    echo "Rust tests: $rust_passed passed, $rust_ignored ignored ($backend device tests included)"
else
    echo "Rust tests: $rust_passed passed, $rust_ignored ignored: NOT RUN for lack of a $backend device" \
        "(or NVRTC, or slow) - set DLBRIDGE_GPU_TESTS=1 on a machine with one"
fi

step "cargo doc: the three crates' documentation builds without a warning (broken or private links)"
PYO3_PYTHON="$PY" RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps \
    -p dlbridge -p dlbridge-pyo3 -p dlbridge-python-module --features "dlbridge/$backend"

step "Rust tests of dlbridge-pyo3 (unit and doc tests against the venv's Python)"
PYO3_PYTHON="$PY" cargo test -p dlbridge-pyo3 --features ndarray --quiet
# Nothing later uses the debug build (the wheel is target/release): CI gives its 3-4 GB back.
[ -z "${CI:-}" ] || rm -rf "$ROOT/target/debug"

if [ "$backend" = cuda ]; then
    # Bounded runs of the DLPack importer, layout and exchange-table fuzz targets (the long runs
    # are in the closing notes; scripts/fuzz.sh says how to repeat them).
    step "Fuzzing: libFuzzer, ${DLBRIDGE_FUZZ_SECONDS:-20} s per target (scripts/fuzz.sh)"
    bash "$ROOT/scripts/fuzz.sh" "${DLBRIDGE_FUZZ_SECONDS:-20}"
    # CI builds once: give the disk back (the fuzz build is about 0.7 GB, the Apple check 1.1 GB).
    [ -z "${CI:-}" ] || rm -rf "$ROOT/fuzz/target"

    step "Apple-target check (aarch64-apple-darwin, Metal backend)"
    bash "$ROOT/scripts/apple-check.sh"
    # The Python bindings always ask for the Metal backend: check their Metal paths too.
    bash "$ROOT/scripts/apple-check.sh" -p dlbridge-python-module --all-targets
    [ -z "${CI:-}" ] || rm -rf "$ROOT/target/apple-check"
fi

step "python -m dlbridge info"
"$PY" -m dlbridge info

# The example extension on dlbridge-pyo3 (examples/pyo3-ext, its own crate), built into the venv
# for tests/python/test_pyo3_ext.py, with its own target directory (no whole-program LTO: quick;
# not for timing: bench/bench_pyo3.py wants a build without debug assertions).
step "examples/pyo3-ext: maturin build into the venv"
# Debug assertions on: the checks of preconditions in std and ndarray (a NULL pointer for a view,
# say) then fail the tests instead of passing by luck.
CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true "$PY" -m maturin build --release --quiet --interpreter "$PY" \
    --manifest-path "$ROOT/examples/pyo3-ext/Cargo.toml" \
    --target-dir "$ROOT/target/pyo3-ext" --out "$ROOT/target/pyo3-ext/dist"
"$PY" -m pip install --quiet --force-reinstall --no-deps "$ROOT"/target/pyo3-ext/dist/dlbridge_pyo3_ext-*.whl

step "Python tests"
py_log="$(mktemp)"
trap 'rm -f "$rust_log" "$py_log"' EXIT
"$PY" -m pytest tests/python -q 2>&1 | tee "$py_log"
py_skipped="$(tail -n 1 "$py_log" | grep -oE '[0-9]+ skipped' | grep -oE '[0-9]+' || echo 0)"
echo "Python tests: $py_skipped skipped (reasons above under 'short test summary': no CUDA or Metal" \
    "device, or a peer without the feature)"

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
