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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def inspect(files: list[str]) -> None:
    """Prints a checkpoint's header as a table: names, dtypes, shapes, sizes, and the total."""
    checkpoint = dlbridge._dlbridge._Checkpoint(files[0] if len(files) == 1 else files)
    rows = []
    total = 0
    for name in checkpoint.keys():
        dtype, shape, (begin, end), _ = checkpoint.info(name)
        rows.append((name, dtype, "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")",
                     _size(end - begin)))
        total += end - begin
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("name", "dtype", "shape", "size"))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format("name", "dtype", "shape", "size"))
    for r in rows:
        print(line.format(*r))
    metadata = checkpoint.metadata()
    if metadata:
        print("metadata: " + ", ".join(f"{k}={v}" for k, v in sorted(metadata.items())))
    print(f"{len(rows)} tensors, {_size(total)} ({total} bytes)")


def load(files: list[str], device: str, threads: int | None, direct_io: bool | None) -> None:
    """Loads a checkpoint onto `device` and prints the time and throughput."""
    import time
    checkpoint = dlbridge._dlbridge._Checkpoint(files[0] if len(files) == 1 else files)
    total = sum(e - b for _, _, (b, e), _ in (checkpoint.info(n) for n in checkpoint.keys()))
    start = time.perf_counter()
    tensors = dlbridge.load_file(files[0] if len(files) == 1 else files, device, threads=threads,
                                 direct_io=direct_io)
    if device != "cpu":
        dlbridge.synchronize(device)
    seconds = time.perf_counter() - start
    print(f"loaded {len(tensors)} tensors, {_size(total)} onto {device} in {seconds:.3f} s: "
          f"{total / seconds / 1e9:.2f} GB/s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dlbridge",
        description="dlbridge: zero-copy DLPack exchange of CPU, CUDA and Metal memory.",
    )
    parser.add_argument("--version", action="version",
                        version=f"dlbridge {dlbridge.__version__}")
    parser.add_argument("command", nargs="?", choices=["info", "inspect", "load"], default="info",
                        help="info (the default): version, backends compiled in, devices found, "
                             "and why a compiled-in backend has no device; inspect FILE...: a "
                             "safetensors checkpoint's tensors as a table; load FILE... --device D: "
                             "load it and print the throughput")
    parser.add_argument("files", nargs="*", help="safetensors files, shards or an index (inspect, load)")
    parser.add_argument("--device", default="cpu", help="where load puts the tensors (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="reader threads (load)")
    parser.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto",
                        help="read around the page cache (load; default: auto)")
    args = parser.parse_args(argv[1:])
    if args.command == "info":
        if args.files:
            parser.error("info takes no files")
        info()
        return 0
    if not args.files:
        parser.error(f"{args.command} needs a safetensors file")
    if args.command == "inspect":
        inspect(args.files)
    else:
        load(args.files, args.device, args.threads,
             {"auto": None, "on": True, "off": False}[args.direct_io])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
