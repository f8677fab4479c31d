//! What only the Metal backend's kernels have: run-time MSL kernels (compiles, launches,
//! threadgroup memory, compile logs) and the refusal of `float64`. The built-in kernels' tests
//! are shared bodies in compute.rs, instantiated for every device (Metal included).
//!
//! Compiled only for Apple targets with feature `metal` (`cargo test -p dlbridge --features
//! metal` on a Mac); every GPU test is
//! `#[ignore = "needs a Metal device"]`, so run them with `-- --include-ignored` (as
//! `scripts/test.sh` does on macOS).

#![cfg(all(target_vendor = "apple", feature = "metal"))]

mod common;

use std::sync::{Mutex, MutexGuard};

use common::values::{assert_close_f32, close, noise};
use dlbridge::backend::metal;
use dlbridge::compute::kernel::{self, KernelArg, LaunchConfig};
use dlbridge::compute::{self, BinaryOp, ReduceOp, UnaryOp};
use dlbridge::{DType, Device, Element, Error, SliceArg, StorageMode, Tensor};

/// The first Metal device (panics where there is none: an ignored test asked to run without a
/// device fails rather than passing); GPU tests run one at a time.
fn gpu() -> (Device, MutexGuard<'static, ()>) {
    static SERIAL: Mutex<()> = Mutex::new(());
    assert!(
        metal::is_available(),
        "this test needs a Metal device, and this machine has none"
    );
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    (Device::metal(0), guard)
}

/// A Metal tensor holding `data` in `shape` (in `storage`, default when `None`).
fn upload<T: Element>(
    device: Device,
    data: &[T],
    shape: &[usize],
    storage: Option<StorageMode>,
) -> Tensor {
    let host = Tensor::from_slice(data, shape).unwrap();
    metal::copy_to(&host, device, storage).unwrap()
}

/// The elements of any Metal view, read back through the host (which waits for the GPU).
fn read<T: Element>(t: &Tensor) -> Vec<T> {
    assert_eq!(t.device().kind(), dlbridge::DeviceKind::Metal);
    metal::copy_to(t, Device::CPU, None)
        .unwrap()
        .as_slice::<T>()
        .unwrap()
        .to_vec()
}

#[test]
#[ignore = "needs a Metal device"]
fn float64_is_refused() {
    let (device, _serial) = gpu();
    let x = upload(device, &[1.0f64, 2.0], &[2], None);
    for result in [
        compute::unary(UnaryOp::Exp, &x).map(|_| ()),
        compute::binary(BinaryOp::Add, &x, &x).map(|_| ()),
        compute::reduce(ReduceOp::Sum, &x, None, false).map(|_| ()),
        compute::matmul(&x.expand_dims(0).unwrap(), &x.expand_dims(1).unwrap()).map(|_| ()),
    ] {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::UnsupportedDType(_)), "{err}");
        assert!(err.to_string().contains("float64"), "{err}");
    }
    // Integer division and integer means produce float64 (NumPy's rules): refused too.
    let i = upload(device, &[4i32, 6], &[2], None);
    let err = compute::binary(BinaryOp::Div, &i, &i).unwrap_err();
    assert!(err.to_string().contains("float64"), "{err}");
    let err = compute::reduce(ReduceOp::Mean, &i, None, false).unwrap_err();
    assert!(err.to_string().contains("float64"), "{err}");
}

const VECTOR_ADD: &str = r#"
#include <metal_stdlib>
using namespace metal;

kernel void vector_add(device const float* a [[buffer(0)]],
                       device const float* b [[buffer(1)]],
                       device float* out [[buffer(2)]],
                       constant uint& n [[buffer(3)]],
                       constant float& scale [[buffer(4)]],
                       uint i [[thread_position_in_grid]]) {
    if (i < n) {
        out[i] = (a[i] + b[i]) * scale * SCALE2;
    }
}

// Reverses each threadgroup's block through threadgroup memory (index 0).
kernel void reverse_blocks(device float* x [[buffer(0)]],
                           threadgroup float* tmp [[threadgroup(0)]],
                           uint i [[thread_position_in_grid]],
                           uint t [[thread_position_in_threadgroup]],
                           uint size [[threads_per_threadgroup]]) {
    tmp[t] = x[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    x[i] = tmp[size - 1 - t];
}
"#;

#[test]
#[ignore = "needs a Metal device"]
fn user_kernels_compile_and_launch() {
    let (device, _serial) = gpu();
    let n = 1000usize;
    let (a_data, b_data) = (noise(n, 9, 1.0), noise(n, 10, 1.0));
    let a = upload(device, &a_data, &[n], None);
    let b = upload(device, &b_data, &[n], None);
    let out = Tensor::zeros(&[n], DType::F32, device).unwrap();
    let options = vec!["-DSCALE2=2.0f".to_string(), "-fno-fast-math".to_string()];
    let k = kernel::compile(device, VECTOR_ADD, "vector_add", &options).unwrap();
    assert_eq!(k.name(), "vector_add");
    assert_eq!(k.device(), device);
    // Cached: compiling again gives the same kernel at once.
    kernel::compile(device, VECTOR_ADD, "vector_add", &options).unwrap();
    let config = LaunchConfig {
        grid: [(n as u32).div_ceil(64), 1, 1],
        block: [64, 1, 1],
        shared_mem: 0,
    };
    let args = [
        KernelArg::Tensor(a.clone()),
        KernelArg::Tensor(b.clone()),
        KernelArg::Tensor(out.clone()),
        KernelArg::Int(n as i64),
        KernelArg::Float(0.5),
    ];
    let timing = kernel::launch(&k, config, &args).unwrap();
    assert!(
        timing.elapsed_ms >= 0.0 && timing.elapsed_ms < 10_000.0,
        "{timing:?}"
    );
    let want: Vec<f32> = a_data
        .iter()
        .zip(&b_data)
        .map(|(x, y)| (x + y) * 0.5 * 2.0)
        .collect();
    assert_close_f32(&read::<f32>(&out), &want, 1e-6, "vector_add");
    // A view's byte offset is honoured: add the second halves into the first half of `out`.
    let half_a = a.slice(0, SliceArg::range(500, 1000)).unwrap();
    let half_b = b.slice(0, SliceArg::range(500, 1000)).unwrap();
    let args = [
        KernelArg::Tensor(half_a),
        KernelArg::Tensor(half_b),
        KernelArg::Tensor(out.clone()),
        KernelArg::Int(500),
        KernelArg::Float(1.0),
    ];
    kernel::launch(&k, config, &args).unwrap();
    let got = read::<f32>(&out);
    for i in 0..500 {
        let w = (a_data[500 + i] + b_data[500 + i]) * 2.0;
        assert!(close(got[i], w, 1e-6), "{i}: {} vs {w}", got[i]);
    }
    // Threadgroup memory at index 0.
    let data: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let x = upload(device, &data, &[256], None);
    let rev =
        kernel::compile(device, VECTOR_ADD, "reverse_blocks", &["-DSCALE2=1".into()]).unwrap();
    let config = LaunchConfig {
        grid: [4, 1, 1],
        block: [64, 1, 1],
        shared_mem: 64 * 4,
    };
    kernel::launch(&rev, config, &[KernelArg::Tensor(x.clone())]).unwrap();
    let want: Vec<f32> = (0..256)
        .map(|i| ((i / 64) * 64 + 63 - i % 64) as f32)
        .collect();
    assert_eq!(read::<f32>(&x), want);
    // Too many threads per threadgroup are refused before launching.
    let too_big = LaunchConfig {
        grid: [1, 1, 1],
        block: [4096, 1, 1],
        shared_mem: 0,
    };
    let err = kernel::launch(&rev, too_big, &[KernelArg::Tensor(x)]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
#[ignore = "needs a Metal device"]
fn compile_errors_carry_the_log() {
    let (device, _serial) = gpu();
    let broken = "#include <metal_stdlib>\nkernel void broken(device float* x [[buffer(0)]]) {\n    x[0] = undefined_name;\n}\n";
    match kernel::compile(device, broken, "broken", &[]).unwrap_err() {
        Error::Compile { backend, name, log } => {
            assert_eq!(backend, "Metal");
            assert_eq!(name, "broken");
            assert!(log.contains("undefined_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other}"),
    }
    // Without the macro, the vector-add source does not compile either.
    assert!(matches!(
        kernel::compile(device, VECTOR_ADD, "vector_add", &[]),
        Err(Error::Compile { .. })
    ));
    let err =
        kernel::compile(device, VECTOR_ADD, "no_such_kernel", &["-DSCALE2=1".into()]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(
        err.to_string().contains("vector_add"),
        "lists the functions: {err}"
    );
    let err = kernel::compile(device, VECTOR_ADD, "vector_add", &["-O3".into()]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}
