//! The safetensors header parser on hostile files.
//!
//! The first byte picks how the rest is read: as a whole file (length prefix, header and data as
//! the bytes say), or as header JSON that gets a correct length prefix and a data section of
//! `second byte * 4` zero bytes (so the fuzzer reaches the JSON and range checks quickly). When
//! `Header::parse` accepts a file, every promise it makes is checked independently:
//! - every tensor's bytes lie inside the data section, and the absolute range is the relative one
//!   shifted by `8 + N`;
//! - a tensor's length is its dtype's bits times its element count, in whole bytes;
//! - the tensors tile the data section: sorted by byte range, each begins where the one before
//!   it ends, the first at 0 and the last at the section's end (no overlap, no hole, no trailing
//!   bytes);
//! - every dtype has a safetensors name that maps back to it.
//!
//! Nothing may panic, overflow, or take long (the JSON nesting depth is bounded by `serde_json`).

#![no_main]

use std::path::Path;

use dlbridge::safetensors::{Header, PREFIX_LEN, dtype_from_name, dtype_name};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let file = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let Some((&data_words, json)) = rest.split_first() else {
            return;
        };
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json);
        file.resize(file.len() + usize::from(data_words) * 4, 0);
        file
    };
    // Sometimes claim a longer file than the bytes given (the reader's view of a file whose data
    // is not in memory): the parser must only look at the header bytes.
    let file_len = file.len() as u64 + if mode & 2 == 0 { 0 } else { u64::from(mode >> 2) };
    let Ok(header) = Header::parse(&file, file_len, Path::new("fuzz.safetensors")) else {
        return;
    };
    let data_start = header.data_start();
    assert_eq!(data_start, PREFIX_LEN + header.header_len());
    assert!(data_start <= file_len);
    let data_len = file_len - data_start;
    let mut spans = Vec::new();
    for (name, info) in header.tensors() {
        let rel = info.data_offsets();
        let abs = info.byte_range();
        assert!(rel.start <= rel.end && rel.end <= data_len, "{name}: {rel:?}");
        assert_eq!(abs.start, data_start + rel.start);
        assert_eq!(abs.end, data_start + rel.end);
        let numel = info
            .shape()
            .iter()
            .try_fold(1u128, |acc, &d| acc.checked_mul(d as u128))
            .expect("validated element count");
        let bits = numel * u128::from(info.dtype().bits());
        assert_eq!(bits % 8, 0, "{name}");
        assert_eq!(u128::from(info.nbytes()), bits / 8, "{name}");
        assert_eq!(info.numel() as u128, numel);
        let dtype_text = dtype_name(info.dtype()).expect("a parsed dtype has a name");
        assert_eq!(dtype_from_name(dtype_text), Some(info.dtype()));
        spans.push(rel);
    }
    spans.sort_by_key(|r| (r.start, r.end));
    let mut end = 0;
    for span in &spans {
        assert_eq!(span.start, end, "not tiled: {spans:?}");
        end = span.end;
    }
    assert_eq!(end, data_len, "bytes after the last tensor: {spans:?}");
});
