//! The shared-memory handle decoder (`SharedHandle::from_bytes`) on hostile bytes, without
//! opening anything.
//!
//! The first byte picks whether a descriptor travels beside the bytes (bit 0: a duplicate of an
//! open file, as `recv_handle` would hand over); the rest are the handle's bytes. When the
//! decoder accepts them, every promise it makes is checked independently:
//! - `kind_of_bytes` names the same memory kind without building the handle;
//! - the handle has exactly one way to its descriptor (the one given, or a ticket);
//! - the layout has at most `MAX_NDIM` dimensions and a byte range that fits in `isize`;
//! - the handle re-encodes to bytes that decode to the same handle, and re-encode identically.
//!
//! Dropping a decoded handle with a ticket tells the lender its name gives (a connection attempt
//! to an abstract socket that is not there): nothing may panic, leak or block.

#![no_main]

use std::os::fd::OwnedFd;
use std::sync::OnceLock;

use dlbridge::layout::MAX_NDIM;
use dlbridge::share::SharedHandle;
use libfuzzer_sys::fuzz_target;

/// A descriptor to hand the decoder: a duplicate of one file opened once.
fn descriptor() -> OwnedFd {
    static FILE: OnceLock<std::fs::File> = OnceLock::new();
    FILE.get_or_init(|| std::fs::File::open("/dev/null").expect("/dev/null"))
        .try_clone()
        .expect("dup")
        .into()
}

fn same(a: &SharedHandle, b: &SharedHandle) {
    assert_eq!(a.kind(), b.kind());
    assert_eq!(a.device(), b.device());
    assert_eq!(a.dtype(), b.dtype());
    assert_eq!(a.layout(), b.layout());
    assert_eq!(a.allocation_len(), b.allocation_len());
    assert_eq!(a.is_read_only(), b.is_read_only());
    assert_eq!(a.pid(), b.pid());
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, bytes)) = data.split_first() else {
        return;
    };
    let with_fd = mode & 1 == 1;
    let kind = SharedHandle::kind_of_bytes(bytes);
    let Ok(handle) = SharedHandle::from_bytes(bytes, with_fd.then(descriptor)) else {
        return;
    };
    assert_eq!(kind.ok(), Some(handle.kind()), "kind_of_bytes disagrees");
    assert_eq!(handle.fd().is_some(), with_fd);
    let layout = handle.layout();
    assert!(layout.ndim() <= MAX_NDIM);
    assert_eq!(layout.shape().len(), layout.strides().len());
    let _ = layout.byte_range(handle.dtype().itemsize().max(1));

    let encoded = handle.to_bytes();
    let again = SharedHandle::from_bytes(&encoded, with_fd.then(descriptor))
        .expect("a decoded handle's bytes decode again");
    same(&handle, &again);
    assert_eq!(again.to_bytes(), encoded, "encoding is not stable");
});
