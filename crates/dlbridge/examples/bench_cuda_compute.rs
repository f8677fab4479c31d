//! Times dlbridge's CUDA built-in kernels on large arrays, for comparison with PyTorch on the same
//! GPU (`bench_cuda_compute_torch.py` beside this file prints the same rows):
//!
//!     cargo run --release -p dlbridge --features cuda --example bench_cuda_compute
//!     python3 crates/dlbridge/examples/bench_cuda_compute_torch.py
//!
//! Each row is the median of 10 samples, each 10 back-to-back calls between two CUDA events on the
//! current stream, after 3 warm-up calls, on random data. Bandwidth counts each input read once
//! and the output written once; TFLOP/s counts `2·m·n·k`.
//!
//! Measured on an NVIDIA H200 (driver 580.159.04, CUDA 13.0; PyTorch 2.11.0+cu130), both
//! programs in one command:
//!
//! | op | dlbridge ms | dlbridge rate | torch ms | torch rate | dlbridge / torch |
//! | --- | ---: | ---: | ---: | ---: | ---: |
//! | copy f32 2^28 (device to device) | 0.505 | 4253 GB/s | 0.503 | 4268 GB/s | 1.00 |
//! | add f32 2^28 | 0.740 | 4351 GB/s | 0.739 | 4359 GB/s | 1.00 |
//! | exp f32 2^28 | 0.518 | 4148 GB/s | 0.505 | 4254 GB/s | 0.98 |
//! | sum f32 2^28 | 0.249 | 4316 GB/s | 0.250 | 4293 GB/s | 1.01 |
//! | sum f32 16384² axis 1 | 0.239 | 4485 GB/s | 0.262 | 4106 GB/s | 1.09 |
//! | sum f32 16384² axis 0 | 0.251 | 4272 GB/s | 0.250 | 4293 GB/s | 1.00 |
//! | add f32 16384² + transposed | 2.040 | 1579 GB/s | 1.971 | 1635 GB/s | 0.97 |
//! | cast f32→bf16 2^28 | 0.371 | 4337 GB/s | 0.370 | 4352 GB/s | 1.00 |
//! | mul bf16 2^28 | 0.258 | 6237 GB/s | 0.261 | 6180 GB/s | 1.01 |
//! | matmul f32 8192³ | 21.445 | 51.3 TFLOP/s | 21.451 | 51.3 TFLOP/s | 1.00 |
//! | matmul bf16 8192³ | 1.511 | 727.7 TFLOP/s | 1.581 | 695.6 TFLOP/s | 1.05 |
//!
//! The first `add` of a process, NVRTC compilation and module load included, took 10.7 ms.

use dlbridge::backend::cuda::{self, Event, current_stream};
use dlbridge::compute::kernel::{self, KernelArg, LaunchConfig};
use dlbridge::compute::{self, BinaryOp, ReduceOp, UnaryOp};
use dlbridge::{DType, Device, Result, Tensor};

/// Fills a float32 or bfloat16 array with uniform values in [-1, 1) from a counter hash.
const FILL: &str = r#"
__device__ unsigned int mix(unsigned long long i, unsigned int seed) {
  unsigned long long x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 27; x *= 0x94D049BB133111EBull; x ^= x >> 33;
  return (unsigned int)x;
}
extern "C" __global__ void fill_f32(float* out, unsigned long long n, unsigned int seed) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    out[i] = (float)(mix(i, seed) >> 8) * (2.0f / 16777216.0f) - 1.0f;
}
extern "C" __global__ void fill_bf16(unsigned short* out, unsigned long long n, unsigned int seed) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    float f = (float)(mix(i, seed) >> 8) * (2.0f / 16777216.0f) - 1.0f;
    out[i] = (unsigned short)(__float_as_uint(f) >> 16);
  }
}
"#;

fn random(device: Device, shape: &[usize], dtype: DType, seed: u32) -> Result<Tensor> {
    let t = Tensor::empty(shape, dtype, device)?;
    let name = if dtype == DType::BF16 {
        "fill_bf16"
    } else {
        "fill_f32"
    };
    let k = kernel::compile(device, FILL, name, &[])?;
    let config = LaunchConfig {
        grid: [4096, 1, 1],
        block: [256, 1, 1],
        shared_mem: 0,
    };
    let args = [
        KernelArg::Tensor(t.clone()),
        KernelArg::Int(t.numel() as i64),
        KernelArg::Int(i64::from(seed)),
    ];
    kernel::launch(&k, config, &args)?;
    Ok(t)
}

/// Milliseconds per call of `f` on device 0's current stream: the median over 10 samples of 10
/// back-to-back calls each (so that the host's work between calls overlaps the GPU's).
fn time(mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    let (start, end) = (Event::new(0, true)?, Event::new(0, true)?);
    for _ in 0..3 {
        f()?;
    }
    let mut ms = Vec::new();
    for _ in 0..10 {
        start.record(current_stream(0))?;
        for _ in 0..CALLS {
            drop(f()?);
        }
        end.record(current_stream(0))?;
        end.synchronize()?;
        ms.push(f64::from(start.elapsed_ms(&end)?) / CALLS as f64);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

const CALLS: usize = 10;

fn main() -> Result<()> {
    if !cuda::is_available() {
        println!("no CUDA device: nothing to time");
        return Ok(());
    }
    let device = Device::cuda(0);
    println!("device: {}", cuda::device_name(0)?);
    let n = 1usize << 28;
    let a = random(device, &[n], DType::F32, 1)?;
    let b = random(device, &[n], DType::F32, 2)?;
    let gb = |bytes: usize, ms: f64| bytes as f64 / ms / 1e6;
    let row = |name: &str, ms: f64, rate: String| println!("| {name} | {ms:.3} | {rate} |");
    println!("| op (dlbridge) | ms | rate |");
    println!("| --- | ---: | ---: |");
    let first = std::time::Instant::now();
    compute::binary(BinaryOp::Add, &a, &b)?;
    cuda::synchronize(0)?;
    println!(
        "| first add (NVRTC compile + load + run) | {:.1} | |",
        first.elapsed().as_secs_f64() * 1e3
    );
    let ms = time(|| a.copy())?;
    row("copy f32 2^28", ms, format!("{:.0} GB/s", gb(8 * n, ms)));
    let ms = time(|| compute::binary(BinaryOp::Add, &a, &b))?;
    row("add f32 2^28", ms, format!("{:.0} GB/s", gb(12 * n, ms)));
    let ms = time(|| compute::unary(UnaryOp::Exp, &a))?;
    row("exp f32 2^28", ms, format!("{:.0} GB/s", gb(8 * n, ms)));
    let ms = time(|| compute::reduce(ReduceOp::Sum, &a, None, false))?;
    row("sum f32 2^28", ms, format!("{:.0} GB/s", gb(4 * n, ms)));
    let m2 = a.reshape(&[Some(16384), Some(16384)])?;
    let ms = time(|| compute::reduce(ReduceOp::Sum, &m2, Some(&[1]), false))?;
    row(
        "sum f32 16384² axis 1",
        ms,
        format!("{:.0} GB/s", gb(4 * n, ms)),
    );
    let ms = time(|| compute::reduce(ReduceOp::Sum, &m2, Some(&[0]), false))?;
    row(
        "sum f32 16384² axis 0",
        ms,
        format!("{:.0} GB/s", gb(4 * n, ms)),
    );
    let bt = b.reshape(&[Some(16384), Some(16384)])?.transpose()?;
    let ms = time(|| compute::binary(BinaryOp::Add, &m2, &bt))?;
    row(
        "add f32 16384² + transposed",
        ms,
        format!("{:.0} GB/s", gb(12 * n, ms)),
    );
    let h = compute::cast(&a, DType::BF16)?;
    let ms = time(|| compute::cast(&a, DType::BF16))?;
    row(
        "cast f32→bf16 2^28",
        ms,
        format!("{:.0} GB/s", gb(6 * n, ms)),
    );
    let ms = time(|| compute::binary(BinaryOp::Mul, &h, &h))?;
    row("mul bf16 2^28", ms, format!("{:.0} GB/s", gb(6 * n, ms)));
    drop((a, b, m2, bt, h));
    let s = 8192usize;
    let flops = 2.0 * (s as f64).powi(3);
    for dtype in [DType::F32, DType::BF16] {
        let x = random(device, &[s, s], dtype, 3)?;
        let y = random(device, &[s, s], dtype, 4)?;
        let ms = time(|| compute::matmul(&x, &y))?;
        row(
            &format!("matmul {dtype} 8192³"),
            ms,
            format!("{:.1} TFLOP/s", flops / ms / 1e9),
        );
    }
    Ok(())
}
