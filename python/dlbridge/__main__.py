"""`python -m dlbridge [info]`: the version, the backends compiled in, the devices found, and why a
compiled-in backend has none. `--version` and `--help` as usual."""

from __future__ import annotations

import argparse
import sys

import dlbridge


def _reason(text: str, backend: str) -> str:
    """A backend's unavailable reason without the "X backend not available: " lead."""
    lead = f"{backend} backend not available: "
    return text[len(lead):] if text.startswith(lead) else text


def _cuda_lines() -> list[str]:
    if not dlbridge.cuda.is_available():
        return [f"  CUDA: compiled in; no device: {_reason(dlbridge.cuda.unavailable_reason(), 'CUDA')}"]
    major, minor = dlbridge.cuda.driver_version()
    lines = [f"  CUDA: driver for CUDA {major}.{minor}, {dlbridge.cuda.device_count()} device(s)"]
    for i in range(dlbridge.cuda.device_count()):
        free, total = dlbridge.cuda.mem_get_info(i)
        lines.append(f"  cuda:{i}: {dlbridge.cuda.device_name(i)} ({total / 2**30:.1f} GiB, "
                     f"{free / 2**30:.1f} GiB free)")
    return lines


def _metal_lines() -> list[str]:
    if not dlbridge.metal.is_available():
        return [f"  Metal: compiled in; no device: "
                f"{_reason(dlbridge.metal.unavailable_reason(), 'Metal')}"]
    lines = []
    for d in dlbridge.metal.devices():
        memory = "unified memory" if d["has_unified_memory"] else "discrete memory"
        lines.append(f"  {d['device']}: {d['name']} ({memory}, default storage "
                     f"{d['default_storage']}, residency sets {d['residency']})")
    return lines


def info() -> None:
    """Prints what this build of dlbridge has and finds."""
    build = dlbridge.build_info()
    major, minor = build["dlpack_version"]
    print(f"dlbridge {build['version']} (DLPack {major}.{minor})")
    print(f"backends compiled in: {', '.join(build['backends'])}")
    print(f"devices found: {', '.join(build['devices'])}")
    if "cuda" in build["backends"]:
        print("\n".join(_cuda_lines()))
    else:
        print("  CUDA: not compiled in")
    if "metal" in build["backends"]:
        print("\n".join(_metal_lines()))
    else:
        print("  Metal: not compiled in (built for Apple platforms only)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dlbridge",
        description="dlbridge: zero-copy DLPack exchange of CPU, CUDA and Metal memory.",
    )
    parser.add_argument("--version", action="version",
                        version=f"dlbridge {dlbridge.__version__}")
    parser.add_argument("command", nargs="?", choices=["info"], default="info",
                        help="info (the default): version, backends compiled in, devices found, "
                             "and why a compiled-in backend has no device")
    parser.parse_args(argv[1:])
    info()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
