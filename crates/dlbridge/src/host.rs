//! Facts of the host that code on every level asks for (the CPU backend, the shared files of
//! `share/`, the loaders' page arithmetic), in a file that imports nothing of the crate.

use std::sync::OnceLock;

/// The OS page size in bytes, read once.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions; it returns -1 on error, handled below.
        let raw = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if raw > 0 && (raw as usize).is_power_of_two() {
            raw as usize
        } else {
            4096
        }
    })
}
