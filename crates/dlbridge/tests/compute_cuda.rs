//! What only the CUDA backend has: run-time user kernels (NVRTC compiles, launches, timing,
//! compile and launch errors), work on the current stream, and reductions past 2^31 elements
//! (2 GiB of device memory). The built-in kernels' tests are shared bodies in compute.rs,
//! instantiated for every device.
//!
//! Every test is ignored unless asked for (`-- --include-ignored`), since each needs a CUDA device;
//! on a GPU machine `scripts/test.sh` asks, and they run for real. Compiled with feature `cuda`
//! only (a Mac's `--include-ignored` would otherwise run them without a CUDA backend).

#![cfg(feature = "cuda")]

mod common;

use common::values::*;
use common::{Rng, gpu};
use dlbridge::compute::kernel::{self, KernelArg, LaunchConfig};
use dlbridge::compute::{self, BinaryOp, ReduceOp};
use dlbridge::{DType, Error, Tensor};

/// The one `int64` an arg reduction over everything gives.
fn position(op: ReduceOp, x: &Tensor) -> i128 {
    read(&compute::reduce(op, x, None, false).unwrap())[0].i()
}

// ---------------------------------------------------------------------------------------------
// Run-time kernels.

const VADD: &str = r#"
extern "C" __global__ void vadd(const float* a, const float* b, float* c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
template <typename T> __global__ void scale(T* x, T s, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}
"#;

const TILE_SUM: &str = r#"
extern "C" __global__ void tile_sum(const float* x, float* out, int n, int tile) {
  extern __shared__ float sm[];
  int base = blockIdx.x * tile;
  for (int i = threadIdx.x; i < tile; i += blockDim.x) sm[i] = base + i < n ? x[base + i] : 0.0f;
  __syncthreads();
  for (int s = tile / 2; s > 0; s >>= 1) {
    for (int i = threadIdx.x; i < s; i += blockDim.x) sm[i] += sm[i + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = sm[0];
}
"#;

fn config(grid: u32, block: u32, shared_mem: u32) -> LaunchConfig {
    LaunchConfig {
        grid: [grid, 1, 1],
        block: [block, 1, 1],
        shared_mem,
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn user_kernels_compile_launch_and_time() {
    let device = gpu();
    let mut rng = Rng::new(12);
    let n = 100_003usize;
    let va = rng.values(DType::F32, n, -1.0, 1.0);
    let vb = rng.values(DType::F32, n, -1.0, 1.0);
    let a = on(device, DType::F32, &va, &[n]);
    let b = on(device, DType::F32, &vb, &[n]);
    let c = Tensor::empty(&[n], DType::F32, device).unwrap();
    let k = kernel::compile(device, VADD, "vadd", &[]).unwrap();
    assert_eq!(k.name(), "vadd");
    if let Some(params) = k.param_sizes() {
        assert_eq!(params, &[8, 8, 8, 4]);
    }
    // The same request comes from the cache.
    let again = kernel::compile(device, VADD, "vadd", &[]).unwrap();
    assert_eq!(again.name(), "vadd");
    let args = [
        KernelArg::Tensor(a.clone()),
        KernelArg::Tensor(b.clone()),
        KernelArg::Tensor(c.clone()),
        KernelArg::Int(n as i64),
    ];
    let timing = kernel::launch(&k, config(n.div_ceil(256) as u32, 256, 0), &args).unwrap();
    assert!(timing.elapsed_ms > 0.0, "{timing:?}");
    let want: Vec<V> = va
        .iter()
        .zip(&vb)
        .map(|(x, y)| V::F((x.f() as f32 + y.f() as f32) as f64))
        .collect();
    check("vadd", &read(&c), &want, 0.0, 0.0);

    // A C++ template, found by the name written in the source.
    let scale = kernel::compile(device, VADD, "scale<float>", &["-std=c++17".into()]).unwrap();
    let args = [
        KernelArg::Tensor(c.clone()),
        KernelArg::Float(2.0),
        KernelArg::Int(n as i64),
    ];
    kernel::launch(&scale, config(n.div_ceil(128) as u32, 128, 0), &args).unwrap();
    let doubled: Vec<V> = want.iter().map(|v| V::F(v.f() * 2.0)).collect();
    check("scale<float>", &read(&c), &doubled, 0.0, 0.0);

    // 64 KiB of dynamic shared memory: above the 48 KiB default, so the kernel opts in.
    let sum = kernel::compile(device, TILE_SUM, "tile_sum", &[]).unwrap();
    let tile = 16_384usize;
    let blocks = n.div_ceil(tile);
    let out = Tensor::empty(&[blocks], DType::F32, device).unwrap();
    let args = [
        KernelArg::Tensor(a.clone()),
        KernelArg::Tensor(out.clone()),
        KernelArg::Int(n as i64),
        KernelArg::Int(tile as i64),
    ];
    let t = kernel::launch(&sum, config(blocks as u32, 256, (tile * 4) as u32), &args).unwrap();
    assert!(t.elapsed_ms > 0.0);
    let got = read(&out);
    for (blk, g) in got.iter().enumerate() {
        let want: f64 = va[blk * tile..((blk + 1) * tile).min(n)]
            .iter()
            .map(|v| v.f())
            .sum();
        assert!((g.f() - want).abs() < 1e-3, "tile {blk}: {g:?} vs {want}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn user_kernel_errors_are_reported_and_leave_the_backend_working() {
    let device = gpu();
    // A syntax error: NVRTC's log comes back.
    let bad = "extern \"C\" __global__ void broken(float* x) { x[0] = ; }";
    match kernel::compile(device, bad, "broken", &[]) {
        Err(Error::Compile { backend, name, log }) => {
            assert_eq!((backend, name.as_str()), ("CUDA", "broken"));
            assert!(log.contains("error"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    // A valid program without the entry point.
    let err = kernel::compile(device, VADD, "no_such_kernel", &[]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // Too many threads per block: the launch fails, the context does not.
    let k = kernel::compile(device, VADD, "vadd", &[]).unwrap();
    let x = on(device, DType::F32, &[V::F(1.0); 8], &[8]);
    let args = [
        KernelArg::Tensor(x.clone()),
        KernelArg::Tensor(x.clone()),
        KernelArg::Tensor(x.clone()),
        KernelArg::Int(8),
    ];
    match kernel::launch(&k, config(1, 2048, 0), &args) {
        Err(Error::Driver { message, .. }) => {
            assert!(message.contains("vadd"), "{message}");
            assert!(!message.contains("restarted"), "{message}");
        }
        other => panic!("expected a launch error, got {other:?}"),
    }
    // Wrong argument count, and an array for an int parameter (where the driver tells sizes).
    let wrong = [
        KernelArg::Tensor(x.clone()),
        KernelArg::Tensor(x.clone()),
        KernelArg::Tensor(x.clone()),
        KernelArg::Tensor(x.clone()),
    ];
    if k.param_sizes().is_some() {
        assert!(kernel::launch(&k, config(1, 32, 0), &args[..3]).is_err());
        assert!(kernel::launch(&k, config(1, 32, 0), &wrong).is_err());
    }
    // Still working: the kernel and a built-in.
    kernel::launch(&k, config(1, 32, 0), &args).unwrap();
    check("after errors", &read(&x), &[V::F(2.0); 8], 0.0, 0.0);
    let y = compute::binary(BinaryOp::Add, &x, &x).unwrap();
    check(
        "built-in after errors",
        &read(&y),
        &[V::F(4.0); 8],
        0.0,
        0.0,
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn work_follows_the_current_stream() {
    use dlbridge::backend::cuda::{Stream, current_stream, set_current_stream};
    let device = gpu();
    let stream = Stream::new(0, true).unwrap();
    let previous = set_current_stream(0, stream.handle());
    assert_eq!(current_stream(0), stream.handle());
    let mut rng = Rng::new(13);
    let vals = rng.values(DType::F32, 1 << 20, -1.0, 1.0);
    let x = on(device, DType::F32, &vals, &[1 << 20]);
    let y = compute::binary(BinaryOp::Mul, &x, &x).unwrap();
    let s = compute::reduce(ReduceOp::Sum, &y, None, false).unwrap();
    let m = compute::matmul(
        &x.reshape(&[Some(1024), None]).unwrap(),
        &x.reshape(&[None, Some(1024)]).unwrap(),
    )
    .unwrap();
    stream.synchronize().unwrap();
    let want: f64 = vals.iter().map(|v| v.f() * v.f()).sum();
    let got = read(&s)[0].f();
    assert!((got - want).abs() < 1e-4 * want, "{got} vs {want}");
    assert_eq!(m.shape(), &[1024, 1024]);
    set_current_stream(0, previous);
}

/// More than 2^31 elements: positions and counts in 64 bits (a 2 GiB `uint8` vector).
#[test]
#[ignore = "needs a CUDA device"]
fn reductions_past_two_billion_elements_use_64_bit_positions() {
    let device = gpu();
    let n = (1usize << 31) + 100;
    let mut host_vals = vec![1u8; n];
    let big = 1usize << 31;
    host_vals[big + 50] = 9;
    host_vals[big + 60] = 9;
    host_vals[big + 70] = 0;
    host_vals[big + 80] = 0;
    let x = Tensor::from_slice(&host_vals, &[n])
        .unwrap()
        .copy_to(device)
        .unwrap();
    drop(host_vals);
    assert_eq!(position(ReduceOp::ArgMax, &x), (big + 50) as i128);
    assert_eq!(position(ReduceOp::ArgMin, &x), (big + 70) as i128);
    // Sum of squares about the mean, exactly: n - 4 ones, two 9s, two 0s.
    let count = n as f64;
    let total = (n - 4) as f64 + 18.0;
    let mean = total / count;
    let m2 = (n - 4) as f64 * (1.0 - mean).powi(2) + 2.0 * (9.0 - mean).powi(2) + 2.0 * mean * mean;
    let got = read(&compute::var(&x, None, 0.0, false).unwrap())[0].f();
    let want = m2 / count;
    assert!(
        (got - want).abs() <= 1e-9 * want,
        "var: got {got}, want {want}"
    );
    // Several outputs, each over more than 2^31 elements (a broadcast row).
    let rows = x.expand_dims(0).unwrap().broadcast_to(&[3, n]).unwrap();
    for (op, at) in [(ReduceOp::ArgMax, big + 50), (ReduceOp::ArgMin, big + 70)] {
        let got = read(&compute::reduce(op, &rows, Some(&[1]), false).unwrap());
        assert_eq!(
            got,
            vec![V::I(at as i128); 3],
            "{} of broadcast rows",
            op.name()
        );
    }
}
