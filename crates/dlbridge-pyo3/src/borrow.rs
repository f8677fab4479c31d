//! Borrow tracking shared by every extension in the process that links this crate: mutable
//! access to a range of bytes is exclusive, shared access excludes mutable access, whichever
//! extension (or which copy of this crate) hands the access out.
//!
//! The first user publishes a registry, a C struct of function pointers over state in its own
//! library (CPython never unloads extension modules, so both live for the process), as the
//! capsule `registry_v1` of a module object at `sys.modules["_dlbridge_borrows"]`. Later users,
//! in other extensions, find it there and call the same functions. A later version adds fields
//! after these (the `version` says which are there) and keeps these working, so extensions built
//! against different versions still see each other's borrows.
//!
//! Ranges are compared by their device and their byte extent: two views whose extents overlap
//! conflict even when their strides would interleave without touching (conservative).

use std::cell::UnsafeCell;
use std::ffi::{CStr, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyModule};
use pyo3::{ffi, intern};

/// A borrowed byte range on a device.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Range {
    /// DLPack device type.
    pub(crate) device_type: i32,
    /// DLPack device id.
    pub(crate) device_id: i32,
    /// First byte's address.
    pub(crate) start: u64,
    /// One past the last byte's address.
    pub(crate) end: u64,
}

impl Range {
    fn overlaps(&self, other: &Range) -> bool {
        self.device_type == other.device_type
            && self.device_id == other.device_id
            && self.start < other.end
            && other.start < self.end
    }
}

/// The registry's C face, version 1.
#[repr(C)]
struct RegistryV1 {
    /// 1.
    version: u32,
    /// Records a borrow of `range` (`exclusive`: mutable); returns 0, or 1 when it conflicts
    /// with a live borrow (and records nothing).
    acquire: unsafe extern "C" fn(range: *const Range, exclusive: c_int) -> c_int,
    /// Forgets one borrow recorded by `acquire` with the same arguments.
    release: unsafe extern "C" fn(range: *const Range, exclusive: c_int),
}

const CAPSULE_NAME: &CStr = c"dlbridge_pyo3.borrows.registry_v1";

/// The borrows recorded by this library's registry (used only if this library published it),
/// behind a spin lock: every critical section is a short scan and a push or a swap-remove, which
/// the GIL (where there is one) already keeps from contending, and a spin lock's release is a
/// plain store where a mutex's is a second atomic exchange (one argument call takes and releases
/// the lock twice).
static BORROWS: SpinLock<Vec<(Range, bool)>> = SpinLock::new(Vec::new());

unsafe extern "C" fn acquire(range: *const Range, exclusive: c_int) -> c_int {
    // SAFETY: callers pass a valid `Range`.
    let range = unsafe { *range };
    let exclusive = exclusive != 0;
    BORROWS.with(|borrows| {
        let conflict = borrows
            .iter()
            .any(|(r, x)| (exclusive || *x) && r.overlaps(&range));
        if conflict {
            return 1;
        }
        borrows.push((range, exclusive));
        0
    })
}

unsafe extern "C" fn release(range: *const Range, exclusive: c_int) {
    // SAFETY: callers pass a valid `Range`.
    let range = unsafe { *range };
    let exclusive = exclusive != 0;
    BORROWS.with(|borrows| {
        if let Some(i) = borrows.iter().rposition(|b| *b == (range, exclusive)) {
            borrows.swap_remove(i);
        }
    });
}

/// A lock for short critical sections that never panic: taken by an atomic exchange, released by
/// a store.
struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through `with`, which holds the lock, so one thread at a time
// has it; `T: Send` lets it be used from whichever thread holds the lock.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    const fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Runs `f` on the value with the lock held. `f` must not panic (the lock would stay taken):
    /// the registry's closures only compare, push and swap-remove (a failed allocation aborts).
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        while self.locked.swap(true, Ordering::Acquire) {
            while self.locked.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        }
        // SAFETY: the lock is held, so no other reference to the value exists until it is
        // released below.
        let r = f(unsafe { &mut *self.value.get() });
        self.locked.store(false, Ordering::Release);
        r
    }
}

/// This library's registry, published if no other is.
struct Table(RegistryV1);

// SAFETY: immutable: a version number and two function pointers.
unsafe impl Sync for Table {}

static OWN: Table = Table(RegistryV1 {
    version: 1,
    acquire,
    release,
});

/// The process's registry (found or published once).
#[derive(Clone, Copy)]
struct Shared(&'static RegistryV1);

// SAFETY: the registry is immutable and lives for the process (see the module docs); its
// functions lock their own state.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

static REGISTRY: OnceLock<Shared> = OnceLock::new();

#[inline]
fn registry(py: Python<'_>) -> PyResult<&'static RegistryV1> {
    if let Some(r) = REGISTRY.get() {
        return Ok(r.0);
    }
    let found = find_or_publish(py)?;
    Ok(REGISTRY.get_or_init(|| Shared(found)).0)
}

fn find_or_publish(py: Python<'_>) -> PyResult<&'static RegistryV1> {
    let modules = py
        .import(intern!(py, "sys"))?
        .getattr(intern!(py, "modules"))?;
    let key = intern!(py, "_dlbridge_borrows");
    let holder = match modules.get_item(key) {
        Ok(m) => m,
        Err(_) => {
            let m = PyModule::new(py, "_dlbridge_borrows")?;
            modules.set_item(key, &m)?;
            m.into_any()
        }
    };
    let attr = intern!(py, "registry_v1");
    if let Ok(capsule) = holder.getattr(attr)
        && let Ok(capsule) = capsule.cast::<PyCapsule>()
    {
        // SAFETY: a live capsule; `IsValid` only compares the name and never raises.
        if unsafe { ffi::PyCapsule_IsValid(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) } == 1 {
            // SAFETY: the name matched, so the stored pointer comes back without an exception.
            let ptr = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) };
            // SAFETY: a capsule of this name holds a `RegistryV1` (or a later version that starts
            // with it) that lives for the process, as the module docs say.
            return Ok(unsafe { &*ptr.cast::<RegistryV1>() });
        }
    }
    let ptr = (&raw const OWN.0).cast_mut().cast::<c_void>();
    // SAFETY: the pointer is to a static that lives for the process; the name is static; no
    // destructor is needed.
    let raw = unsafe { ffi::PyCapsule_New(ptr, CAPSULE_NAME.as_ptr(), None) };
    if raw.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new, owned reference.
    let capsule = unsafe { Bound::from_owned_ptr(py, raw) };
    holder.setattr(attr, capsule)?;
    Ok(&OWN.0)
}

/// A live borrow, released when dropped.
#[derive(Debug)]
pub(crate) struct Borrow {
    range: Range,
    exclusive: bool,
    registry: &'static RegistryV1,
}

impl std::fmt::Debug for RegistryV1 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegistryV1")
    }
}

impl Borrow {
    /// Records a borrow of `range`, or says which argument conflicts (`BufferError`).
    #[inline]
    pub(crate) fn acquire(
        py: Python<'_>,
        name: &str,
        range: Range,
        exclusive: bool,
    ) -> PyResult<Borrow> {
        let registry = registry(py)?;
        // SAFETY: a valid range; the registry's functions never unwind.
        let rc = unsafe { (registry.acquire)(&range, c_int::from(exclusive)) };
        if rc != 0 {
            return Err(conflict(name, exclusive));
        }
        Ok(Borrow {
            range,
            exclusive,
            registry,
        })
    }
}

/// The refusal of a borrow that conflicts with a live one.
#[cold]
#[inline(never)]
fn conflict(name: &str, exclusive: bool) -> PyErr {
    let what = if exclusive {
        "mutably: its memory is already borrowed"
    } else {
        "its memory is already borrowed mutably"
    };
    PyBufferError::new_err(format!(
        "argument '{name}': cannot borrow the array {what} (by this or another argument, or a \
         view still held)"
    ))
}

impl Drop for Borrow {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the same arguments `acquire` recorded; the registry's functions never unwind.
        unsafe { (self.registry.release)(&self.range, c_int::from(self.exclusive)) };
    }
}
