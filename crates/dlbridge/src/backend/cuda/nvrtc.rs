//! Run-time compilation with NVRTC, and loading what it makes into a device's context.
//!
//! NVRTC is loaded at run time like the driver (cudarc's `dynamic-loading`; it finds
//! `libnvrtc.so.13` among other names). A machine without it gets [`Error::BackendUnavailable`]
//! from the first compilation, never a panic: the library's presence is checked before any of its
//! symbols is touched, and only entry points NVRTC has had since CUDA 11.2 are called.
//!
//! Code is built for the device's own architecture (`--gpu-architecture=sm_XY`) into machine code
//! (CUBIN), so loading it costs no JIT; where this NVRTC does not know the device, it emits PTX for
//! the newest architecture it knows and the driver finishes the job at load.

use std::ffi::{CStr, CString, c_char, c_int};
use std::sync::OnceLock;

use cudarc::driver::result::{DriverError, module};
use cudarc::driver::sys as driver;
use cudarc::nvrtc::sys;

use super::BACKEND;
use super::driver::Named;
use crate::error::{Error, Result};

/// What NVRTC offers on this machine: its version and the real architectures it can build for.
struct Library {
    version: (i32, i32),
    archs: Vec<i32>,
}

fn library() -> Result<&'static Library> {
    static LIBRARY: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    LIBRARY
        .get_or_init(load_library)
        .as_ref()
        .map_err(|reason| Error::BackendUnavailable {
            backend: BACKEND,
            reason: reason.clone(),
        })
}

fn load_library() -> std::result::Result<Library, String> {
    // SAFETY: only tries to open the library under its known names; no symbol is used yet.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "NVRTC (libnvrtc.so.13) was not found: dlbridge compiles its CUDA kernels at run time \
             and needs the CUDA 13 run-time compiler; install it (e.g. the pip package \
             nvidia-cuda-nvrtc or the CUDA toolkit) or add its folder to LD_LIBRARY_PATH"
                .into(),
        );
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: valid out-pointers; the library is present (checked above).
    let rc = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {}", error_string(rc)));
    }
    let mut count: c_int = 0;
    // SAFETY: a valid out-pointer.
    let rc = unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) };
    let mut archs = vec![0 as c_int; count.max(0) as usize];
    if rc == sys::nvrtcResult::NVRTC_SUCCESS && !archs.is_empty() {
        // SAFETY: the buffer holds `count` integers, as many as NVRTC said it writes.
        let rc = unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
        if rc != sys::nvrtcResult::NVRTC_SUCCESS {
            archs.clear();
        }
    }
    Ok(Library {
        version: (major, minor),
        archs,
    })
}

fn error_string(rc: sys::nvrtcResult) -> String {
    // SAFETY: NVRTC returns a static NUL-terminated string for every result code.
    let text = unsafe { sys::nvrtcGetErrorString(rc) };
    if text.is_null() {
        format!("NVRTC error {}", rc as u32)
    } else {
        // SAFETY: non-NULL, static and NUL-terminated (above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The `--gpu-architecture` option for a device of compute capability `arch`: `sm_XY` when this
/// NVRTC builds machine code for it, else `compute_XY` of the newest architecture it knows at or
/// below the device's (PTX, which the driver compiles when the module is loaded).
pub(crate) fn arch_option(arch: (i32, i32)) -> Result<String> {
    let lib = library()?;
    let want = arch.0 * 10 + arch.1;
    if lib.archs.is_empty() || lib.archs.contains(&want) {
        return Ok(format!("--gpu-architecture=sm_{want}"));
    }
    match lib.archs.iter().copied().filter(|&a| a <= want).max() {
        Some(best) => Ok(format!("--gpu-architecture=compute_{best}")),
        None => Err(Error::BackendUnavailable {
            backend: BACKEND,
            reason: format!(
                "NVRTC {}.{} cannot build for this GPU (sm_{want}); it knows {:?}",
                lib.version.0, lib.version.1, lib.archs
            ),
        }),
    }
}

/// Whether `options` already name a target architecture.
pub(crate) fn names_arch(options: &[String]) -> bool {
    options.iter().any(|o| {
        o.starts_with("--gpu-architecture") || o.starts_with("-arch") || o.starts_with("--gpu-name")
    })
}

/// Compiled code, ready for [`load`]: machine code, or NUL-terminated PTX.
pub(crate) struct Image {
    bytes: Vec<u8>,
    /// The lowered (mangled) name of each name expression, in order.
    pub(crate) lowered: Vec<String>,
}

/// An NVRTC program, destroyed when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed only here.
        let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

impl Program {
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        let rc = unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut size) };
        if rc != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return String::new();
        }
        let mut log = vec![0u8; size];
        // SAFETY: the buffer holds the `size` bytes NVRTC said the log takes (NUL included).
        let rc = unsafe { sys::nvrtcGetProgramLog(self.0, log.as_mut_ptr().cast::<c_char>()) };
        if rc != sys::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        String::from_utf8_lossy(&log[..end]).trim_end().to_string()
    }
}

/// Compiles `source` with `options` (which should name the architecture, see [`arch_option`]),
/// registering `expressions` (kernel names, `extern "C"` or C++) so that their lowered names can be
/// looked up. `entry` names the kernel in errors.
///
/// # Errors
/// [`Error::Compile`] with NVRTC's log when the source or the options are rejected;
/// [`Error::InvalidArgument`] when NVRTC could not resolve a name expression;
/// [`Error::BackendUnavailable`] without NVRTC.
pub(crate) fn compile(
    source: &str,
    entry: &str,
    options: &[String],
    expressions: &[&str],
) -> Result<Image> {
    library()?;
    let failed = |call: &str, rc: sys::nvrtcResult| Error::Driver {
        backend: BACKEND,
        message: format!("{call} failed: {}", error_string(rc)),
    };
    let text = CString::new(source).map_err(|_| {
        Error::InvalidArgument(format!("the source of `{entry}` contains a NUL byte"))
    })?;
    let file =
        CString::new(format!("{}.cu", sanitize(entry))).expect("sanitized names have no NUL");
    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid out-pointer and NUL-terminated strings that outlive the call; no headers.
    let rc = unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            text.as_ptr(),
            file.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(failed("nvrtcCreateProgram", rc));
    }
    let program = Program(raw);
    let names: Vec<CString> = expressions
        .iter()
        .map(|e| {
            CString::new(*e).map_err(|_| {
                Error::InvalidArgument(format!("the kernel name {e:?} contains a NUL byte"))
            })
        })
        .collect::<Result<_>>()?;
    for name in &names {
        // SAFETY: a live program, before compilation; NVRTC copies the string.
        let rc = unsafe { sys::nvrtcAddNameExpression(program.0, name.as_ptr()) };
        if rc != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(failed("nvrtcAddNameExpression", rc));
        }
    }
    let opts: Vec<CString> = options
        .iter()
        .map(|o| {
            CString::new(o.as_str()).map_err(|_| {
                Error::InvalidArgument(format!("the NVRTC option {o:?} contains a NUL byte"))
            })
        })
        .collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: a live program; `opt_ptrs` holds `len` NUL-terminated strings that outlive the call.
    let rc =
        unsafe { sys::nvrtcCompileProgram(program.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    match rc {
        sys::nvrtcResult::NVRTC_SUCCESS => {}
        sys::nvrtcResult::NVRTC_ERROR_COMPILATION
        | sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION => {
            let mut log = program.log();
            if log.is_empty() {
                log = format!("{} (options {options:?})", error_string(rc));
            }
            return Err(Error::Compile {
                backend: BACKEND,
                name: entry.to_string(),
                log,
            });
        }
        rc => return Err(failed("nvrtcCompileProgram", rc)),
    }
    let mut lowered = Vec::with_capacity(names.len());
    for (name, expr) in names.iter().zip(expressions) {
        let mut out: *const c_char = std::ptr::null();
        // SAFETY: a compiled program and a name expression added before compiling; the returned
        // string belongs to the program, which is alive while it is copied below.
        let rc = unsafe { sys::nvrtcGetLoweredName(program.0, name.as_ptr(), &mut out) };
        if rc != sys::nvrtcResult::NVRTC_SUCCESS || out.is_null() {
            return Err(Error::InvalidArgument(format!(
                "`{expr}` names no kernel of the program ({})",
                error_string(rc)
            )));
        }
        // SAFETY: non-NULL and NUL-terminated, owned by the live program.
        lowered.push(
            unsafe { CStr::from_ptr(out) }
                .to_string_lossy()
                .into_owned(),
        );
    }
    let bytes = machine_code(&program)
        .or_else(|| ptx(&program))
        .ok_or_else(|| Error::Driver {
            backend: BACKEND,
            message: format!("NVRTC compiled `{entry}` but returned neither CUBIN nor PTX"),
        })?;
    Ok(Image { bytes, lowered })
}

/// The program's CUBIN, when it was built for a real architecture.
fn machine_code(program: &Program) -> Option<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: a compiled program and a valid out-pointer.
    let rc = unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return None;
    }
    let mut bytes = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes NVRTC reported.
    let rc = unsafe { sys::nvrtcGetCUBIN(program.0, bytes.as_mut_ptr().cast::<c_char>()) };
    (rc == sys::nvrtcResult::NVRTC_SUCCESS).then_some(bytes)
}

/// The program's PTX, NUL-terminated.
fn ptx(program: &Program) -> Option<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: a compiled program and a valid out-pointer.
    let rc = unsafe { sys::nvrtcGetPTXSize(program.0, &mut size) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return None;
    }
    let mut bytes = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes NVRTC reported (the terminating NUL included).
    let rc = unsafe { sys::nvrtcGetPTX(program.0, bytes.as_mut_ptr().cast::<c_char>()) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return None;
    }
    if bytes.last() != Some(&0) {
        bytes.push(0);
    }
    Some(bytes)
}

/// A file name for NVRTC's messages made of the entry's name.
fn sanitize(entry: &str) -> String {
    let name: String = entry
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if name.is_empty() {
        "kernel".into()
    } else {
        name
    }
}

/// A module loaded into a device's primary context. Modules stay loaded for the life of the
/// process: the caches that hold them never drop them, and kernels may still run from them.
#[derive(Clone, Copy)]
pub(crate) struct Module(driver::CUmodule);

// SAFETY: a module handle may be used from any thread; it is never unloaded (see above).
unsafe impl Send for Module {}
// SAFETY: as above; it is never mutated.
unsafe impl Sync for Module {}

/// A kernel of a loaded [`Module`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Function(pub(crate) driver::CUfunction);

// SAFETY: a function handle of a module that is never unloaded may be used from any thread; the
// driver serialises attribute changes.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

/// Loads `image` into the context current on the calling thread (the caller holds its
/// [`Bound`](super::Bound) guard).
pub(crate) fn load(image: &Image) -> Result<Module> {
    // SAFETY: `image.bytes` is CUBIN or NUL-terminated PTX as NVRTC made it, alive during the
    // call (the driver copies it); a context is current (the caller's guard).
    let loaded = unsafe { module::load_data(image.bytes.as_ptr().cast()) };
    Ok(Module(loaded.named("cuModuleLoadData")?))
}

impl Module {
    /// The kernel named `name` (a lowered name), or `None` when the module has none.
    pub(crate) fn function(&self, name: &str) -> Result<Option<Function>> {
        let cname = CString::new(name).map_err(|_| {
            Error::InvalidArgument(format!("the kernel name {name:?} contains a NUL byte"))
        })?;
        // SAFETY: a loaded module, never unloaded.
        match unsafe { module::get_function(self.0, cname) } {
            Ok(f) => Ok(Some(Function(f))),
            Err(DriverError(driver::CUresult::CUDA_ERROR_NOT_FOUND)) => Ok(None),
            Err(e) => Err(e).named(&format!("cuModuleGetFunction({name})")),
        }
    }
}
