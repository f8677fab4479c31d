"""CUDA streams and events with dlbridge, and handing arrays to PyTorch on another stream.

    python examples/cuda_streams.py

Prints that it was skipped, and exits 0, on a machine without a CUDA device.
"""

import sys

import dlbridge


def main() -> int:
    if not dlbridge.cuda.is_available():
        print(f"cuda_streams: skipped, no CUDA device: {dlbridge.cuda.unavailable_reason()}")
        return 0
    print(f"cuda:0 is {dlbridge.cuda.device_name(0)}; driver for CUDA "
          "{}.{}".format(*dlbridge.cuda.driver_version()))

    # Work enqueued inside `with dlbridge.cuda.stream(s)` runs on s.
    s = dlbridge.cuda.Stream(0)
    start = dlbridge.cuda.Event(0, enable_timing=True)
    end = dlbridge.cuda.Event(0, enable_timing=True)
    with dlbridge.cuda.stream(s):
        start.record()
        x = dlbridge.arange(1 << 22, dtype="float32", device="cuda:0")
        y = (x * 2.0 + 1.0).sum()
        end.record()
    end.synchronize()
    print(f"fill, multiply-add and sum of 4 Mi floats on {s}: {start.elapsed_time(end):.3f} ms")
    n = 1 << 22
    total = y.to("cpu").item()
    assert abs(total / (n * (n - 1) + n) - 1) < 1e-3, total  # sum of 2i + 1, in float32

    # Pinned host memory, and a copy to the device on the stream.
    pinned = dlbridge.zeros((1 << 20,), device="cuda:0", storage="pinned")
    print(f"pinned array on {pinned.device} (storage {pinned.storage})")
    with dlbridge.cuda.stream(s):
        on_device = pinned.to("cuda:0")
    s.synchronize()
    assert on_device.device == "cuda:0"

    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: the hand-off to PyTorch is skipped")
        return 0
    if not torch.cuda.is_available():
        print("PyTorch has no CUDA: the hand-off to PyTorch is skipped")
        return 0
    # DLPack's stream hand-off: PyTorch's current stream waits for s (an event, no host sync).
    t = torch.from_dlpack(on_device)
    assert t.data_ptr() == on_device.data_ptr
    torch_stream = torch.cuda.Stream()
    with dlbridge.cuda.stream(torch_stream):  # a PyTorch stream as dlbridge's current stream
        z = dlbridge.zeros((1024,), device="cuda:0")
    torch_stream.synchronize()
    assert torch.from_dlpack(z).sum().item() == 0.0
    print("cuda_streams: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
