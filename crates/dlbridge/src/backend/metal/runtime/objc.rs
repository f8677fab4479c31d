//! Thin layer over the Objective-C objects: thread-safety wrappers with their justifications,
//! error text, and turning a DLPack handle back into an `id<MTLBuffer>`.

use std::ffi::c_void;
use std::ops::Deref;

use objc2::rc::Retained;
use objc2::runtime::{AnyObject, AnyProtocol, NSObjectProtocol, ProtocolObject};
use objc2_foundation::NSError;
use objc2_metal::{MTLAllocation, MTLBuffer, MTLCommandBuffer, MTLResidencySet};

use crate::error::Error;

/// The `Driver` error of this backend.
pub(crate) fn driver(message: impl Into<String>) -> Error {
    Error::Driver {
        backend: "Metal",
        message: message.into(),
    }
}

/// The text of an `NSError`.
pub(crate) fn ns_error(what: &str, err: &NSError) -> Error {
    driver(format!("{what}: {}", err.localizedDescription()))
}

/// A retained `id<MTLBuffer>`.
#[derive(Clone, Debug)]
pub(crate) struct MetalBuffer(pub(crate) Retained<ProtocolObject<dyn MTLBuffer>>);

// SAFETY: Objective-C reference counting is atomic, so the retain this value holds may move to and
// be released on any thread. Metal resources may be referenced from any thread; what needs
// synchronization is their *contents*, which dlbridge reaches only through `Tensor` (bounds and
// aliasing checks) and through command buffers encoded under the device's queue lock.
unsafe impl Send for MetalBuffer {}
// SAFETY: shared references only read immutable properties (`length`, `storageMode`, `contents`
// address) or hand the object to encoders under the queue lock; see `Send`.
unsafe impl Sync for MetalBuffer {}

impl Deref for MetalBuffer {
    type Target = ProtocolObject<dyn MTLBuffer>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl MetalBuffer {
    /// The DLPack handle: the `id<MTLBuffer>` pointer itself.
    pub(crate) fn handle(&self) -> *mut c_void {
        Retained::as_ptr(&self.0).cast_mut().cast()
    }

    /// The buffer as an `MTLAllocation` (for residency sets).
    pub(crate) fn as_allocation(&self) -> &ProtocolObject<dyn MTLAllocation> {
        ProtocolObject::from_ref(&*self.0)
    }

    /// Retains the buffer a DLPack handle names, after checking that the object conforms to
    /// `MTLBuffer`.
    ///
    /// # Safety
    /// `handle` must be NULL or a live Objective-C object (DLPack promises an `id<MTLBuffer>` for
    /// `kDLMetal`; a pointer that is no object at all cannot be detected).
    pub(crate) unsafe fn retain_handle(handle: *mut c_void) -> Result<Self, Error> {
        if handle.is_null() {
            return Err(Error::MalformedTensor(
                "a Metal tensor with elements has a NULL id<MTLBuffer>".into(),
            ));
        }
        // SAFETY: the caller guarantees a live object; `retain` adds a reference we own.
        let object = unsafe { Retained::retain(handle.cast::<AnyObject>()) }
            .ok_or_else(|| Error::MalformedTensor("NULL id<MTLBuffer>".into()))?;
        if let Some(protocol) = AnyProtocol::get(c"MTLBuffer") {
            // SAFETY: `AnyObject` is a valid receiver of NSObject's `conformsToProtocol:` (every
            // Objective-C object answers it).
            let conforms = unsafe { object_conforms(&object, protocol) };
            if !conforms {
                return Err(Error::MalformedTensor(format!(
                    "the kDLMetal data pointer {handle:p} is an Objective-C object that is not an \
                     id<MTLBuffer> (DLPack's Metal `data` is the buffer object, not its contents)"
                )));
            }
        }
        // SAFETY: the object conforms to MTLBuffer (checked above when the runtime knows the
        // protocol, which it does once Metal is loaded); the cast keeps the retain.
        let buffer = unsafe { Retained::cast_unchecked::<ProtocolObject<dyn MTLBuffer>>(object) };
        Ok(MetalBuffer(buffer))
    }
}

/// `[object conformsToProtocol:protocol]`.
///
/// # Safety
/// `object` must be a live Objective-C object inheriting from NSObject or NSProxy.
unsafe fn object_conforms(object: &AnyObject, protocol: &AnyProtocol) -> bool {
    // SAFETY: forwarded: NSObject's protocol methods are answered by every such object.
    let object: &ProtocolObject<dyn NSObjectProtocol> =
        unsafe { &*(object as *const AnyObject).cast() };
    object.conformsToProtocol(protocol)
}

/// Borrows the `id<MTLBuffer>` behind a handle without retaining it.
///
/// # Safety
/// `handle` must be a live `id<MTLBuffer>` that outlives `'a` (a dlbridge Metal buffer's handle,
/// kept alive by its `Buffer`, or one checked by [`MetalBuffer::retain_handle`]).
pub(crate) unsafe fn borrow_buffer<'a>(handle: *mut c_void) -> &'a ProtocolObject<dyn MTLBuffer> {
    // SAFETY: forwarded.
    unsafe { &*handle.cast::<ProtocolObject<dyn MTLBuffer>>() }
}

/// A retained command buffer.
#[derive(Clone)]
pub(crate) struct CommandBuffer(pub(crate) Retained<ProtocolObject<dyn MTLCommandBuffer>>);

// SAFETY: reference counting is atomic; a command buffer is encoded into and committed only under
// its device's queue lock, and `waitUntilCompleted`/`status`/`error` are documented as callable from
// any thread once it is committed.
unsafe impl Send for CommandBuffer {}
// SAFETY: shared references are used only for `waitUntilCompleted`, `status` and `error`, which
// Metal allows from any thread (see `Send`).
unsafe impl Sync for CommandBuffer {}

impl Deref for CommandBuffer {
    type Target = ProtocolObject<dyn MTLCommandBuffer>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// A retained residency set.
pub(crate) struct ResidencySet(pub(crate) Retained<ProtocolObject<dyn MTLResidencySet>>);

// SAFETY: reference counting is atomic; every method of the set is called with the device's queue
// lock held, so the set is never used from two threads at once.
unsafe impl Send for ResidencySet {}
// SAFETY: as for `Send`: shared references call methods only under the queue lock.
unsafe impl Sync for ResidencySet {}

impl Deref for ResidencySet {
    type Target = ProtocolObject<dyn MTLResidencySet>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}
