"""`python -m dlbridge [info]`: the version, the backends compiled in, the devices found, and why a
compiled-in backend has none; `inspect FILE...` and `load FILE...` for checkpoints. `--version` and
`--help` as usual (`--help` on each command too).

Every failure is one line `dlbridge: <message>` on stderr with exit status 1; usage errors exit
with 2, as argparse does; an interrupt (Ctrl-C) exits with 130."""

from __future__ import annotations

import argparse
import os
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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dlbridge",
        description="dlbridge: zero-copy DLPack exchange of CPU, CUDA and Metal memory.",
    )
    parser.add_argument("--version", action="version",
                        version=f"dlbridge {dlbridge.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     title="commands (info when none is given)")
    commands.add_parser("info", help="version, backends compiled in, devices found, and why a "
                                     "compiled-in backend has no device",
                        description="Prints the version, the backends compiled in, the devices "
                                    "found, and why a compiled-in backend has no device.")
    files_help = "safetensors files, the shards of one checkpoint, or its index (.json)"
    inspect_parser = commands.add_parser(
        "inspect", help="a safetensors checkpoint's tensors as a table",
        description="Prints a safetensors checkpoint's tensors (name, dtype, shape, size), its "
                    "metadata and the total.")
    inspect_parser.add_argument("files", nargs="+", metavar="FILE", help=files_help)
    load_parser = commands.add_parser(
        "load", help="load a checkpoint onto a device and print the throughput",
        description="Loads a safetensors checkpoint onto a device and prints the time and "
                    "throughput.")
    load_parser.add_argument("files", nargs="+", metavar="FILE", help=files_help)
    load_parser.add_argument("--device", default="cpu", help="where the tensors go (default cpu)")
    load_parser.add_argument("--threads", type=_positive, default=None, help="reader threads")
    load_parser.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto",
                             help="read around the page cache (default: auto)")
    return parser


def _message(error: BaseException) -> str:
    """An exception's message on one line (a KeyError's without the quotes its str adds)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def _run(args: argparse.Namespace) -> None:
    if args.command in (None, "info"):
        info()
    elif args.command == "inspect":
        inspect(args.files)
    else:
        load(args.files, args.device, args.threads,
             {"auto": None, "on": True, "off": False}[args.direct_io])


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv[1:])
    try:
        _run(args)
        sys.stdout.flush()
    except KeyboardInterrupt:
        print("dlbridge: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`| head`): nothing more to say, and Python's own
        # flush at exit must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as error:  # noqa: BLE001 - every failure is one line, not a traceback
        print(f"dlbridge: {_message(error)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
