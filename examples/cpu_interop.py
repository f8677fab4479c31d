"""NumPy, PyTorch and dlbridge sharing one host buffer: no copies, checked by pointers and writes.

    python examples/cpu_interop.py
"""

import numpy as np
import torch

import dlbridge


def main() -> None:
    host = np.arange(12, dtype=np.float32).reshape(3, 4)

    # NumPy -> dlbridge -> PyTorch: three views of one buffer.
    a = dlbridge.from_dlpack(host, copy=False)  # copy=False: refuse rather than copy
    t = torch.from_dlpack(a)
    print(f"numpy    {host.ctypes.data:#x}\ndlbridge {a.data_ptr:#x}\ntorch    {t.data_ptr():#x}")
    assert host.ctypes.data == a.data_ptr == t.data_ptr()

    # A write through any of them is seen by the others.
    t[0, 0] = 100.0
    a[2, 3] = -1.0
    assert host[0, 0] == 100.0 and host[2, 3] == -1.0
    print(f"after writes through torch and dlbridge: numpy row 0 = {host[0].tolist()}")

    # Views cross as views: a strided column, then its transpose, still the same memory.
    column = a[:, 1]
    print(f"column: shape {column.shape}, strides {column.strides} (in elements)")
    col_t = torch.from_dlpack(column)
    assert col_t.data_ptr() == host.ctypes.data + 4  # one float32 into the buffer
    col_t += 0.5
    assert host[:, 1].tolist() == [1.5, 5.5, 9.5]

    # PyTorch -> dlbridge -> NumPy, the other way round.
    src = torch.linspace(0, 1, 5)
    b = dlbridge.from_dlpack(src)
    back = np.from_dlpack(b)
    assert back.ctypes.data == src.data_ptr() == b.data_ptr
    print(f"torch -> dlbridge -> numpy, same pointer: {back.tolist()}")

    # Read-only producers stay read-only.
    frozen = host.copy()
    frozen.flags.writeable = False
    ro = dlbridge.asarray(frozen)
    assert ro.readonly
    try:
        ro[0, 0] = 1.0
    except BufferError as e:
        print(f"writing a read-only import: BufferError: {e}")

    # A copy is explicit and independent.
    c = a.copy()
    assert c.data_ptr != a.data_ptr
    print("cpu_interop: ok")


if __name__ == "__main__":
    main()
