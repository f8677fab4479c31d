#!/usr/bin/env bash
# Type-check a cargo package for aarch64-apple-darwin on a Linux x86-64 host.
#
# Usage (from anywhere inside the repo):
#   scripts/apple-check.sh [extra `cargo check` args...]
#   scripts/apple-check.sh                       # = -p dlbridge --all-targets --features metal
#   scripts/apple-check.sh -p dlbridge --features metal --tests
#   scripts/apple-check.sh --manifest-path /some/crate/Cargo.toml --all-targets
#
# How: rustup's stable channel cannot fetch rust-std for Apple targets here (no
# network beyond package registries), so we borrow Debian's `rustc-web`
# (rustc + LLVM with the AArch64 backend) and `rust-web-src` (library source),
# unpack them with `dpkg -x` into a private cache (never installed system-wide),
# and let the host `cargo` drive that rustc with `-Zbuild-std`, which compiles
# core/alloc/std for the Apple target from source (metadata only: `check`).
# Nothing is linked, so no Apple SDK or linker is needed.
#
# Environment:
#   DLBRIDGE_APPLE_TOOLCHAIN   cache dir   (default: $HOME/.cache/dlbridge/apple-toolchain)
#   DLBRIDGE_APPLE_REFRESH=1   re-download the toolchain even if the cache is valid
#   DLBRIDGE_APPLE_MIN_RUST    minimum Debian rustc version accepted (default: 1.95)
#   DLBRIDGE_APPLE_TARGET      target triple (default: aarch64-apple-darwin)
#   APPLE_CHECK_TARGET_DIR     cargo target dir (default: <workspace>/target/apple-check,
#                              or $CARGO_TARGET_DIR/apple-check when that is set)
#   CARGO                      cargo binary to use (default: cargo from PATH)
set -euo pipefail

log() { printf 'apple-check: %s\n' "$*" >&2; }
die() { printf 'apple-check: error: %s\n' "$*" >&2; exit 1; }

TOOLCHAIN_DIR=${DLBRIDGE_APPLE_TOOLCHAIN:-${HOME:?HOME is not set}/.cache/dlbridge/apple-toolchain}
MIN_RUST=${DLBRIDGE_APPLE_MIN_RUST:-1.95}
TARGET=${DLBRIDGE_APPLE_TARGET:-aarch64-apple-darwin}
CARGO_BIN=${CARGO:-cargo}
STAMP_NAME=.apple-toolchain.stamp
STAMP_FORMAT=1
MULTIARCH=x86_64-linux-gnu

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd -- "$SCRIPT_DIR/.." && pwd)

# ----------------------------------------------------------------- preflight
[[ $(uname -s) == Linux ]] || die "this script is for Linux hosts (on macOS just run: cargo check)"
case $(uname -m) in
  x86_64 | amd64) ;;
  *) die "unsupported host architecture $(uname -m); only x86_64 Debian packages are wired up" ;;
esac
command -v "$CARGO_BIN" >/dev/null 2>&1 || die "cargo not found (install rustup stable)"

# version_ge A B: true when dotted version A >= B (numeric compare of the leading X.Y[.Z]).
version_ge() {
  local a b
  a=$(printf '%s' "${1#*:}" | grep -oE '^[0-9]+(\.[0-9]+)*' || true)
  b=$(printf '%s' "${2#*:}" | grep -oE '^[0-9]+(\.[0-9]+)*' || true)
  [[ -n $a && -n $b ]] || return 1
  [[ $(printf '%s\n%s\n' "$b" "$a" | sort -V | head -n1) == "$b" ]]
}

# ------------------------------------------------------- toolchain (cached)
tc_rustc() {
  LD_LIBRARY_PATH="$1/usr/lib/$MULTIARCH:$1/lib/$MULTIARCH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$1/usr/bin/rustc" "${@:2}"
}

# Is the toolchain at $1 complete, runnable and new enough?
toolchain_ok() {
  local dir=$1 ver
  [[ -f $dir/$STAMP_NAME && -x $dir/usr/bin/rustc ]] || return 1
  grep -qx "stamp-format=$STAMP_FORMAT" "$dir/$STAMP_NAME" || return 1
  [[ -f $dir/usr/lib/rustlib/src/rust/library/std/Cargo.toml ]] || return 1
  ver=$(tc_rustc "$dir" -vV 2>/dev/null | sed -n 's/^release: //p') || return 1
  [[ -n $ver ]] && version_ge "$ver" "$MIN_RUST"
}

APT_UPDATED=0
apt_update() {
  ((APT_UPDATED)) && return 0
  [[ $(id -u) == 0 ]] || die "apt package lists lack a suitable rustc-web; run 'sudo apt-get update' (or this script as root)"
  log "running apt-get update"
  apt-get update -qq >&2 || die "apt-get update failed"
  APT_UPDATED=1
}

# Candidate version of a package, empty if unknown to apt.
apt_candidate() {
  apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p' | grep -v '^(none)$' || true
}

# Real (non-virtual) package names from Depends/Pre-Depends of pkg=version;
# alternatives take the first choice, version constraints and :any are stripped.
apt_deps() {
  apt-cache show --no-all-versions "$1" 2>/dev/null |
    sed -n 's/^\(Pre-\)\{0,1\}Depends: //p' | tr ',' '\n' |
    sed -e 's/|.*//' -e 's/(.*)//' -e 's/:any//' -e 's/[[:space:]]//g' | grep -v '^$' || true
}

pkg_installed() {
  local s
  s=$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)
  [[ $s == installed ]]
}

# Resolve the package set into the global array PKGS ("name=version" entries).
resolve_packages() {
  local rust_ver
  command -v apt-cache >/dev/null 2>&1 || die "apt-cache not found; this script needs a Debian/Ubuntu host"
  rust_ver=$(apt_candidate rustc-web)
  if [[ -z $rust_ver ]] || ! version_ge "$rust_ver" "$MIN_RUST"; then
    log "apt cache has rustc-web '${rust_ver:-none}' (need >= $MIN_RUST)"
    apt_update
    rust_ver=$(apt_candidate rustc-web)
  fi
  [[ -n $rust_ver ]] || die "package rustc-web not found in apt sources (needs Debian bookworm-security or newer: it ships rustc-web/rust-web-src)"
  version_ge "$rust_ver" "$MIN_RUST" ||
    die "rustc-web $rust_ver is older than $MIN_RUST (set DLBRIDGE_APPLE_MIN_RUST to accept it)"

  local std_dev_deps std_pkg llvm_pkg
  apt_deps "rustc-web=$rust_ver" | grep -x libstd-rust-web-dev >/dev/null ||
    die "unexpected rustc-web $rust_ver layout: it does not depend on libstd-rust-web-dev"
  std_dev_deps=$(apt_deps "libstd-rust-web-dev=$rust_ver")
  std_pkg=$(grep -E '^libstd-rust-web-[0-9]' <<<"$std_dev_deps" | head -n1 || true)
  [[ -n $std_pkg ]] || die "cannot find the libstd-rust-web-<ver> dependency of libstd-rust-web-dev $rust_ver"
  llvm_pkg=$( { apt_deps "$std_pkg=$rust_ver"; apt_deps "rustc-web=$rust_ver"; } |
    grep -E '^libllvm[0-9]+(\.[0-9]+)?$' | head -n1 || true)
  [[ -n $llvm_pkg ]] || die "cannot find the libllvmN dependency of $std_pkg $rust_ver"
  local llvm_ver
  llvm_ver=$(apt_candidate "$llvm_pkg")
  [[ -n $llvm_ver ]] || die "$llvm_pkg (needed by $std_pkg) has no installable version in apt sources"
  local src_ver
  src_ver=$(apt_candidate rust-web-src)
  [[ $src_ver == "$rust_ver" ]] || die "rust-web-src version '${src_ver:-none}' does not match rustc-web $rust_ver"

  PKGS=("rustc-web=$rust_ver" "rust-web-src=$rust_ver" "libstd-rust-web-dev=$rust_ver"
        "$std_pkg=$rust_ver" "$llvm_pkg=$llvm_ver")

  # Shared libraries that libLLVM / librustc_driver need but the host lacks
  # (a minimal Debian image may miss e.g. libz3-4, libxml2, libedit2): fetch
  # and unpack them too, following Depends transitively.
  local -A seen=()
  local queue=("$std_pkg=$rust_ver" "$llvm_pkg=$llvm_ver") item dep dver
  while ((${#queue[@]})); do
    item=${queue[0]}; queue=("${queue[@]:1}")
    while read -r dep; do
      [[ -z $dep || -n ${seen[$dep]:-} ]] && continue
      seen[$dep]=1
      case $dep in rustc-web | rust-web-src | libstd-rust-web-* | "$llvm_pkg") continue ;; esac
      pkg_installed "$dep" && continue
      dver=$(apt_candidate "$dep")
      if [[ -z $dver ]]; then
        log "warning: dependency $dep is neither installed nor downloadable (virtual?); skipping"
        continue
      fi
      PKGS+=("$dep=$dver"); queue+=("$dep=$dver")
    done < <(apt_deps "$item")
  done
}

fetch_toolchain() {
  resolve_packages
  log "fetching toolchain: ${PKGS[*]}"
  local parent tmp
  parent=$(dirname -- "$TOOLCHAIN_DIR")
  mkdir -p -- "$parent"
  tmp=$(mktemp -d "$parent/.apple-toolchain.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf -- '$tmp'" EXIT
  mkdir -p "$tmp/debs" "$tmp/root"

  local apt_opts=(-q)
  # As root apt drops to user _apt, which cannot write into our private dir.
  [[ $(id -u) == 0 ]] && apt_opts+=(-o APT::Sandbox::User=root)
  if ! (cd "$tmp/debs" && apt-get "${apt_opts[@]}" download "${PKGS[@]}" >&2); then
    if ((APT_UPDATED == 0)) && [[ $(id -u) == 0 ]]; then
      log "download failed; package lists may be stale"
      apt_update
      resolve_packages
      (cd "$tmp/debs" && apt-get "${apt_opts[@]}" download "${PKGS[@]}" >&2) || die "apt-get download failed"
    else
      die "apt-get download failed for: ${PKGS[*]}"
    fi
  fi

  local deb
  for deb in "$tmp"/debs/*.deb; do
    dpkg -x "$deb" "$tmp/root" || die "dpkg -x failed on $(basename -- "$deb")"
  done
  local root=$tmp/root

  # Drop what a `check` never reads (~400 MB): compiler sources, tools, docs.
  rm -rf "$root"/usr/src/rustc-*/src "$root"/usr/src/rustc-*/compiler "$root"/usr/share/doc "$root"/usr/share/man

  # build-std looks for <sysroot>/lib/rustlib/src/rust/library. Debian ships the
  # link rust -> ../../../src/rustc-<ver>; recreate it if a layout change lost it.
  local lib=$root/usr/lib/rustlib/src/rust/library
  if [[ ! -f $lib/std/Cargo.toml ]]; then
    local srcdir
    srcdir=$(find "$root/usr/src" -maxdepth 1 -type d -name 'rustc-*' | head -n1)
    [[ -n $srcdir && -f $srcdir/library/std/Cargo.toml ]] || die "rust-web-src did not provide library/std sources"
    mkdir -p "$root/usr/lib/rustlib/src"
    rm -rf "$root/usr/lib/rustlib/src/rust"
    ln -s "../../../src/$(basename -- "$srcdir")" "$root/usr/lib/rustlib/src/rust"
  fi

  local vv
  vv=$(tc_rustc "$root" -vV 2>&1) || die "unpacked rustc does not run:"$'\n'"$vv"$'\n'"(missing shared libraries? check: ldd $root/usr/bin/rustc)"
  tc_rustc "$root" --print target-list | grep -x -- "$TARGET" >/dev/null || die "Debian rustc does not know target $TARGET"

  {
    echo "stamp-format=$STAMP_FORMAT"
    printf '%s\n' "${PKGS[@]}"
    sed -n 's/^release: /rustc-release=/p; s/^LLVM version: /llvm=/p' <<<"$vv"
  } >"$root/$STAMP_NAME"

  # Atomically-ish replace the cache (the tmp dir is a sibling, same filesystem).
  rm -rf -- "$TOOLCHAIN_DIR"
  mv -- "$root" "$TOOLCHAIN_DIR"
  rm -rf -- "$tmp"
  trap - EXIT
  log "toolchain cached in $TOOLCHAIN_DIR"
}

ensure_toolchain() {
  mkdir -p -- "$(dirname -- "$TOOLCHAIN_DIR")"
  # Serialise concurrent runs that share the cache.
  if command -v flock >/dev/null 2>&1; then
    exec 9>"$TOOLCHAIN_DIR.lock"
    flock 9
  fi
  if [[ ${DLBRIDGE_APPLE_REFRESH:-0} != 1 ]] && toolchain_ok "$TOOLCHAIN_DIR"; then
    return 0
  fi
  [[ -e $TOOLCHAIN_DIR ]] && log "cached toolchain in $TOOLCHAIN_DIR is missing, stale or broken; refetching"
  fetch_toolchain
  toolchain_ok "$TOOLCHAIN_DIR" || die "freshly unpacked toolchain in $TOOLCHAIN_DIR failed validation"
}

# ---------------------------------------------------------------- arguments
if (($# == 0)); then
  set -- -p dlbridge --all-targets --features metal
fi
# Make a relative --manifest-path absolute, since we run cargo from the repo root.
ARGS=() MANIFEST=
while (($#)); do
  case $1 in
    --manifest-path)
      (($# >= 2)) || die "--manifest-path needs a value"
      MANIFEST=$(realpath -- "$2") || die "no such manifest: $2"
      ARGS+=(--manifest-path "$MANIFEST"); shift 2 ;;
    --manifest-path=*)
      MANIFEST=$(realpath -- "${1#*=}") || die "no such manifest: ${1#*=}"
      ARGS+=(--manifest-path "$MANIFEST"); shift ;;
    --target | --target=*) die "pass the target via DLBRIDGE_APPLE_TARGET, not --target" ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
cd -- "$REPO_ROOT"

if [[ -n ${APPLE_CHECK_TARGET_DIR:-} ]]; then
  TARGET_DIR=$APPLE_CHECK_TARGET_DIR
elif [[ -n ${CARGO_TARGET_DIR:-} ]]; then
  TARGET_DIR=${CARGO_TARGET_DIR%/}/apple-check
else
  ws_manifest=$("$CARGO_BIN" locate-project --workspace --message-format plain \
    ${MANIFEST:+--manifest-path "$MANIFEST"}) || die "cargo could not locate the workspace"
  TARGET_DIR=$(dirname -- "$ws_manifest")/target/apple-check
fi

# -------------------------------------------------------------------- check
ensure_toolchain
RUSTC_PATH=$TOOLCHAIN_DIR/usr/bin/rustc
log "$(grep -E '^(rustc-release|llvm)=' "$TOOLCHAIN_DIR/$STAMP_NAME" | tr '\n' ' ')| $("$CARGO_BIN" --version)"
log "cargo check --target $TARGET ${ARGS[*]}  (target dir: $TARGET_DIR)"

# RUSTC points the host cargo at Debian's rustc (also used for build scripts and
# proc-macros, against the host std from libstd-rust-web-dev); RUSTC_BOOTSTRAP
# unlocks -Zbuild-std on stable cargo. RUSTDOC likewise, for completeness.
status=0
env RUSTC="$RUSTC_PATH" \
  RUSTDOC="$TOOLCHAIN_DIR/usr/bin/rustdoc" \
  LD_LIBRARY_PATH="$TOOLCHAIN_DIR/usr/lib/$MULTIARCH:$TOOLCHAIN_DIR/lib/$MULTIARCH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  RUSTC_BOOTSTRAP=1 \
  CARGO_TARGET_DIR="$TARGET_DIR" \
  "$CARGO_BIN" check -Zbuild-std=std,panic_abort --target "$TARGET" "${ARGS[@]}" || status=$?

if ((status != 0)); then
  log "FAILED (exit $status): $TARGET type-check"
  exit "$status"
fi
log "OK: $TARGET type-check passed"
