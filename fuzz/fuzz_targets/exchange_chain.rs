//! `exchange_table_v1` on chains of exchange tables built from fuzz bytes: up to 32 tables with
//! random versions, `prev_api` links to random tables (loops included) or NULL, and the import
//! function set or not. The lookup must return exactly the table a reference walk finds (the
//! first major-1 table within `EXCHANGE_CHAIN_LIMIT` links, if its import function is set) and
//! must terminate.

#![no_main]

use std::ffi::c_void;

use dlbridge::dlpack::ffi::{
    DLManagedTensorVersioned, DLPackExchangeAPI, DLPackExchangeAPIHeader, DLPackVersion,
};
use dlbridge::dlpack::{EXCHANGE_CHAIN_LIMIT, exchange_table_v1};
use fuzz_support::Input;
use libfuzzer_sys::fuzz_target;

/// Stands in for a producer's export function; the lookup must never call it.
unsafe extern "C" fn never_called(_: *mut c_void, _: *mut *mut DLManagedTensorVersioned) -> i32 {
    panic!("exchange_table_v1 called a table's function");
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let n = usize::from(input.below(32)) + 1;
    let mut tables: Vec<Box<DLPackExchangeAPI>> = Vec::with_capacity(n);
    let mut links = Vec::with_capacity(n);
    for _ in 0..n {
        let major = match input.u8() {
            b @ 0..=239 => u32::from(b % 3),
            _ => input.u32(),
        };
        let minor = u32::from(input.u8());
        links.push(input.u8());
        let set = input.u8() >= 64;
        tables.push(Box::new(DLPackExchangeAPI {
            header: DLPackExchangeAPIHeader {
                version: DLPackVersion { major, minor },
                prev_api: std::ptr::null_mut(),
            },
            managed_tensor_allocator: None,
            managed_tensor_from_py_object_no_sync: set.then_some(never_called as _),
            managed_tensor_to_py_object_no_sync: None,
            dltensor_from_py_object_no_sync: None,
            current_work_stream: None,
        }));
    }
    // Boxes do not move: link them by address now that all exist. A link byte naming no table is
    // NULL.
    let headers: Vec<*mut DLPackExchangeAPIHeader> =
        tables.iter_mut().map(|t| &raw mut t.header).collect();
    for (t, &link) in tables.iter_mut().zip(&links) {
        t.header.prev_api = headers
            .get(usize::from(link))
            .copied()
            .unwrap_or(std::ptr::null_mut());
    }
    let start_byte = input.u8();
    let start = headers
        .get(usize::from(start_byte))
        .copied()
        .unwrap_or(std::ptr::null_mut());

    // The reference walk, by index.
    let mut at = usize::from(start_byte);
    let mut want: Option<usize> = None;
    for _ in 0..EXCHANGE_CHAIN_LIMIT {
        let Some(t) = tables.get(at) else { break };
        if t.header.version.major == 1 {
            want = t
                .managed_tensor_from_py_object_no_sync
                .is_some()
                .then_some(at);
            break;
        }
        at = usize::from(links[at]);
    }

    // SAFETY: `start` and every link are NULL or headers of whole tables in `tables`, which live
    // and do not change until the end of this function.
    let got = unsafe { exchange_table_v1(start) };
    let got = got.map(|api| {
        let p: *const DLPackExchangeAPI = api;
        tables
            .iter()
            .position(|t| std::ptr::eq(&**t, p))
            .expect("the lookup returned a table that is not in the chain")
    });
    assert_eq!(got, want, "start {start_byte}, links {links:?}");
});
