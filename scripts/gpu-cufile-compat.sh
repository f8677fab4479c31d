#!/usr/bin/env bash
# Runs dlbridge's GPUDirect Storage path through cuFile's compatibility mode on a GPU machine that
# has libcufile but neither the nvidia-fs module nor a udev database (a container): cuFile asks
# udev what a file's volume is and refuses the file when udev cannot say. This script writes the
# two facts cuFile asks for (ID_FS_USAGE, ID_FS_TYPE) for the volumes it uses, so it is meant for
# a disposable machine, as root. It then loads the GPU test's checkpoint through cuFile
# (DLBRIDGE_LOAD_GDS=1, CUFILE_FORCE_COMPAT_MODE=true) on the root volume and on a loop-mounted
# ext4, through and around the page cache, and checks every selection against safetensors.
#
# Usage: sudo scripts/gpu-cufile-compat.sh        (dlbridge, torch and safetensors importable)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'umount "$work/mnt" 2>/dev/null || true; rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import re, sys, torch
from safetensors.torch import save_file
src = open("tests/python/test_safetensors.py").read()
open(f"{sys.argv[1]}/child.py", "w").write(re.search(r'_CUFILE_CHILD = """(.*?)"""', src, re.S).group(1))
g = torch.Generator().manual_seed(11)
save_file({"a": torch.randn(1001, generator=g), "b": torch.arange(4097, dtype=torch.uint8),
           "c": torch.randn(300, 1000, generator=g).to(torch.bfloat16), "d": torch.zeros(0, 3)},
          f"{sys.argv[1]}/gds.safetensors")
PY
truncate -s 256M "$work/ext4.img"
mkfs.ext4 -q "$work/ext4.img"
mkdir -p "$work/mnt" /run/udev/data
mount -o loop "$work/ext4.img" "$work/mnt"
cp "$work/gds.safetensors" "$work/mnt/"
status=0
for f in "$work/gds.safetensors" "$work/mnt/gds.safetensors"; do
    # The volume's device number, split the kernel's way (12 bits of major, 20 of minor).
    dev=$(stat -c %d "$f")
    major=$(((dev >> 8) & 0xfff)) minor=$(((dev & 0xff) | ((dev >> 12) & 0xfff00)))
    printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$(findmnt -no FSTYPE -T "$f")" \
        > "/run/udev/data/b$major:$minor"
    for direct in 0 1; do
        out=$(DLBRIDGE_LOAD_GDS=1 CUFILE_FORCE_COMPAT_MODE=true python3 "$work/child.py" "$f" "$direct" 2>&1 | tail -1)
        echo "$f (direct I/O $direct): $out"
        [[ $out == "loaded through cuFile" ]] || status=1
    done
done
exit $status
