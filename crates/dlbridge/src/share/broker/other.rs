//! Where descriptors cannot be lent (no abstract Unix sockets): every lend and claim is refused,
//! and handles travel with their descriptor beside them (`send_handle`).

use std::os::fd::OwnedFd;

use super::{Ticket, Wait};
use crate::error::{Error, Result};

fn unsupported() -> Error {
    Error::UnsupportedDevice(
        "lending descriptors between processes needs Linux; send the handle with its descriptor \
         (dlbridge::share::send_handle)"
            .into(),
    )
}

/// Refused: see the module.
pub fn lend(_fd: OwnedFd, _tag: u64) -> Result<Ticket> {
    Err(unsupported())
}

/// Refused: see the module.
pub fn claim(_ticket: &Ticket, _tag: u64, _wait: &Wait<'_>) -> Result<OwnedFd> {
    Err(unsupported())
}

/// Refused: see the module.
pub fn redeem(_ticket: &Ticket, _tag: u64, _wait: &Wait<'_>) -> Result<()> {
    Err(unsupported())
}

/// Nothing was lent, so nothing is given back.
pub fn forgo(_ticket: &Ticket, _tag: u64) {}

/// Nothing is lent.
pub fn outstanding() -> usize {
    0
}
