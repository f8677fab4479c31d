//! Throughput of the CPU kernels on `float32`: GB/s moved (inputs read plus output written) per
//! op, best of several runs, and GFLOP/s for a matrix product.
//!
//! `cargo run --release -p dlbridge --example bench_cpu_compute [log2 elements, default 24]`
//!
//! The same ops in NumPy, for comparison on the same machine:
//! `python3 -c "import numpy as np, timeit; a = np.random.rand(1 << 24).astype('f4'); \
//! print(min(timeit.repeat(lambda: np.exp(a), number=1, repeat=10)))"`

use std::time::Instant;

use dlbridge::Tensor;
use dlbridge::compute::{self, BinaryOp, ReduceOp, Scalar, UnaryOp};

/// The best wall time of `runs` calls of `f`, in seconds.
fn best(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() -> dlbridge::Result<()> {
    let log2: u32 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    let n = 1usize << log2;
    let a: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32) * 1e-3 + 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| ((i % 777) as f32) * 1e-3 + 0.25).collect();
    let a = Tensor::from_slice(&a, &[n])?;
    let b = Tensor::from_slice(&b, &[n])?;
    let bytes = (4 * n) as f64;
    println!(
        "float32, 2^{log2} elements, {} threads",
        rayon::current_num_threads()
    );
    let report = |name: &str, moved: f64, secs: f64| {
        println!(
            "{name:<22} {:>9.3} ms {:>8.2} GB/s",
            secs * 1e3,
            moved / secs / 1e9
        );
    };
    let runs = 10;
    for op in BinaryOp::ALL {
        let t = best(runs, || drop(compute::binary(op, &a, &b).unwrap()));
        report(op.name(), 3.0 * bytes, t);
    }
    let t = best(runs, || {
        drop(compute::binary_scalar(BinaryOp::Mul, &a, Scalar::Float(2.0), false).unwrap())
    });
    report("mul scalar", 2.0 * bytes, t);
    for op in UnaryOp::ALL {
        let t = best(runs, || drop(compute::unary(op, &a).unwrap()));
        report(op.name(), 2.0 * bytes, t);
    }
    let side = 1usize << (log2 / 2);
    let square = a.reshape(&[Some(side), None])?;
    let row = b.slice(0, dlbridge::SliceArg::range(0, side as isize))?;
    let t = best(runs, || {
        drop(compute::binary(BinaryOp::Add, &square, &row).unwrap())
    });
    report("add row (broadcast)", 2.0 * bytes, t);
    let t = best(runs, || {
        drop(compute::binary(BinaryOp::Add, &square, &square.transpose().unwrap()).unwrap())
    });
    report("add transposed", 3.0 * bytes, t);
    for op in ReduceOp::ALL {
        let t = best(runs, || drop(compute::reduce(op, &a, None, false).unwrap()));
        report(op.name(), bytes, t);
    }
    let t = best(runs, || {
        drop(compute::reduce(ReduceOp::Sum, &square, Some(&[0]), false).unwrap())
    });
    report("sum axis 0", bytes, t);
    let t = best(runs, || {
        drop(compute::reduce(ReduceOp::Sum, &square, Some(&[1]), false).unwrap())
    });
    report("sum axis 1", bytes, t);
    let half = a.cast(dlbridge::DType::F16)?;
    let t = best(runs, || {
        drop(compute::binary(BinaryOp::Add, &half, &half).unwrap())
    });
    report("add float16", 1.5 * bytes, t);
    let t = best(runs, || {
        drop(compute::reduce(ReduceOp::Sum, &half, None, false).unwrap())
    });
    report("sum float16", 0.5 * bytes, t);
    let m = 1024;
    let x = a.slice(0, dlbridge::SliceArg::range(0, (m * m) as isize))?;
    let x = x.reshape(&[Some(m), Some(m)])?;
    let t = best(3, || drop(compute::matmul(&x, &x).unwrap()));
    println!(
        "{:<22} {:>9.3} ms {:>8.2} GFLOP/s",
        "matmul 1024",
        t * 1e3,
        2.0 * (m * m * m) as f64 / t / 1e9
    );
    Ok(())
}
