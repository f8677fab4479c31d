# Sourced by demo.sh and test.sh: a virtual environment with dlbridge built from this checkout.
#
#   DLBRIDGE_VENV    where the environment lives (default: .venv in the repository)
#   DLBRIDGE_EXTRAS  "test" to install the peer libraries the tests use (default: demo set)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DLBRIDGE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

step() { printf '\n==> %s\n' "$*"; }

if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "dlbridge needs a Rust toolchain (https://rustup.rs): cargo was not found" >&2
        exit 1
    fi
fi

# On CI (a fresh clone, built once, on a machine whose free disk varies): keep no caches that
# only a second build would use. pip's wheel cache would hold a second copy of PyTorch and its
# CUDA libraries (about 4 GB), cargo's incremental state about 1 GB, full debug info about 1.5 GB.
if [ -n "${CI:-}" ]; then
    export PIP_NO_CACHE_DIR=1 CARGO_INCREMENTAL=0
    export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
    export CARGO_PROFILE_TEST_DEBUG="${CARGO_PROFILE_TEST_DEBUG:-line-tables-only}"
fi

if [ ! -x "$PY" ]; then
    step "creating the virtual environment in $VENV"
    python3 -m venv "$VENV"
fi

# The peers dlbridge is tested against. Versions are floors: a fresh machine gets the newest.
DEMO_PACKAGES=(pip "maturin>=1.9,<2" "numpy>=2" "torch>=2.5")
TEST_PACKAGES=("ray>=2.60" "pytest>=8" "mypy>=1.11" "ml_dtypes>=0.4" "safetensors>=0.4" "tqdm>=4" "types-tqdm" "jax[cpu]>=0.4.30" "mlx[cpu]>=0.29" "apache-tvm-ffi>=0.1.10")

packages=("${DEMO_PACKAGES[@]}")
if [ "${DLBRIDGE_EXTRAS:-}" = "test" ]; then
    packages+=("${TEST_PACKAGES[@]}")
fi
stamp="$VENV/.dlbridge-packages"
if [ "$(cat "$stamp" 2>/dev/null)" != "${packages[*]}" ]; then
    step "installing ${packages[*]}"
    "$PY" -m pip install --quiet --upgrade "${packages[@]}"
    printf '%s' "${packages[*]}" > "$stamp"
fi

step "building the dlbridge wheel (abi3, release: about 3 minutes on 2 cores the first time; cargo prints its progress)"
rm -rf "$ROOT/dist"
(cd "$ROOT" && "$VENV/bin/maturin" build --release --interpreter "$PY" --out dist \
    ${DLBRIDGE_FEATURES:+--features "$DLBRIDGE_FEATURES"})
"$PY" -m pip install --quiet --force-reinstall --no-deps "$ROOT"/dist/dlbridge-*.whl
