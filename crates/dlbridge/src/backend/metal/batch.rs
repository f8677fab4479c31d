//! Command-buffer bookkeeping for one queue: which serial the open command buffer will carry,
//! when to commit it, and which serials the GPU has completed. Platform-free; the Metal runtime
//! drives it under its queue lock and from its completion handlers.
//!
//! Every command buffer dlbridge commits gets a serial (1, 2, 3, ...; 0 means "none"). Work is
//! batched: operations are encoded into one open command buffer, which is committed when it holds
//! [`Batch::max_ops`] operations, when the caller synchronizes, or when the host needs a result.
//! Completion handlers report serials as they finish; [`Completions`] turns them into a
//! watermark ("every serial up to here has completed") even if handlers arrive out of order, and
//! keeps GPU errors until someone synchronizes and can report them.

use std::collections::BTreeSet;

/// Serial numbers and the size of the open command buffer of one queue.
#[derive(Debug)]
pub(crate) struct Batch {
    /// The serial the open command buffer will carry when committed.
    open_serial: u64,
    /// Operations encoded into the open command buffer.
    open_ops: usize,
    /// The highest committed serial (0: none yet).
    committed: u64,
    max_ops: usize,
}

/// The result of recording one operation in the open command buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Recorded {
    /// The serial of the command buffer the operation went into.
    pub(crate) serial: u64,
    /// The batch is full: commit it now.
    pub(crate) commit_now: bool,
}

impl Batch {
    /// A queue on which nothing has been encoded; batches commit at `max_ops` operations (at
    /// least 1).
    pub(crate) fn new(max_ops: usize) -> Self {
        Batch {
            open_serial: 1,
            open_ops: 0,
            committed: 0,
            max_ops: max_ops.max(1),
        }
    }

    /// How many operations a command buffer holds before it is committed.
    #[cfg(test)]
    pub(crate) fn max_ops(&self) -> usize {
        self.max_ops
    }

    /// Records one operation encoded into the open command buffer.
    pub(crate) fn record(&mut self) -> Recorded {
        self.open_ops += 1;
        Recorded {
            serial: self.open_serial,
            commit_now: self.open_ops >= self.max_ops,
        }
    }

    /// Marks the open command buffer committed and returns its serial; `None` when it holds no
    /// operation (nothing to commit).
    pub(crate) fn commit(&mut self) -> Option<u64> {
        if self.open_ops == 0 {
            return None;
        }
        let serial = self.open_serial;
        self.committed = serial;
        self.open_serial += 1;
        self.open_ops = 0;
        Some(serial)
    }

    /// Whether operations wait in the open command buffer.
    #[cfg(test)]
    pub(crate) fn has_open_work(&self) -> bool {
        self.open_ops > 0
    }

    /// The highest committed serial (0: none).
    #[cfg(test)]
    pub(crate) fn committed(&self) -> u64 {
        self.committed
    }

    /// The serial of the last command buffer that may hold work encoded so far: the open one if
    /// it has operations, else the last committed one. Memory released now must not leave the
    /// GPU's residency before this serial completes.
    pub(crate) fn last_encoded(&self) -> u64 {
        if self.open_ops > 0 {
            self.open_serial
        } else {
            self.committed
        }
    }
}

/// Completed serials of one queue, as a watermark, and GPU errors not yet reported.
#[derive(Debug, Default)]
pub(crate) struct Completions {
    watermark: u64,
    ahead: BTreeSet<u64>,
    errors: Vec<String>,
}

impl Completions {
    /// Nothing completed yet.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Records that command buffer `serial` finished, with the GPU's error if it failed.
    pub(crate) fn complete(&mut self, serial: u64, error: Option<String>) {
        if let Some(e) = error {
            self.errors.push(format!("command buffer {serial}: {e}"));
        }
        if serial <= self.watermark {
            return;
        }
        self.ahead.insert(serial);
        while self.ahead.remove(&(self.watermark + 1)) {
            self.watermark += 1;
        }
    }

    /// Every serial up to and including this one has completed.
    pub(crate) fn watermark(&self) -> u64 {
        self.watermark
    }

    /// Whether `serial` (and everything before it) has completed.
    #[cfg(test)]
    pub(crate) fn is_complete(&self, serial: u64) -> bool {
        serial <= self.watermark
    }

    /// The GPU errors recorded since the last call.
    pub(crate) fn take_errors(&mut self) -> Vec<String> {
        std::mem::take(&mut self.errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_fill_and_commit() {
        let mut b = Batch::new(3);
        assert_eq!(b.last_encoded(), 0);
        assert_eq!(b.commit(), None, "an empty batch is not committed");
        assert_eq!(
            b.record(),
            Recorded {
                serial: 1,
                commit_now: false
            }
        );
        assert!(b.has_open_work());
        assert_eq!(b.last_encoded(), 1);
        b.record();
        assert!(b.record().commit_now);
        assert_eq!(b.commit(), Some(1));
        assert!(!b.has_open_work());
        assert_eq!(b.last_encoded(), 1, "the committed buffer may still run");
        assert_eq!(b.record().serial, 2);
        assert_eq!(b.commit(), Some(2));
        assert_eq!(b.committed(), 2);
        assert_eq!(Batch::new(0).max_ops(), 1);
    }

    #[test]
    fn watermark_waits_for_gaps() {
        let mut c = Completions::new();
        c.complete(2, None);
        assert_eq!(c.watermark(), 0, "serial 1 has not completed");
        c.complete(3, None);
        c.complete(1, None);
        assert_eq!(c.watermark(), 3);
        assert!(c.is_complete(3) && !c.is_complete(4));
        c.complete(2, None); // a duplicate report changes nothing
        assert_eq!(c.watermark(), 3);
        c.complete(5, Some("page fault".into()));
        assert_eq!(c.watermark(), 3);
        c.complete(4, None);
        assert_eq!(c.watermark(), 5);
        let errors = c.take_errors();
        assert_eq!(errors, vec!["command buffer 5: page fault".to_string()]);
        assert!(c.take_errors().is_empty());
    }
}
