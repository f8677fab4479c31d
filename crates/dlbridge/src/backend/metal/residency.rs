//! Residency-set staging: which allocations join or leave a device's `MTLResidencySet`, and when.
//! Platform-free; the Metal runtime applies what [`Staging::flush`] reports.
//!
//! Residency sets (macOS 15 and later) tell the GPU up front which allocations a command buffer may
//! touch, sparing the driver per-encoder residency work. Changing a set is cheap, but committing it
//! is not, so dlbridge never commits per allocation:
//!
//! * a new allocation is **staged** for addition ([`Staging::add`]);
//! * a released allocation is staged for removal, **after** the serial of the last command buffer
//!   that may still use it ([`Staging::release`]); an allocation released before its addition was
//!   ever committed simply leaves the stage;
//! * right before the next command buffer is committed, the runtime calls [`Staging::flush`] with
//!   the completed-serial watermark: every staged addition is applied, every removal whose command
//!   buffers have completed is applied, and the set is committed once (only if anything changed).
//!   The set is attached to the queue, so that command buffer already sees the committed set;
//! * removals whose GPU work is still running wait for a later flush, and keep the allocation
//!   alive until then.
//!
//! Foreign buffers (imported from other frameworks) are not registered unless the caller asks.
//! `DLBRIDGE_METAL_RESIDENCY=0` (or `false`, `off`, `no`) turns residency sets off.

use std::collections::BTreeMap;

/// The environment variable that turns residency sets off (`0`, `false`, `off`, `no`).
pub const RESIDENCY_ENV: &str = "DLBRIDGE_METAL_RESIDENCY";

/// Staged changes (additions plus removals) beyond which the runtime flushes without waiting for
/// a command buffer, so that released memory does not pile up while the queue is idle.
pub const FLUSH_THRESHOLD: usize = 256;

/// Bytes of released allocations beyond which the runtime flushes without waiting for a command
/// buffer: the set keeps released allocations alive until their removal is committed.
pub const RELEASED_BYTES_THRESHOLD: usize = 256 << 20;

/// Whether queued residency changes (`events` of them, releasing `released_bytes`) should be
/// flushed now rather than at the next command-buffer commit.
pub fn flush_due(events: usize, released_bytes: usize) -> bool {
    events >= FLUSH_THRESHOLD || released_bytes >= RELEASED_BYTES_THRESHOLD
}

/// Reads [`RESIDENCY_ENV`]: `Ok(enabled)`, or `Err(warning)` for a value that is neither on nor
/// off (residency then stays on).
pub fn parse_env(value: Option<&str>) -> Result<bool, String> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(true);
    };
    match value.to_ascii_lowercase().as_str() {
        "0" | "false" | "off" | "no" => Ok(false),
        "1" | "true" | "on" | "yes" => Ok(true),
        _ => Err(format!(
            "{RESIDENCY_ENV}={value:?} is neither 0/false/off/no nor 1/true/on/yes; residency \
             sets stay on"
        )),
    }
}

/// One change to apply to the residency set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// `addAllocation:`.
    Add,
    /// `removeAllocation:`.
    Remove,
}

/// Where an allocation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Membership {
    /// Staged for addition; the set has not been committed with it.
    PendingAdd,
    /// In the committed set.
    Member,
    /// Released; leaves the set once command buffer `after` has completed.
    PendingRemove {
        /// The last serial that may use the allocation.
        after: u64,
    },
}

#[derive(Debug)]
struct Entry<T> {
    item: T,
    state: Membership,
}

/// The staged state of one residency set. `T` is what the runtime needs to name an allocation to
/// Metal (a retained `MTLAllocation`); it stays alive here until its removal is applied.
#[derive(Debug)]
pub struct Staging<T> {
    entries: BTreeMap<u64, Entry<T>>,
    staged: usize,
}

/// What a flush did.
#[derive(Debug)]
#[must_use = "commit the set when `changed`, then drop `released`"]
pub struct Flushed<T> {
    /// Changes were applied: commit the set.
    pub changed: bool,
    /// Allocations that left the set; drop them after the set is committed.
    pub released: Vec<T>,
}

impl<T> Default for Staging<T> {
    fn default() -> Self {
        Staging {
            entries: BTreeMap::new(),
            staged: 0,
        }
    }
}

impl<T> Staging<T> {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stages the addition of allocation `id`. Returns `false` (and changes nothing) if `id` is
    /// already known.
    pub fn add(&mut self, id: u64, item: T) -> bool {
        if self.entries.contains_key(&id) {
            return false;
        }
        self.entries.insert(
            id,
            Entry {
                item,
                state: Membership::PendingAdd,
            },
        );
        self.staged += 1;
        true
    }

    /// Releases allocation `id`, whose last possible GPU use is command buffer `after`. When its
    /// addition was never committed, the allocation leaves at once and is returned (the set never
    /// saw it); otherwise its removal is staged.
    pub fn release(&mut self, id: u64, after: u64) -> Option<T> {
        let entry = self.entries.get_mut(&id)?;
        match entry.state {
            Membership::PendingAdd => {
                self.staged -= 1;
                self.entries.remove(&id).map(|e| e.item)
            }
            Membership::Member => {
                entry.state = Membership::PendingRemove { after };
                self.staged += 1;
                None
            }
            Membership::PendingRemove { .. } => None,
        }
    }

    /// Applies staged changes: every addition, and every removal whose command buffer has
    /// completed (`after <= completed`). `apply` performs each change on the real set.
    pub fn flush(&mut self, completed: u64, mut apply: impl FnMut(Change, &T)) -> Flushed<T> {
        let mut changed = false;
        let mut leaving = Vec::new();
        for (&id, entry) in self.entries.iter_mut() {
            match entry.state {
                Membership::PendingAdd => {
                    apply(Change::Add, &entry.item);
                    entry.state = Membership::Member;
                    self.staged -= 1;
                    changed = true;
                }
                Membership::PendingRemove { after } if after <= completed => {
                    apply(Change::Remove, &entry.item);
                    leaving.push(id);
                    changed = true;
                }
                _ => {}
            }
        }
        let released = leaving
            .into_iter()
            .filter_map(|id| self.entries.remove(&id))
            .map(|e| e.item)
            .collect::<Vec<_>>();
        self.staged -= released.len();
        Flushed { changed, released }
    }

    /// Where allocation `id` stands; `None` if the set does not know it.
    pub fn membership(&self, id: u64) -> Option<Membership> {
        self.entries.get(&id).map(|e| e.state)
    }

    /// Allocations in the committed set (including those staged for removal).
    pub fn members(&self) -> usize {
        self.entries
            .values()
            .filter(|e| !matches!(e.state, Membership::PendingAdd))
            .count()
    }

    /// Staged additions and removals.
    pub fn staged(&self) -> usize {
        self.staged
    }

    /// Whether enough is staged to flush without waiting for a command buffer.
    pub fn needs_flush(&self) -> bool {
        self.staged >= FLUSH_THRESHOLD
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies a flush to a model of the real set and returns it.
    fn flush_into(
        st: &mut Staging<&'static str>,
        set: &mut Vec<&'static str>,
        completed: u64,
    ) -> Flushed<&'static str> {
        st.flush(completed, |change, item| match change {
            Change::Add => set.push(item),
            Change::Remove => set.retain(|x| x != item),
        })
    }

    #[test]
    fn env_switch() {
        assert_eq!(parse_env(None), Ok(true));
        assert_eq!(parse_env(Some("")), Ok(true));
        for off in ["0", "false", "OFF", " no "] {
            assert_eq!(parse_env(Some(off)), Ok(false), "{off}");
        }
        for on in ["1", "true", "On", "yes"] {
            assert_eq!(parse_env(Some(on)), Ok(true), "{on}");
        }
        let warning = parse_env(Some("maybe")).unwrap_err();
        assert!(warning.contains("\"maybe\""), "{warning}");
    }

    #[test]
    fn additions_are_committed_once_at_flush() {
        let mut st = Staging::new();
        let mut set = vec![];
        assert!(st.add(1, "a"));
        assert!(st.add(2, "b"));
        assert!(!st.add(2, "b again"), "ids are unique");
        assert_eq!(st.membership(1), Some(Membership::PendingAdd));
        assert_eq!(st.staged(), 2);
        assert_eq!(st.members(), 0);
        let f = flush_into(&mut st, &mut set, 0);
        assert!(f.changed && f.released.is_empty());
        assert_eq!(set, vec!["a", "b"]);
        assert_eq!(st.membership(2), Some(Membership::Member));
        assert_eq!((st.staged(), st.members()), (0, 2));
        // Nothing staged: no commit.
        let f = flush_into(&mut st, &mut set, 0);
        assert!(!f.changed);
    }

    #[test]
    fn removal_waits_for_gpu_completion() {
        let mut st = Staging::new();
        let mut set = vec![];
        st.add(7, "x");
        let _ = flush_into(&mut st, &mut set, 0);
        // Released while command buffer 4 may still use it.
        assert_eq!(st.release(7, 4), None);
        assert_eq!(
            st.membership(7),
            Some(Membership::PendingRemove { after: 4 })
        );
        assert_eq!(st.staged(), 1);
        let f = flush_into(&mut st, &mut set, 3);
        assert!(!f.changed, "serial 4 has not completed");
        assert_eq!(set, vec!["x"]);
        let f = flush_into(&mut st, &mut set, 4);
        assert!(f.changed);
        assert_eq!(
            f.released,
            vec!["x"],
            "the allocation is handed back only now"
        );
        assert!(set.is_empty());
        assert_eq!(st.membership(7), None);
        assert_eq!(st.staged(), 0);
        // A second release of a forgotten id is a no-op.
        assert_eq!(st.release(7, 9), None);
        assert_eq!(st.release(7, 9), None);
    }

    #[test]
    fn release_before_commit_cancels_the_addition() {
        let mut st = Staging::new();
        let mut set = vec![];
        st.add(1, "short-lived");
        st.add(2, "kept");
        assert_eq!(st.release(1, 10), Some("short-lived"));
        assert_eq!(st.staged(), 1);
        let f = flush_into(&mut st, &mut set, 0);
        assert!(f.changed);
        assert_eq!(
            set,
            vec!["kept"],
            "the cancelled allocation never reached the set"
        );
        // Releasing twice while pending removal keeps one staged change.
        st.release(2, 1);
        st.release(2, 5);
        assert_eq!(
            st.membership(2),
            Some(Membership::PendingRemove { after: 1 })
        );
        assert_eq!(st.staged(), 1);
    }

    #[test]
    fn mixed_flush_applies_only_what_is_ready() {
        let mut st = Staging::new();
        let mut set = vec![];
        st.add(1, "old");
        st.add(2, "busy");
        let _ = flush_into(&mut st, &mut set, 0);
        st.release(1, 2);
        st.release(2, 6);
        st.add(3, "new");
        let f = flush_into(&mut st, &mut set, 5);
        assert!(f.changed);
        assert_eq!(f.released, vec!["old"]);
        assert_eq!(set, vec!["busy", "new"]);
        assert_eq!(st.staged(), 1, "the busy removal stays staged");
        assert!(!st.needs_flush());
    }

    #[test]
    fn early_flush_policy() {
        assert!(!flush_due(0, 0));
        assert!(!flush_due(
            FLUSH_THRESHOLD - 1,
            RELEASED_BYTES_THRESHOLD - 1
        ));
        assert!(flush_due(FLUSH_THRESHOLD, 0));
        assert!(flush_due(1, RELEASED_BYTES_THRESHOLD));
    }

    #[test]
    fn threshold_triggers_an_early_flush() {
        let mut st = Staging::new();
        for id in 0..FLUSH_THRESHOLD as u64 - 1 {
            st.add(id, ());
        }
        assert!(!st.needs_flush());
        st.add(u64::MAX, ());
        assert!(st.needs_flush());
        let f = st.flush(0, |_, _| {});
        assert!(f.changed);
        assert!(!st.needs_flush());
        assert_eq!(st.members(), FLUSH_THRESHOLD);
    }
}
