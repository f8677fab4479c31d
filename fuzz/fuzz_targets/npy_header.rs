//! The `.npy` header parser and the `.npz` ZIP directory reader on hostile files.
//!
//! The first byte picks what the rest is: a whole `.npy` file (`NpyHeader::parse`), a header
//! dict given a correct magic, version and length (so the fuzzer reaches the literal's parser and
//! the dtype and shape checks quickly), or a whole `.npz` archive (`read_directory`, then each
//! stored member's header, as `load_npz` reads them). Both are pure functions of the bytes. When
//! they accept, every promise is checked independently:
//! - a header: its data begins after the header (inside the bytes given), its byte count is the
//!   element count times the item size (no overflow), at most `MAX_NDIM` axes, and its layout
//!   has the header's shape, row-major or column-major strides, and spans exactly the data;
//! - a directory: every member's data lies inside the archive, names are unique, and a stored
//!   member's length is its uncompressed length.
//!
//! Nothing may panic, overflow, or take long (the literal's nesting depth is bounded).

#![no_main]

use std::path::Path;

use dlbridge::MAX_NDIM;
use dlbridge::npy::{Compression, MAGIC, NpyHeader, read_directory};
use libfuzzer_sys::fuzz_target;

/// The header's promises (see the module doc), for a header parsed from `len` bytes.
fn check(header: &NpyHeader, len: usize) {
    assert!(
        header.data_offset() <= len as u64,
        "data before the header's end"
    );
    assert!(header.shape().len() <= MAX_NDIM);
    let numel = header
        .shape()
        .iter()
        .try_fold(1u128, |n, &d| n.checked_mul(d as u128))
        .expect("validated element count");
    let itemsize = header.dtype().itemsize();
    assert_eq!(
        u128::from(header.nbytes()),
        numel * itemsize as u128,
        "{header:?}"
    );
    assert!(header.nbytes() <= isize::MAX as u64);
    let layout = header.layout().expect("a parsed header has a layout");
    assert_eq!(layout.shape(), header.shape());
    if numel > 0 {
        let bytes = layout.byte_range(itemsize).expect("in range");
        assert_eq!(
            (bytes.start as u64, bytes.end as u64),
            (0, header.nbytes()),
            "{header:?}"
        );
        if header.fortran_order() {
            assert!(layout.is_f_contiguous(), "{header:?}");
        } else {
            assert!(layout.is_contiguous(), "{header:?}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => {
            if let Ok(header) = NpyHeader::parse(rest, Path::new("fuzz.npy")) {
                check(&header, rest.len());
            }
        }
        1 => {
            let mut file = MAGIC.to_vec();
            file.extend_from_slice(&[1, 0]);
            file.extend_from_slice(&(rest.len().min(u16::MAX as usize) as u16).to_le_bytes());
            file.extend_from_slice(rest);
            if let Ok(header) = NpyHeader::parse(&file, Path::new("fuzz.npy")) {
                check(&header, file.len());
            }
        }
        _ => {
            let Ok(members) = read_directory(rest, Path::new("fuzz.npz")) else {
                return;
            };
            for (i, m) in members.iter().enumerate() {
                assert!(m.data.start <= m.data.end && m.data.end <= rest.len() as u64);
                assert!(members[..i].iter().all(|other| other.name != m.name));
                if m.compression == Compression::Stored {
                    assert_eq!(m.data.end - m.data.start, m.uncompressed_len);
                    let bytes = &rest[m.data.start as usize..m.data.end as usize];
                    if let Ok(header) = NpyHeader::parse(bytes, Path::new("member.npy")) {
                        check(&header, bytes.len());
                    }
                }
            }
        }
    }
});
