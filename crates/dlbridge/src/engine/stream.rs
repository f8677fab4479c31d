//! Streaming loads: the groups of a plan (a layer's arrays, say) loaded one after another in the
//! caller's order on a thread of the engine's, each handed out as soon as it is on the device
//! with an event that completes when its bytes are there, while the next groups load. A model
//! can run layer `k` while layer `k + 1` loads: its stream waits for the group's event.
//!
//! Each group is one load of its items (the same reader, staging, direct reads and views as a
//! whole [`load`](super::load); one allocation per file per group on a device), in one
//! `Session` for the whole stream: whether each file is read around the page cache is decided
//! at its first group (a residency sample and an `O_DIRECT` descriptor per file per stream, not
//! per group), the reads run on the loading thread (no progress thread per group), and the
//! backend's reader lasts for the whole stream (on CUDA: its threads, their streams, events and
//! pinned staging). A group's load returns once its bytes are read and their copies to the device
//! enqueued: the host does not wait for the copies, the group's ready event does (recorded after
//! the queue it is recorded on waited, on the device, for each reader stream that copied the
//! group's bytes). At most `ahead` loaded groups wait for the caller (besides the one loading), so
//! a slow consumer holds the device memory of only that many. Dropping the [`LoadStream`] stops
//! it: the group being loaded finishes, the reader waits for the copies still running and frees
//! its threads and staging, then everything loaded and not taken is freed.
//!
//! On a device with queues (CUDA) the stream has a queue of its own, ordered after the caller's
//! current queue when the stream starts, where each group's ready event is recorded: not the
//! loading thread's current stream, the legacy default stream, where PyTorch computes by
//! default, so that an event does not wait for the consumer's compute queued before it (and the
//! legacy stream's implicit ordering does not tie the two together). Where a group's bytes are
//! worked on after the read (converted, `dtype`; an array not aligned for its type copied), that
//! work runs on the loading thread's current stream, after the group's copies, and the event is
//! recorded there, after it.
//!
//! Memory: a group's allocations come from the pool for the loading thread's current stream
//! (the legacy default stream), as before and as a whole load's do: a block the consumer
//! released returns to the pool fenced in that stream's order, and the pool hands it to the next
//! request on that stream at once, so the reader's streams start after the work queued there (a
//! kernel may still read the block), and that stream waits for the reader's copies (a block
//! released before the copies into it ended is handed out again after them). A consumer that
//! computes on the legacy default stream therefore runs after each group's reads rather than
//! beside them; on a stream of its own it overlaps them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use super::file::MappedFile;
use super::load::{Item, LoadOptions, Session, load_with};
use crate::backend::{self, Event, Queue};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The files a stream reads, owned by it for as long as it runs (a checkpoint's shards).
pub trait FileSet: Send + Sync + 'static {
    /// File `index` of the set.
    fn file(&self, index: usize) -> Option<&MappedFile>;
}

impl FileSet for Vec<MappedFile> {
    fn file(&self, index: usize) -> Option<&MappedFile> {
        self.get(index)
    }
}

/// One group of a stream's plan: its name, its arrays (each with the index of its file in the
/// [`FileSet`]) in the order they are handed out.
#[derive(Clone, Debug)]
pub struct GroupPlan {
    /// The group's name (a layer's prefix, say).
    pub name: String,
    /// The arrays: the file each lies in, and where.
    pub items: Vec<(usize, Item)>,
}

/// One group of a stream, loaded.
#[derive(Debug)]
pub struct LoadedGroup {
    /// The group's name.
    pub name: String,
    /// Its arrays, in the plan's order.
    pub tensors: Vec<(String, Tensor)>,
    /// On a device with queues (CUDA): an event that completes once the group's bytes
    /// (converted, where a dtype was asked for) are on the device; a stream that waits for it
    /// may read them ([`Event::downcast`] gives the backend's event). `None` where the arrays are
    /// ready when handed out (the CPU: views of the mapped file; Metal).
    pub ready: Option<Event>,
}

/// A streaming load in progress: an iterator of its groups, in the plan's order. An error (a
/// file truncated under the load, the device out of memory) is the last item.
pub struct LoadStream {
    groups: Option<mpsc::Receiver<Result<LoadedGroup>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Starts loading `groups` of `files` onto `options.device`, group after group, keeping at most
/// `ahead` (at least 1) loaded groups waiting for the caller.
///
/// # Errors
/// An item naming a file the set does not hold ([`Error::InvalidArgument`]), and a thread the
/// system refuses; the loads' errors come from the iterator.
pub fn stream(
    files: Arc<dyn FileSet>,
    groups: Vec<GroupPlan>,
    options: LoadOptions,
    ahead: usize,
) -> Result<LoadStream> {
    for group in &groups {
        if let Some((index, item)) = group.items.iter().find(|(i, _)| files.file(*i).is_none()) {
            return Err(Error::InvalidArgument(format!(
                "array `{}` of group `{}` names file {index}, which the stream does not hold",
                item.name, group.name
            )));
        }
    }
    // Made on the caller's thread: ordered after the caller's work queued so far.
    let queue = backend::queue_after_current(options.device)?;
    let (tx, rx) = mpsc::sync_channel(ahead.max(1));
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .spawn(move || {
            let mut session = Session::new();
            for group in groups {
                if thread_stop.load(Ordering::Relaxed) {
                    return;
                }
                let loaded = load_group(
                    files.as_ref(),
                    group,
                    &options,
                    &mut session,
                    queue.as_ref(),
                );
                let failed = loaded.is_err();
                // The caller hung up (the stream was dropped): stop.
                if tx.send(loaded).is_err() || failed {
                    return;
                }
            }
        })
        .map_err(|e| Error::Driver {
            backend: "stream",
            message: format!("starting the loading thread: {e}"),
        })?;
    Ok(LoadStream {
        groups: Some(rx),
        stop,
        thread: Some(thread),
    })
}

/// The name of a stream's loading thread.
pub(crate) const THREAD_NAME: &str = "dlbridge-stream";

/// One group through the engine's load in the stream's `session`, and its event (on `queue`,
/// the stream's own, unless the group was converted).
fn load_group(
    files: &dyn FileSet,
    group: GroupPlan,
    options: &LoadOptions,
    session: &mut Session,
    queue: Option<&Queue>,
) -> Result<LoadedGroup> {
    let order: Vec<String> = group.items.iter().map(|(_, i)| i.name.clone()).collect();
    let mut by_file: BTreeMap<usize, Vec<Item>> = BTreeMap::new();
    for (index, item) in group.items {
        by_file.entry(index).or_default().push(item);
    }
    let plan: Vec<(&MappedFile, Vec<Item>)> = by_file
        .into_iter()
        .filter_map(|(index, items)| files.file(index).map(|f| (f, items)))
        .collect();
    let mut loaded = load_with(&plan, options, Some(&mut *session), &mut |_, _| {})?;
    // The group's copies may still run: the event follows them on the stream's queue, or on this
    // thread's current queue where the load worked on the bytes there after them.
    let ready = match queue {
        Some(queue) if !session.joined_current() => {
            let _entered = queue.enter();
            session.join_current()?;
            backend::record_event(options.device)?
        }
        _ => backend::record_event(options.device)?,
    };
    let tensors = order
        .into_iter()
        .filter_map(|name| loaded.remove(&name).map(|t| (name, t)))
        .collect();
    Ok(LoadedGroup {
        name: group.name,
        tensors,
        ready,
    })
}

impl Iterator for LoadStream {
    type Item = Result<LoadedGroup>;

    /// The next group, waiting for it to load.
    fn next(&mut self) -> Option<Result<LoadedGroup>> {
        let next = self.groups.as_ref()?.recv().ok();
        if !matches!(next, Some(Ok(_))) {
            // The end, or an error: nothing comes after.
            self.groups = None;
        }
        next
    }
}

impl LoadStream {
    /// The next group if it is loaded, without waiting: `Err(())` while it is not, `Ok(None)` at
    /// the end.
    #[allow(clippy::result_unit_err)] // "not yet" carries nothing
    pub fn try_next(&mut self) -> std::result::Result<Option<Result<LoadedGroup>>, ()> {
        self.next_within(std::time::Duration::ZERO)
    }

    /// The next group, waiting at most `timeout` for it (woken as soon as it is loaded):
    /// `Err(())` when it is not loaded by then, `Ok(None)` at the end.
    #[allow(clippy::result_unit_err)] // "not yet" carries nothing
    pub fn next_within(
        &mut self,
        timeout: std::time::Duration,
    ) -> std::result::Result<Option<Result<LoadedGroup>>, ()> {
        let Some(groups) = self.groups.as_ref() else {
            return Ok(None);
        };
        let received = if timeout.is_zero() {
            groups.try_recv().map_err(|e| match e {
                mpsc::TryRecvError::Empty => mpsc::RecvTimeoutError::Timeout,
                mpsc::TryRecvError::Disconnected => mpsc::RecvTimeoutError::Disconnected,
            })
        } else {
            groups.recv_timeout(timeout)
        };
        match received {
            Ok(group) => {
                if group.is_err() {
                    self.groups = None;
                }
                Ok(Some(group))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.groups = None;
                Ok(None)
            }
        }
    }
}

impl Drop for LoadStream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // The groups not taken are kept until the thread has ended: it finishes the group it is
        // loading, sends it and stops, and its reader waits for the copies still running (into
        // these groups' memory) before the thread ends.
        let untaken: Vec<Result<LoadedGroup>> = self
            .groups
            .take()
            .map_or_else(Vec::new, |g| g.iter().collect());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        drop(untaken);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::dtype::DType;
    use crate::layout::Layout;

    fn file_of(bytes: &[u8], name: &str) -> (std::path::PathBuf, MappedFile) {
        let path =
            std::env::temp_dir().join(format!("dlbridge-stream-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        let (mapped, ()) = MappedFile::open(&path, |_| Ok(())).unwrap();
        (path, mapped)
    }

    fn item(name: &str, start: u64, count: usize) -> Item {
        Item {
            name: name.into(),
            byte_range: start..start + 4 * count as u64,
            dtype: DType::F32,
            layout: Layout::contiguous(&[count]).unwrap(),
        }
    }

    /// Three groups of file 0: "fits" (`fits` elements from its start), "past the end" (`past`
    /// elements from byte `at`, which a short file lacks) and "never", which a stream that failed
    /// at the second does not reach.
    fn fits_then_past_the_end(fits: usize, at: u64, past: usize) -> Vec<GroupPlan> {
        vec![
            GroupPlan {
                name: "fits".into(),
                items: vec![(0, item("a", 0, fits))],
            },
            GroupPlan {
                name: "past the end".into(),
                items: vec![(0, item("b", at, past))],
            },
            GroupPlan {
                name: "never".into(),
                items: vec![(0, item("c", 0, 1))],
            },
        ]
    }

    /// Groups come in the plan's order with their arrays in order, across two files; the CPU's
    /// have no event.
    #[test]
    fn groups_come_in_the_plan_order() {
        let values: Vec<u8> = (0..64u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let (a_path, a) = file_of(&values, "a");
        let (b_path, b) = file_of(&values[128..], "b");
        let groups = vec![
            GroupPlan {
                name: "second".into(),
                items: vec![(1, item("y", 0, 4)), (0, item("x", 16, 2))],
            },
            GroupPlan {
                name: "first".into(),
                items: vec![(0, item("z", 0, 3))],
            },
        ];
        let stream = stream(
            Arc::new(vec![a, b]),
            groups,
            LoadOptions::new(Device::CPU),
            1,
        )
        .unwrap();
        let got: Vec<LoadedGroup> = stream.map(|g| g.unwrap()).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].name, "second");
        let names: Vec<&str> = got[0].tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["y", "x"]);
        assert_eq!(
            got[0].tensors[0].1.to_vec::<f32>().unwrap(),
            [32.0, 33.0, 34.0, 35.0]
        );
        assert_eq!(got[0].tensors[1].1.to_vec::<f32>().unwrap(), [4.0, 5.0]);
        assert_eq!(
            got[1].tensors[0].1.to_vec::<f32>().unwrap(),
            [0.0, 1.0, 2.0]
        );
        assert!(got.iter().all(|g| g.ready.is_none()));
        std::fs::remove_file(a_path).unwrap();
        std::fs::remove_file(b_path).unwrap();
    }

    /// A file shorter than its plan (truncated after the header was read) ends the stream with
    /// the read's error, after the groups before it; a file index the set lacks is refused.
    #[test]
    fn a_truncated_file_ends_the_stream_with_an_error() {
        let values: Vec<u8> = (0..16u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let (path, file) = file_of(&values, "short");
        let groups = fits_then_past_the_end(4, 32, 100);
        let files: Arc<dyn FileSet> = Arc::new(vec![file]);
        let mut s = stream(
            Arc::clone(&files),
            groups.clone(),
            LoadOptions::new(Device::CPU),
            2,
        )
        .unwrap();
        assert_eq!(s.next().unwrap().unwrap().name, "fits");
        assert!(s.next().unwrap().is_err());
        assert!(s.next().is_none());
        let bad = vec![GroupPlan {
            name: "g".into(),
            items: vec![(3, item("a", 0, 1))],
        }];
        assert!(matches!(
            stream(files, bad, LoadOptions::new(Device::CPU), 1),
            Err(Error::InvalidArgument(_))
        ));
        std::fs::remove_file(path).unwrap();
    }

    /// Dropping a stream with groups loaded and not taken, and more to load, ends its thread
    /// (the drop joins it) and returns promptly.
    #[test]
    fn dropping_a_stream_early_stops_it() {
        let values: Vec<u8> = (0..16u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let (path, file) = file_of(&values, "drop");
        let groups: Vec<GroupPlan> = (0..10_000)
            .map(|i| GroupPlan {
                name: format!("g{i}"),
                items: vec![(0, item(&format!("t{i}"), 0, 4))],
            })
            .collect();
        let options = LoadOptions {
            copy: true,
            ..LoadOptions::new(Device::CPU)
        };
        let mut s = stream(Arc::new(vec![file]), groups, options, 2).unwrap();
        let first = s.next().unwrap().unwrap();
        assert_eq!(first.name, "g0");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            drop(s);
            let _ = tx.send(());
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("dropping the stream did not end its thread");
        std::fs::remove_file(path).unwrap();
    }

    /// The streams onto the test backend's `ext_dev` (host memory through the loader's reader)
    /// run one at a time: they count the threads started on streams' loading threads.
    #[cfg(feature = "test-backend")]
    static READING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The crew threads streams have started and ended so far.
    #[cfg(feature = "test-backend")]
    fn crew_threads() -> (usize, usize) {
        let [started, ended] = &crate::backend::STREAM_CREW_THREADS;
        (
            started.load(Ordering::Relaxed),
            ended.load(Ordering::Relaxed),
        )
    }

    /// Waits up to 20 s for every crew thread streams started to have ended.
    #[cfg(feature = "test-backend")]
    fn crews_end() -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            let (started, ended) = crew_threads();
            if started == ended {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        false
    }

    /// `ext_dev`, the test backend's device that reads (its memory is host memory).
    #[cfg(feature = "test-backend")]
    fn reading_device() -> Device {
        Device::new(
            crate::device::DeviceKind::Other(crate::dlpack::ffi::K_DL_EXT_DEV),
            0,
        )
    }

    /// A stream of many groups onto a device that reads samples its file's residency once, not
    /// once per group, spawns no progress thread per group, and starts its reader's threads once
    /// for all its groups (ending them when it ends); its groups are the file's bytes, and the
    /// next group wakes a waiting caller (`next_within`) as soon as it is loaded.
    #[cfg(feature = "test-backend")]
    #[test]
    fn a_stream_decides_its_reads_once_not_per_group() {
        let _one = READING.lock().unwrap_or_else(|p| p.into_inner());
        let values: Vec<u8> = (0..1024u32)
            .flat_map(|v| (v as f32).to_le_bytes())
            .collect();
        let (path, file) = file_of(&values, "session");
        let groups: Vec<GroupPlan> = (0..16)
            .map(|i| GroupPlan {
                name: format!("g{i}"),
                items: vec![(0, item(&format!("t{i}"), 256 * i as u64, 64))],
            })
            .collect();
        let device = reading_device();
        let before = super::super::load::STREAM_THREAD_WORK.load(Ordering::Relaxed);
        let (started, _) = crew_threads();
        let options = LoadOptions {
            threads: Some(3),
            ..LoadOptions::new(device)
        };
        let mut s = stream(Arc::new(vec![file]), groups, options, 2).unwrap();
        let mut got = 0;
        while let Ok(Some(group)) = s.next_within(std::time::Duration::from_secs(20)) {
            let group = group.unwrap();
            assert_eq!(group.name, format!("g{got}"));
            assert_eq!(group.tensors[0].1.device(), device);
            let expected: Vec<f32> = (64 * got..64 * (got + 1)).map(|v| v as f32).collect();
            assert_eq!(group.tensors[0].1.to_vec::<f32>().unwrap(), expected);
            assert!(group.ready.is_none(), "ext_dev has no queues");
            got += 1;
        }
        assert_eq!(got, 16);
        let work = super::super::load::STREAM_THREAD_WORK.load(Ordering::Relaxed) - before;
        assert_eq!(
            work, 1,
            "one residency sample for the stream, no progress threads"
        );
        assert_eq!(
            crew_threads().0 - started,
            3,
            "the reader's three threads, once for the 16 groups"
        );
        drop(s);
        assert!(crews_end(), "the stream's reader threads ended with it");
        std::fs::remove_file(path).unwrap();
    }

    /// Dropping a stream onto a device that reads, with groups loaded and not taken and more to
    /// load, returns promptly and ends its reader's threads.
    #[cfg(feature = "test-backend")]
    #[test]
    fn dropping_a_reading_stream_mid_way_ends_its_reader() {
        let _one = READING.lock().unwrap_or_else(|p| p.into_inner());
        let values: Vec<u8> = (0..4096u32)
            .flat_map(|v| (v as f32).to_le_bytes())
            .collect();
        let (path, file) = file_of(&values, "reading-drop");
        let groups: Vec<GroupPlan> = (0..10_000)
            .map(|i| GroupPlan {
                name: format!("g{i}"),
                items: vec![(0, item(&format!("t{i}"), 4 * (i % 4000) as u64, 64))],
            })
            .collect();
        let options = LoadOptions {
            threads: Some(4),
            chunk_bytes: Some(64),
            ..LoadOptions::new(reading_device())
        };
        let (started, _) = crew_threads();
        let mut s = stream(Arc::new(vec![file]), groups, options, 2).unwrap();
        let first = s.next().unwrap().unwrap();
        assert_eq!(first.name, "g0");
        assert_eq!(crew_threads().0 - started, 4);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            drop(s);
            let _ = tx.send(());
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("dropping the stream did not end its thread");
        assert!(crews_end(), "the stream's reader threads ended with it");
        // The group taken stays valid after the stream went.
        let expected: Vec<f32> = (0..64).map(|v| v as f32).collect();
        assert_eq!(first.tensors[0].1.to_vec::<f32>().unwrap(), expected);
        std::fs::remove_file(path).unwrap();
    }

    /// On a device that reads, a group whose read fails (the file shorter than its plan) is the
    /// stream's last item, an I/O error naming the file, after the groups before it; the reader
    /// ends with the stream.
    #[cfg(feature = "test-backend")]
    #[test]
    fn a_failed_read_ends_a_reading_stream_with_its_error() {
        let _one = READING.lock().unwrap_or_else(|p| p.into_inner());
        let values: Vec<u8> = (0..256u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let (path, file) = file_of(&values, "reading-short");
        let groups = fits_then_past_the_end(64, 512, 512);
        let options = LoadOptions {
            threads: Some(2),
            direct_io: Some(false),
            ..LoadOptions::new(reading_device())
        };
        let mut s = stream(Arc::new(vec![file]), groups, options, 2).unwrap();
        assert_eq!(s.next().unwrap().unwrap().name, "fits");
        match s.next().unwrap() {
            Err(Error::Io { path: named, .. }) => assert_eq!(named, path),
            other => panic!("expected an I/O error, got {other:?}"),
        }
        assert!(s.next().is_none());
        drop(s);
        assert!(crews_end(), "the stream's reader threads ended with it");
        std::fs::remove_file(path).unwrap();
    }

    /// On a CUDA device each group comes with an event; once it completed the group's bytes
    /// are the file's.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_groups_come_with_events() {
        let values: Vec<u8> = (0..4096u32)
            .flat_map(|v| (v as f32).to_le_bytes())
            .collect();
        let (path, file) = file_of(&values, "cuda");
        let groups: Vec<GroupPlan> = (0..4)
            .map(|i| GroupPlan {
                name: format!("g{i}"),
                items: vec![(0, item(&format!("t{i}"), 4096 * i as u64, 1024))],
            })
            .collect();
        let s = stream(
            Arc::new(vec![file]),
            groups,
            LoadOptions::new(Device::cuda(0)),
            1,
        )
        .unwrap();
        for (i, group) in s.enumerate() {
            let group = group.unwrap();
            let ready = group.ready.expect("a CUDA group has an event");
            ready.synchronize().unwrap();
            let expected: Vec<f32> = (1024 * i..1024 * (i + 1)).map(|v| v as f32).collect();
            assert_eq!(group.tensors[0].1.to_vec::<f32>().unwrap(), expected);
        }
        std::fs::remove_file(path).unwrap();
    }
}
