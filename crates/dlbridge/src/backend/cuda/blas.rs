//! Matrix products through cuBLAS (`cublasGemmStridedBatchedEx`), loaded at run time like the
//! driver: a machine without `libcublas.so.13` gets [`Error::BackendUnavailable`], not a panic.
//!
//! | dtype | cuBLAS types | compute |
//! | --- | --- | --- |
//! | `float32` | `CUDA_R_32F` | `CUBLAS_COMPUTE_32F` (full float32, no TF32: PyTorch's default) |
//! | `float16` | `CUDA_R_16F` | `CUBLAS_COMPUTE_32F` |
//! | `bfloat16` | `CUDA_R_16BF` | `CUBLAS_COMPUTE_32F` |
//! | `float64` | `CUDA_R_64F` | `CUBLAS_COMPUTE_64F` |
//!
//! cuBLAS is column-major and dlbridge row-major: the row-major `C = A B` is computed as the
//! column-major `Cᵀ = Bᵀ Aᵀ`, where a row-major operand read as column-major already is its
//! transpose (no copy), and a column-major one is passed transposed.
//!
//! Each thread has its own handle per device (handles must not be used by two threads at once);
//! the stream is set on every call, and so is a workspace from the device's pool, taken for the
//! call and fenced on the stream when it goes back (a workspace shared across streams would let
//! two products overwrite each other's scratch). Handles of threads that ended are kept for
//! reuse, never destroyed: destroying one at thread exit could run after the driver shut down.

use std::cell::RefCell;
use std::ffi::{CStr, c_void};
use std::sync::{Mutex, OnceLock};

use cudarc::cublas::sys as cublas;
use cudarc::driver::result;

use super::driver::Named;
use super::first_address;
use super::stream::{current_stream, raw};
use super::{BACKEND, context};
use crate::compute::{MatmulRequest, MatrixLayout};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The scratch memory cuBLAS gets per call (what cuBLAS recommends for Hopper, and PyTorch uses).
const WORKSPACE: usize = 32 << 20;

fn library() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library under its known names; no symbol is used.
    let present = *PRESENT.get_or_init(|| unsafe { cublas::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(Error::BackendUnavailable {
            backend: BACKEND,
            reason: "cuBLAS (libcublas.so.13) was not found: dlbridge's CUDA matmul needs it; \
                     install it (e.g. the pip package nvidia-cublas or the CUDA toolkit) or add \
                     its folder to LD_LIBRARY_PATH"
                .into(),
        })
    }
}

fn status(rc: cublas::cublasStatus_t, call: &str) -> Result<()> {
    if rc == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuBLAS returns a static NUL-terminated string for every status.
    let text = unsafe { cublas::cublasGetStatusString(rc) };
    let text = if text.is_null() {
        format!("{rc:?}")
    } else {
        // SAFETY: non-NULL, static and NUL-terminated (above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    };
    Err(Error::Driver {
        backend: BACKEND,
        message: format!("{call} failed: {text}"),
    })
}

/// A cuBLAS handle of one device.
struct Handle {
    raw: cublas::cublasHandle_t,
    ordinal: i32,
}

// SAFETY: a handle may move between threads as long as one thread uses it at a time: it is used
// only by the thread whose list holds it, and sits unused in `SPARE` otherwise.
unsafe impl Send for Handle {}

/// Handles of threads that ended, for the next thread that needs one.
static SPARE: Mutex<Vec<Handle>> = Mutex::new(Vec::new());

/// The calling thread's handles; given to [`SPARE`] when the thread ends.
struct ThreadHandles(Vec<Handle>);

impl Drop for ThreadHandles {
    fn drop(&mut self) {
        SPARE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .append(&mut self.0);
    }
}

thread_local! {
    static HANDLES: RefCell<ThreadHandles> = const { RefCell::new(ThreadHandles(Vec::new())) };
}

/// Runs `f` with the calling thread's handle for device `ordinal`, whose context the caller has
/// bound.
fn with_handle<R>(ordinal: i32, f: impl FnOnce(cublas::cublasHandle_t) -> Result<R>) -> Result<R> {
    let get = |list: &mut Vec<Handle>| -> Result<cublas::cublasHandle_t> {
        if let Some(h) = list.iter().find(|h| h.ordinal == ordinal) {
            return Ok(h.raw);
        }
        let spare = {
            let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
            spare
                .iter()
                .position(|h| h.ordinal == ordinal)
                .map(|i| spare.swap_remove(i))
        };
        let handle = match spare {
            Some(h) => h,
            None => create(ordinal)?,
        };
        let raw = handle.raw;
        list.push(handle);
        Ok(raw)
    };
    match HANDLES.try_with(|cell| get(&mut cell.borrow_mut().0)) {
        Ok(handle) => f(handle?),
        // The thread is ending: borrow a handle for this call alone.
        Err(_) => {
            let mut list = Vec::new();
            let handle = get(&mut list)?;
            let result = f(handle);
            SPARE
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .append(&mut list);
            result
        }
    }
}

fn create(ordinal: i32) -> Result<Handle> {
    library()?;
    let mut raw: cublas::cublasHandle_t = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the device's context is current (the caller bound it), which is
    // the context the handle is made for.
    status(unsafe { cublas::cublasCreate_v2(&mut raw) }, "cublasCreate")?;
    // Plain float32 arithmetic: never TF32 behind the caller's back.
    // SAFETY: a live handle.
    let rc = unsafe { cublas::cublasSetMathMode(raw, cublas::cublasMath_t::CUBLAS_DEFAULT_MATH) };
    status(rc, "cublasSetMathMode")?;
    Ok(Handle { raw, ordinal })
}

/// One operand as cuBLAS reads it: the column-major transpose of the row-major view.
struct Operand {
    op: cublas::cublasOperation_t,
    ld: i64,
}

/// How cuBLAS reads the row-major `rows × cols` view `layout` as its column-major transpose.
fn operand(layout: &MatrixLayout) -> Operand {
    let ld = layout.leading_dimension() as i64;
    if layout.is_row_major() {
        // In memory, a column-major `cols × rows` matrix: the transpose as it is.
        Operand {
            op: cublas::cublasOperation_t::CUBLAS_OP_N,
            ld: ld.max(layout.cols.max(1) as i64),
        }
    } else {
        // Columns are contiguous: in memory the matrix itself, column-major; transpose it.
        Operand {
            op: cublas::cublasOperation_t::CUBLAS_OP_T,
            ld: ld.max(layout.rows.max(1) as i64),
        }
    }
}

pub(crate) fn matmul(req: &MatmulRequest<'_>) -> Result<()> {
    let dtype = req.out.dtype();
    let (data, compute) = match dtype {
        DType::F32 => (
            cublas::cudaDataType::CUDA_R_32F,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F16 => (
            cublas::cudaDataType::CUDA_R_16F,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::BF16 => (
            cublas::cudaDataType::CUDA_R_16BF,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F64 => (
            cublas::cudaDataType::CUDA_R_64F,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_64F,
        ),
        other => {
            return Err(Error::UnsupportedDType(format!(
                "matmul on CUDA is defined for float16, bfloat16, float32 and float64, not {other}"
            )));
        }
    };
    let ordinal = req.out.device().index() as i32;
    let _ctx = context(ordinal)?;
    let stream = current_stream(ordinal);
    if req.k == 0 {
        // Sums of nothing.
        // SAFETY: `out` is a new compact array of `nbytes` bytes the request lets us write; the
        // fill is ordered on the current stream.
        let filled = unsafe {
            result::memset_d8_async(
                first_address(req.out) as u64,
                0,
                req.out.nbytes(),
                raw(stream),
            )
        };
        return filled.named("cuMemsetD8Async");
    }
    library()?;
    // Alpha and beta in the compute type, on the host.
    let (one, zero): ([u8; 8], [u8; 8]) = if dtype == DType::F64 {
        (1f64.to_le_bytes(), 0f64.to_le_bytes())
    } else {
        let mut o = [0u8; 8];
        o[..4].copy_from_slice(&1f32.to_le_bytes());
        (o, [0u8; 8])
    };
    // Column-major Cᵀ (n × m) = Bᵀ (n × k) · Aᵀ (k × m).
    let (b, a) = (operand(&req.b_layout), operand(&req.a_layout));
    let (m, n, k) = (req.n as i64, req.m as i64, req.k as i64);
    let ldc = req.n.max(1) as i64;
    let stride_c = (req.m * req.n) as i64;
    let batch = req.batch as i64;
    let workspace = super::allocate(Device::cuda(ordinal as u32), WORKSPACE, false)?;
    let small = [m, n, k, b.ld, a.ld, ldc, batch]
        .iter()
        .all(|&v| v <= i32::MAX as i64);
    with_handle(ordinal, |handle| {
        // SAFETY: a live handle of the bound device, used by this thread alone; the stream
        // belongs to that device (the caller's current stream).
        let rc = unsafe { cublas::cublasSetStream_v2(handle, raw(stream).cast()) };
        status(rc, "cublasSetStream")?;
        // SAFETY: `WORKSPACE` bytes of device memory held until this function returns; the pool
        // fences them on this stream when they go back, so the product's kernels finish first.
        let rc = unsafe { cublas::cublasSetWorkspace_v2(handle, workspace.handle(), WORKSPACE) };
        status(rc, "cublasSetWorkspace")?;
        let (pa, pb, pc) = (
            first_address(req.b),
            first_address(req.a),
            first_address(req.out),
        );
        let (pa, pb): (*const c_void, *const c_void) = (
            std::ptr::with_exposed_provenance(pa),
            std::ptr::with_exposed_provenance(pb),
        );
        let pc: *mut c_void = std::ptr::with_exposed_provenance_mut(pc);
        let rc = if small {
            // SAFETY: the layouts are BLAS-compatible (the request's contract) and described by
            // `operand`: every element cuBLAS reads lies in the live views `a` and `b`, and it
            // writes the `batch × m × n` compact elements of `out`, which the request lets us
            // write. Alpha and beta are host values of the compute type.
            unsafe {
                cublas::cublasGemmStridedBatchedEx(
                    handle,
                    b.op,
                    a.op,
                    m as i32,
                    n as i32,
                    k as i32,
                    one.as_ptr().cast(),
                    pa,
                    data,
                    b.ld as i32,
                    req.b_layout.batch_stride as i64,
                    pb,
                    data,
                    a.ld as i32,
                    req.a_layout.batch_stride as i64,
                    zero.as_ptr().cast(),
                    pc,
                    data,
                    ldc as i32,
                    stride_c,
                    batch as i32,
                    compute,
                    cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        } else {
            // SAFETY: as above, with 64-bit extents.
            unsafe {
                cublas::cublasGemmStridedBatchedEx_64(
                    handle,
                    b.op,
                    a.op,
                    m,
                    n,
                    k,
                    one.as_ptr().cast(),
                    pa,
                    data,
                    b.ld,
                    req.b_layout.batch_stride as i64,
                    pb,
                    data,
                    a.ld,
                    req.a_layout.batch_stride as i64,
                    zero.as_ptr().cast(),
                    pc,
                    data,
                    ldc,
                    stride_c,
                    batch,
                    compute,
                    cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        };
        status(rc, "cublasGemmStridedBatchedEx")
    })?;
    drop(workspace);
    Ok(())
}
