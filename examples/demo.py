"""One tensor shared by NumPy, PyTorch and dlbridge, with no copies.

Run with `bash scripts/demo.sh`. It shows that every library sees the same memory (equal
pointers, and a write through one seen by the others), then times each conversion.
"""

import statistics
import timeit

import numpy as np
import torch

import dlbridge


def per_call_us(fn, number=20_000, repeat=7):
    """Median over `repeat` runs of the mean per-call time, in microseconds."""
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main():
    # A NumPy array, seen by dlbridge and PyTorch without copies.
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    shared = dlbridge.from_dlpack(host)
    as_torch = torch.from_dlpack(shared)

    print("one buffer, three libraries")
    print(f"  numpy    data pointer  {host.ctypes.data:#x}")
    print(f"  dlbridge data pointer  {shared.data_ptr:#x}")
    print(f"  torch    data pointer  {as_torch.data_ptr():#x}")
    assert host.ctypes.data == shared.data_ptr == as_torch.data_ptr()

    as_torch[1, 2] = -1.0  # a write through PyTorch ...
    shared[0, 0] = 100.0  # ... and one through dlbridge
    print(f"  after writes via torch and dlbridge, numpy sees row 0 = {host[0].tolist()}")
    print(f"                                       and row 1 = {host[1].tolist()}")
    assert host[1, 2] == -1.0 and host[0, 0] == 100.0

    # Views cross the border as views: a strided column, transposed, still no copy.
    column = shared[:, 1]
    print(f"  column view: strides {column.strides} (elements), byte offset {column.byte_offset}, "
          f"torch sees {torch.from_dlpack(column).tolist()}")

    t = torch.ones(256)
    print("\nper-call conversion cost (median, 1 KiB float32 tensor)")
    rows = [
        ("dlbridge.from_dlpack(numpy array)", lambda: dlbridge.from_dlpack(host)),
        ("dlbridge.from_dlpack(torch tensor)", lambda: dlbridge.from_dlpack(t)),
        ("torch.from_dlpack(dlbridge array)", lambda: torch.from_dlpack(shared)),
        ("numpy.from_dlpack(dlbridge array)", lambda: np.from_dlpack(shared)),
        ("numpy.from_dlpack(torch tensor)  [peer]", lambda: np.from_dlpack(t)),
        ("torch.from_dlpack(numpy array)   [peer]", lambda: torch.from_dlpack(host)),
    ]
    for name, fn in rows:
        print(f"  {name:42s} {per_call_us(fn):7.2f} µs")


if __name__ == "__main__":
    main()
