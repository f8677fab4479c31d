#!/usr/bin/env bash
# Build the libFuzzer targets in fuzz/ and run each for a bounded time.
#
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
#   SECONDS  time per target (default 30)
#   TARGET   dlpack_import, layout, exchange_chain, safetensors_header, safetensors_index,
#            npy_header, shared_handle (default: all seven)
#
# Exits non-zero when a target crashes (a panic included), hangs past -timeout, runs out of
# memory, or leaks (with ASan); the input that did it is kept in fuzz/artifacts/<target>/.
# Prints executions and corpus size per target.
#
# The targets are built by plain `cargo build --release` with sanitizer-coverage flags (no
# cargo-fuzz, no nightly), so this runs on the stable toolchain CI uses. Each run starts from the
# committed seeds in fuzz/corpus/<target>/ and grows a working corpus in fuzz/runs/<target>/
# (git-ignored; delete it for a fresh start).
#
# Environment:
#   FUZZ_ASAN=1       build with AddressSanitizer (-Zsanitizer=address through RUSTC_BOOTSTRAP=1
#                     on stable rustc; leaks are then detected too); target dir fuzz/target/asan
#   FUZZ_RUNS=N       stop each target after N executions instead of after SECONDS
#   FUZZ_JOBS=N       cargo build jobs (default: cargo's)
#   FUZZ_ARGS="..."   extra libFuzzer flags
set -euo pipefail

SECONDS_PER_TARGET=${1:-30}
shift || true
TARGETS=("$@")
((${#TARGETS[@]})) || TARGETS=(dlpack_import layout exchange_chain safetensors_header safetensors_index npy_header shared_handle)

ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
FUZZ=$ROOT/fuzz
HOST=$(rustc -vV | sed -n 's/^host: //p')

# Coverage instrumentation as cargo-fuzz sets it up; `--cfg fuzzing` for libfuzzer-sys; debug
# assertions and overflow checks so that arithmetic bugs are crashes. `--target` keeps these flags
# away from build scripts and proc-macros (which would not link against libFuzzer).
FLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
FLAGS+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters"
FLAGS+=" -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares"
FLAGS+=" --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
TARGET_DIR=$FUZZ/target
LEAKS=0
if [[ ${FUZZ_ASAN:-0} == 1 ]]; then
  FLAGS="-Zsanitizer=address $FLAGS"
  TARGET_DIR=$FUZZ/target/asan
  LEAKS=1
  export RUSTC_BOOTSTRAP=1
fi

echo "fuzz: building ${TARGETS[*]} (${FUZZ_ASAN:+ASan, }target dir $TARGET_DIR)" >&2
build_start=$(date +%s)
bins=()
for t in "${TARGETS[@]}"; do bins+=(--bin "$t"); done
(cd "$FUZZ" && RUSTFLAGS="$FLAGS" CARGO_TARGET_DIR="$TARGET_DIR" \
  cargo build --release --locked --target "$HOST" ${FUZZ_JOBS:+-j "$FUZZ_JOBS"} "${bins[@]}")
echo "fuzz: build took $(($(date +%s) - build_start)) s" >&2

limit=(-max_total_time="$SECONDS_PER_TARGET")
[[ -n ${FUZZ_RUNS:-} ]] && limit=(-runs="$FUZZ_RUNS")

status=0
summary=()
for t in "${TARGETS[@]}"; do
  corpus=$FUZZ/runs/$t
  artifacts=$FUZZ/artifacts/$t
  mkdir -p "$corpus" "$artifacts"
  log=$FUZZ/runs/$t.log
  echo "fuzz: $t (${limit[*]})" >&2
  start=$(date +%s)
  rc=0
  # The committed seeds are read but never written: new inputs go to the working corpus.
  # shellcheck disable=SC2086
  "$TARGET_DIR/$HOST/release/$t" "${limit[@]}" -rss_limit_mb=2048 -timeout=10 \
    -detect_leaks="$LEAKS" -print_final_stats=1 -artifact_prefix="$artifacts/" \
    ${FUZZ_ARGS:-} "$corpus" "$FUZZ/corpus/$t" >"$log" 2>&1 || rc=$?
  elapsed=$(($(date +%s) - start))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
  files=$(find "$corpus" -type f | wc -l)
  if ((rc != 0)); then
    status=1
    echo "fuzz: $t FAILED (exit $rc); last lines of $log:" >&2
    tail -n 40 "$log" >&2
    summary+=("$t: FAILED after ${execs:-?} executions in ${elapsed} s (artifacts in $artifacts)")
  else
    summary+=("$t: ${execs:-?} executions in ${elapsed} s, corpus $files files")
  fi
done

printf 'fuzz: %s\n' "${summary[@]}"
exit "$status"
