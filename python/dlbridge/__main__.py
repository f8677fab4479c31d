"""`python -m dlbridge info`: the version, the backends compiled in and the devices found."""

import sys

import dlbridge


def main(argv: "list[str]") -> int:
    if argv[1:] not in ([], ["info"]):
        print("usage: python -m dlbridge info", file=sys.stderr)
        return 2
    info = dlbridge.build_info()
    major, minor = info["dlpack_version"]
    print(f"dlbridge {info['version']} (DLPack {major}.{minor})")
    print(f"backends compiled in: {', '.join(info['backends'])}")
    print(f"devices found: {', '.join(info['devices']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
