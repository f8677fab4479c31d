"""Computing with dlbridge: built-in ops, a Python callable as a kernel on the CPU, and an NVRTC
kernel where CUDA exists.

    python examples/kernels.py

The CUDA kernel prints that it was skipped where there is no CUDA device.
"""

import numpy as np

import dlbridge
from dlbridge import ops


def builtin_ops() -> None:
    x = dlbridge.arange(6, dtype="float32").reshape(2, 3)
    y = ops.exp(x) * 2 - 1  # operators and ops work on any device
    print(f"exp(x) * 2 - 1 = {y.tolist()}")
    print(f"sum over axis 1 = {y.sum(axis=1).tolist()}, max = {float(y.max()):.3f}")
    m = x @ x.T
    assert np.allclose(np.asarray(m), np.asarray(x) @ np.asarray(x).T)
    print(f"x @ x.T = {m.tolist()}")
    assert x.astype("float64").dtype == dlbridge.float64


def python_kernel_on_cpu() -> None:
    be = dlbridge.Backend("cpu")

    def saxpy(out, a, x, y):  # receives NumPy views of the same memory
        np.multiply(x, a, out=out)
        out += y

    kernel = be.compile_kernel(saxpy)
    x = be.copy_to_device(np.arange(8, dtype=np.float32))
    y = be.allocate_zeros((8,))
    out = be.allocate((8,))
    result = be.execute_kernel(kernel, 1, 1, out, 2.0, x, y)
    assert result.success, result.error
    print(f"Python kernel on the CPU: {be.copy_to_host(out).tolist()} "
          f"in {result.execution_time_ms:.3f} ms")
    assert be.copy_to_host(out).tolist() == [2.0 * i for i in range(8)]


SCALE = r"""
extern "C" __global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""


def nvrtc_kernel_on_cuda() -> None:
    if not dlbridge.cuda.is_available():
        print(f"NVRTC kernel: skipped, no CUDA device: {dlbridge.cuda.unavailable_reason()}")
        return
    be = dlbridge.Backend("cuda:0")
    try:
        kernel = be.compile_kernel(SCALE)
    except RuntimeError as e:  # NVRTC missing, or a compiler error with its log
        print(f"NVRTC kernel: skipped, cannot compile: {e}")
        return
    n = 1 << 20
    x = be.copy_to_device(np.ones(n, dtype=np.float32))
    result = be.execute_kernel(kernel, (n + 255) // 256, 256, x, np.float32(3.0), np.int32(n))
    assert result.success, result.error
    host = be.copy_to_host(x)
    assert float(host[0]) == 3.0 and float(host[-1]) == 3.0
    print(f"NVRTC kernel on {be.device}: {n} elements scaled in {result.execution_time_ms:.3f} ms")


def main() -> None:
    builtin_ops()
    python_kernel_on_cpu()
    nvrtc_kernel_on_cuda()
    print("kernels: ok")


if __name__ == "__main__":
    main()
