"""The rows of bench_cuda_compute.rs, timed through PyTorch on the same GPU (same sizes, same
counting, median of 10 samples of 10 back-to-back calls between CUDA events, after 3
warm-ups, random data)."""

import torch


def time(f, calls=10):
    for _ in range(3):
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(10):
        start.record()
        for _ in range(calls):
            f()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end) / calls)
    ms.sort()
    return ms[len(ms) // 2]


def main():
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default, said out loud
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    n = 1 << 28
    a = torch.rand(n, device="cuda") * 2 - 1
    b = torch.rand(n, device="cuda") * 2 - 1
    gb = lambda nbytes, ms: nbytes / ms / 1e6
    row = lambda name, ms, rate: print(f"| {name} | {ms:.3f} | {rate} |")
    print("| op (torch) | ms | rate |")
    print("| --- | ---: | ---: |")
    ms = time(lambda: a.clone())
    row("copy f32 2^28", ms, f"{gb(8 * n, ms):.0f} GB/s")
    ms = time(lambda: a + b)
    row("add f32 2^28", ms, f"{gb(12 * n, ms):.0f} GB/s")
    ms = time(lambda: torch.exp(a))
    row("exp f32 2^28", ms, f"{gb(8 * n, ms):.0f} GB/s")
    ms = time(lambda: a.sum())
    row("sum f32 2^28", ms, f"{gb(4 * n, ms):.0f} GB/s")
    m2 = a.view(16384, 16384)
    ms = time(lambda: m2.sum(1))
    row("sum f32 16384² axis 1", ms, f"{gb(4 * n, ms):.0f} GB/s")
    ms = time(lambda: m2.sum(0))
    row("sum f32 16384² axis 0", ms, f"{gb(4 * n, ms):.0f} GB/s")
    bt = b.view(16384, 16384).t()
    ms = time(lambda: m2 + bt)
    row("add f32 16384² + transposed", ms, f"{gb(12 * n, ms):.0f} GB/s")
    ms = time(lambda: a.to(torch.bfloat16))
    row("cast f32→bf16 2^28", ms, f"{gb(6 * n, ms):.0f} GB/s")
    h = a.to(torch.bfloat16)
    ms = time(lambda: h * h)
    row("mul bf16 2^28", ms, f"{gb(6 * n, ms):.0f} GB/s")
    del a, b, m2, bt, h
    s = 8192
    flops = 2.0 * s**3
    for dtype, name in [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")]:
        x = (torch.rand(s, s, device="cuda") * 2 - 1).to(dtype)
        y = (torch.rand(s, s, device="cuda") * 2 - 1).to(dtype)
        ms = time(lambda: x @ y)
        row(f"matmul {name} 8192³", ms, f"{flops / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
