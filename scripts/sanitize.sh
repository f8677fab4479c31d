#!/usr/bin/env bash
# Run the core crate's tests under sanitizers.
#
# Usage: scripts/sanitize.sh [asan|tsan|tsan-share|all]   (default: all)
#
#   asan  `cargo test -p dlbridge --lib --tests` under AddressSanitizer (leak detection on), in
#         target/asan. Stable rustc with RUSTC_BOOTSTRAP=1 is enough: ASan does not need an
#         instrumented std. Doctests are not run (rustdoc would need the same flags and gains
#         little here).
#   tsan  the pool and stream tests (`--test pool` and the pool unit tests) under
#         ThreadSanitizer, in target/tsan.
#   tsan-share
#         the CPU share suites (`--test share`: its cross-process tests run this binary, TSan
#         and all, as the other process; and the `share::` unit tests: the descriptor lender, its
#         book and clients) under ThreadSanitizer, in target/tsan.
#         TSan needs the standard library instrumented too
#         (otherwise std's own synchronisation is invisible to it and it reports false races), so
#         std is rebuilt from source with -Zbuild-std. That needs a rust-src matching the
#         compiler and the compiler's TSan runtime (librustc-<channel>_rt.tsan.a):
#           1. DLBRIDGE_TSAN_RUSTC=/path/to/rustc, if set;
#           2. the rustup toolchain named by DLBRIDGE_TSAN_TOOLCHAIN (default nightly), if it has
#              the rust-src component;
#           3. Debian's rustc-web + rust-web-src as unpacked by scripts/apple-check.sh (its cache,
#              DLBRIDGE_APPLE_TOOLCHAIN, default ~/.cache/dlbridge/apple-toolchain; run that script
#              once to create it). Debian ships no sanitizer runtimes, so a private overlay sysroot
#              is made in target/tsan/sysroot: links to that toolchain's files plus a copy of a
#              rustup toolchain's TSan runtime (same LLVM major), renamed to the name that rustc
#              looks for, and a `rustc` wrapper passing --sysroot. The shared cache is only read.
#         When none is available the script says so and exits 2 (nothing was tested).
#
# Environment: CARGO (default cargo), SANITIZE_JOBS (cargo -j).
set -euo pipefail

MODE=${1:-all}
ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd -- "$ROOT"
CARGO_BIN=${CARGO:-cargo}
HOST=$(rustc -vV | sed -n 's/^host: //p')
JOBS=(${SANITIZE_JOBS:+-j "$SANITIZE_JOBS"})

log() { printf 'sanitize: %s\n' "$*" >&2; }

run_asan() {
  log "AddressSanitizer: cargo test -p dlbridge --lib --tests (target/asan)"
  # Leaks made on purpose: tests/pool.rs leaks a pool (`Box::leak`) to get a `&'static` one.
  local supp
  supp=$(mktemp)
  # shellcheck disable=SC2064
  trap "rm -f -- '$supp'" RETURN
  printf '%s\n' 'leak:a_static_pool_hands_out_blocks_without_counting_references' >"$supp"
  # `--target` keeps the flags off build scripts and proc-macros; the std linked is not
  # instrumented, which ASan tolerates (it misses only bugs inside std itself).
  RUSTC_BOOTSTRAP=1 \
    RUSTFLAGS="-Zsanitizer=address -Cdebug-assertions" \
    ASAN_OPTIONS="detect_leaks=1:${ASAN_OPTIONS:-}" \
    LSAN_OPTIONS="suppressions=$supp:print_suppressions=0:${LSAN_OPTIONS:-}" \
    CARGO_TARGET_DIR="$ROOT/target/asan" \
    "$CARGO_BIN" test -p dlbridge --lib --tests --target "$HOST" "${JOBS[@]}"
}

# Prints the rustc to use for TSan (with a rust-src matching it), or nothing.
tsan_rustc() {
  if [[ -n ${DLBRIDGE_TSAN_RUSTC:-} ]]; then
    printf '%s\n' "$DLBRIDGE_TSAN_RUSTC"
    return
  fi
  local tc=${DLBRIDGE_TSAN_TOOLCHAIN:-nightly} rustc sysroot
  if rustc=$(rustup which --toolchain "$tc" rustc 2>/dev/null); then
    sysroot=$("$rustc" --print sysroot)
    if [[ -f $sysroot/lib/rustlib/src/rust/library/std/Cargo.toml ]]; then
      printf '%s\n' "$rustc"
      return
    fi
  fi
  debian_tsan_rustc
}

# Builds (idempotently) target/tsan/sysroot around Debian's rustc-web (see the usage notes) and
# prints its rustc wrapper, or prints nothing (with a note on stderr) when a piece is missing.
debian_tsan_rustc() {
  local tc=${DLBRIDGE_APPLE_TOOLCHAIN:-${HOME:-/nonexistent}/.cache/dlbridge/apple-toolchain}/usr
  local libdir=$tc/lib/x86_64-linux-gnu
  [[ -x $tc/bin/rustc && -f $tc/lib/rustlib/src/rust/library/std/Cargo.toml ]] || return 0
  local vv release llvm channel want
  vv=$(LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$tc/bin/rustc" -vV 2>/dev/null) || return 0
  release=$(sed -n 's/^release: //p' <<<"$vv")
  llvm=$(sed -n 's/^LLVM version: \([0-9]*\).*/\1/p' <<<"$vv")
  case $release in *-nightly*) channel=nightly ;; *-beta*) channel=beta ;; *) channel=stable ;; esac
  want=librustc-${channel}_rt.tsan.a
  [[ -f $tc/lib/rustlib/$HOST/lib/$want ]] && { printf '%s\n' "$tc/bin/rustc"; return; }

  # A TSan runtime from a rustup toolchain with the same LLVM major version.
  local rt='' t trustc tv f
  for t in stable nightly $(rustup toolchain list 2>/dev/null | cut -d' ' -f1); do
    trustc=$(rustup which --toolchain "$t" rustc 2>/dev/null) || continue
    tv=$("$trustc" -vV 2>/dev/null | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
    [[ $tv == "$llvm" ]] || continue
    for f in "$("$trustc" --print sysroot)/lib/rustlib/$HOST/lib/"librustc-*_rt.tsan.a; do
      [[ -f $f ]] && { rt=$f; break 2; }
    done
  done
  if [[ -z $rt ]]; then
    log "Debian rustc $release (LLVM $llvm) found, but no rustup toolchain with LLVM $llvm has a TSan runtime"
    return 0
  fi

  local sr=$ROOT/target/tsan/sysroot lib
  lib=$sr/lib/rustlib/$HOST/lib
  rm -rf -- "$sr"
  mkdir -p -- "$lib" "$sr/lib/rustlib/src" "$sr/bin"
  ln -s -- "$tc/lib/rustlib/$HOST/lib/"* "$lib/"
  ln -s -- "$(readlink -f -- "$tc/lib/rustlib/src/rust")" "$sr/lib/rustlib/src/rust"
  [[ -e $tc/lib/rustlib/etc ]] && ln -s -- "$tc/lib/rustlib/etc" "$sr/lib/rustlib/etc"
  cp -- "$rt" "$lib/$want"
  {
    printf '#!/bin/sh\n# Debian rustc-web with the overlay sysroot made by scripts/sanitize.sh\n'
    printf 'LD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %q --sysroot %q "$@"\n' \
      "$libdir" "$tc/bin/rustc" "$sr"
  } >"$sr/bin/rustc"
  chmod +x "$sr/bin/rustc"
  log "overlay sysroot for Debian rustc $release in $sr (TSan runtime: $rt)"
  printf '%s\n' "$sr/bin/rustc"
}

# Runs `--test $1` and the unit tests matching `$2` under ThreadSanitizer.
run_tsan() {
  local suite=$1 filter=$2 rustc
  rustc=$(tsan_rustc)
  if [[ -z $rustc ]]; then
    log "ThreadSanitizer: NOT RUN: no rustc with a matching rust-src for -Zbuild-std (tried" \
      "DLBRIDGE_TSAN_RUSTC, the rustup toolchain '${DLBRIDGE_TSAN_TOOLCHAIN:-nightly}' and the" \
      "Debian rustc-web cache of scripts/apple-check.sh); install one with" \
      "'rustup component add rust-src --toolchain nightly' or run scripts/apple-check.sh once"
    return 2
  fi
  log "ThreadSanitizer with $("$rustc" -V): --test $suite and the unit tests matching '$filter' (target/tsan)"
  local common=(-p dlbridge --target "$HOST" -Zbuild-std "${JOBS[@]}")
  local env=(RUSTC="$rustc" RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="$ROOT/target/tsan"
    RUSTFLAGS="-Zsanitizer=thread -Cdebug-assertions"
    TSAN_OPTIONS="halt_on_error=1:${TSAN_OPTIONS:-}" RUST_TEST_THREADS=4)
  env "${env[@]}" "$CARGO_BIN" test "${common[@]}" --test "$suite"
  env "${env[@]}" "$CARGO_BIN" test "${common[@]}" --lib -- "$filter"
}

status=0
case $MODE in
  asan) run_asan || status=$? ;;
  tsan) run_tsan pool pool || status=$? ;;
  tsan-share) run_tsan share share:: || status=$? ;;
  all)
    run_asan || status=$?
    run_tsan pool pool || { rc=$?; ((status)) || status=$rc; }
    run_tsan share share:: || { rc=$?; ((status)) || status=$rc; }
    ;;
  *) log "unknown mode '$MODE' (asan, tsan, tsan-share or all)"; exit 64 ;;
esac
((status == 0)) && log "OK ($MODE)"
exit "$status"
