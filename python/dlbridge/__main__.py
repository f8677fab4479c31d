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
    if "metal" in info["backends"]:
        if dlbridge.metal.is_available():
            for d in dlbridge.metal.devices():
                memory = "unified memory" if d["has_unified_memory"] else "discrete memory"
                print(f"  {d['device']}: {d['name']} ({memory}, default storage "
                      f"{d['default_storage']}, residency sets {d['residency']})")
        else:
            print(f"  metal: {dlbridge.metal.unavailable_reason()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
