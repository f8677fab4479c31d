//! Writing safetensors files from tensors on any device.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::tensor::Tensor;

use super::dtype::dtype_name;
use super::header::{MAX_HEADER_LEN, METADATA_KEY, PREFIX_LEN};
use crate::engine::{
    CopyStreams, WriteItem, WriteOptions, check_regular, io_error, write_file_staged, write_to,
};

/// One tensor to write: its name, dtype name and the bytes it takes in the file.
struct Planned<'a> {
    name: &'a str,
    tensor: &'a Tensor,
    dtype: &'static str,
    nbytes: u64,
}

/// The safetensors encoding of `tensors` (with `metadata` as `"__metadata__"`), written to
/// `writer`: the header, padded with spaces so the data section starts at a multiple of 8, then
/// the data, widest element types first (so every tensor is aligned for its element type).
///
/// Tensors may be on any device and in any layout: each is made compact and copied to the host in
/// turn, so at most one tensor's bytes are staged at a time. Sub-byte tensors are written packed.
/// Errors, before anything is written: a repeated or reserved name, a dtype the format cannot
/// hold ([`Error::UnsupportedDType`], naming the tensor), or a header (the tensors' entries and
/// the metadata) longer than [`MAX_HEADER_LEN`], which readers refuse
/// ([`Error::InvalidArgument`]).
pub fn write(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    writer: &mut dyn Write,
) -> Result<()> {
    let plan = plan(tensors)?;
    let header = header_json(&plan, metadata)?;
    write_planned(&plan, &header, writer, Path::new("<writer>"))
}

/// [`write()`] into a new `Vec`.
pub fn serialize(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    write(tensors, metadata, &mut out)?;
    Ok(out)
}

/// [`write()`] to the file at `path`, atomically and durably: the bytes go to a temporary file in
/// the same folder through the saving engine ([`crate::engine::write_file`]: a ring of aligned
/// host buffers, several writer threads, `O_DIRECT` where the file system takes it), which is
/// synced and then renamed over `path`, and the folder is synced after the rename; so a failed
/// save leaves no partial file (and nothing at all where the tensors or metadata are refused),
/// and a save that returned survives a power cut.
///
/// - A `path` that is a symbolic link (such as a shard in the Hugging Face cache, a link into
///   its `blobs/`) stays one: the file it leads to is replaced, through any chain of links.
/// - An existing file keeps its permission bits (and, when the caller is root, its owner and
///   group): the temporary is created readable and writable by its owner only, and given them
///   before it is renamed over the file. A new file gets the usual mode (`0o666` less the
///   umask). Other links to the old file (hard links) keep the old content.
/// - A `path` that exists but is not a regular file (a directory, a FIFO, a device) is refused
///   with an [`Error::Io`] saying what it is.
/// - The temporary is `.NAME.PID.N.tmp` beside the file, locked (`flock`) while it is written.
///   One that a killed process left behind (unlocked, over a second old) is removed by the next
///   save to the same file.
pub fn save_file(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    path: impl AsRef<Path>,
) -> Result<()> {
    save_file_with(
        tensors,
        metadata,
        path,
        &WriteOptions::default(),
        &mut |_, _| {},
    )
}

/// [`save_file`] with the engine's `options`, calling `progress(done, total)` (bytes) about ten
/// times a second while it writes and once at the end.
pub fn save_file_with(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    path: impl AsRef<Path>,
    options: &WriteOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let streams = CopyStreams::after_current(tensors.iter().map(|(_, t)| *t))?;
    save_file_staged(tensors, metadata, path, options, &streams, &|| {}, progress)
}

/// [`save_file_with`] on streams made beforehand ([`CopyStreams::after_current`] on the thread
/// whose writes the save must see, covering the tensors' CUDA devices), calling `copied()` once
/// every byte is in host memory (the tensors may change from then on; with
/// [`WriteOptions::whole`] that is at the speed of the copies, before the disk is done): the
/// asynchronous save runs this on a thread of its own.
pub fn save_file_staged(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    path: impl AsRef<Path>,
    options: &WriteOptions,
    streams: &CopyStreams,
    copied: &(dyn Fn() + Sync),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let plan = plan(tensors)?;
    let header = header_json(&plan, metadata)?;
    let staged = Staged { streams, copied };
    prepare(&plan, &header, path.as_ref(), options, &staged, progress)?.commit()
}

/// The streams a save copies CUDA tensors on and whom it tells when every byte is in host
/// memory.
struct Staged<'a> {
    streams: &'a CopyStreams,
    copied: &'a (dyn Fn() + Sync),
}

/// A file written and synced under its temporary name, not yet renamed over its target; dropped
/// uncommitted, the temporary is removed.
struct Pending {
    /// The path the caller named, for errors.
    path: PathBuf,
    temp: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl Pending {
    /// Renames the temporary over the target and syncs the folder.
    fn commit(mut self) -> Result<()> {
        std::fs::rename(&self.temp, &self.target).map_err(|e| io_error(&self.path, e))?;
        self.committed = true;
        sync_folder(&self.target).map_err(|e| io_error(&self.path, e))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the temporary may not exist (creating it failed).
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// Writes a planned file to a synced temporary beside `path`'s target (with the existing
/// file's mode and owner), ready to be renamed over it.
fn prepare(
    plan: &[Planned<'_>],
    header: &str,
    path: &Path,
    options: &WriteOptions,
    staged: &Staged<'_>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Pending> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let target = final_target(path)?;
    let existing = match std::fs::metadata(&target) {
        Ok(meta) => {
            check_regular(path, &meta)?;
            Some(meta)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_error(path, e)),
    };
    remove_stale_temporaries(&target);
    let pending = Pending {
        path: path.to_path_buf(),
        temp: temp_path(&target),
        target,
        committed: false,
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if existing.is_some() { 0o600 } else { 0o666 })
        .custom_flags(libc::O_CLOEXEC)
        .open(&pending.temp)
        .map_err(|e| io_error(path, e))?;
    lock(&file, false).map_err(|e| io_error(path, e))?;
    let head = head_bytes(header);
    let items = write_items(plan, head.len() as u64);
    // Before the old file's mode and owner are given to it: the engine opens the temporary a
    // second time (O_DIRECT), which a read-only mode would refuse.
    write_file_staged(
        &pending.temp,
        &file,
        &head,
        &items,
        options,
        staged.streams,
        staged.copied,
        progress,
    )
    .map_err(|e| renamed(e, &pending.temp, path))?;
    if let Some(meta) = &existing {
        // SAFETY: `geteuid` only reads the process's effective user id.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::fchown(&file, Some(meta.uid()), Some(meta.gid()))
                .map_err(|e| io_error(path, e))?;
        }
        // After the owner: changing it clears the set-user-ID and set-group-ID bits.
        let mode = std::fs::Permissions::from_mode(meta.mode() & 0o7777);
        file.set_permissions(mode).map_err(|e| io_error(path, e))?;
        // The new mode and owner, durable with the data.
        file.sync_all().map_err(|e| io_error(path, e))?;
    }
    Ok(pending)
}

/// The name of the index of a sharded save, as Hugging Face's `save_pretrained` writes it.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// Saves `tensors` into the folder `folder` (created where missing) as a checkpoint of shards of
/// at most `max_shard_size` bytes of tensor data each, as Hugging Face's `save_pretrained` and
/// `huggingface_hub.save_torch_state_dict` lay one out: the tensors in the given order, a new
/// shard started where the next tensor would overflow the current one, a tensor larger than
/// `max_shard_size` in a shard of its own; shards named `model-00001-of-00003.safetensors`, each
/// a standard safetensors file with `metadata`, and [`INDEX_NAME`] with `metadata.total_size`
/// (the tensors' bytes) and `weight_map` (name → shard). A single shard is `model.safetensors`,
/// with no index, as there. Returns the path of the index (or of the one file).
///
/// The shards are written in parallel, each as [`save_file`] writes a file, to temporaries that
/// are renamed only once all of them are written, the index last: a failed save leaves the folder
/// as it was. Once the new checkpoint is in place, what an earlier save there left and this one
/// does not name is removed, as `huggingface_hub.save_torch_state_dict` does: shards of another
/// count (`model-NNNNN-of-MMMMM.safetensors`), an index where the new checkpoint is one file, a
/// `model.safetensors` where it has shards; no other file is touched. Errors as [`save_file`]'s,
/// before anything is written where the tensors or metadata are refused; a `max_shard_size` of 0
/// is an [`Error::InvalidArgument`].
pub fn save_sharded(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    folder: impl AsRef<Path>,
    max_shard_size: u64,
    options: &WriteOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PathBuf> {
    let streams = CopyStreams::after_current(tensors.iter().map(|(_, t)| *t))?;
    save_sharded_staged(
        tensors,
        metadata,
        folder,
        max_shard_size,
        options,
        &streams,
        &|| {},
        progress,
    )
}

/// [`save_sharded`] on streams made beforehand, calling `copied()` once every shard's bytes are
/// in host memory, as [`save_file_staged`].
#[allow(clippy::too_many_arguments)] // save_sharded's, and the two of a staged save
pub fn save_sharded_staged(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    folder: impl AsRef<Path>,
    max_shard_size: u64,
    options: &WriteOptions,
    streams: &CopyStreams,
    copied: &(dyn Fn() + Sync),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PathBuf> {
    use std::sync::atomic::AtomicUsize;
    let folder = folder.as_ref();
    if max_shard_size == 0 {
        return Err(Error::InvalidArgument(
            "max_shard_size must be at least one byte".into(),
        ));
    }
    let all = plan(tensors)?;
    let sizes: BTreeMap<&str, u64> = all.iter().map(|p| (p.name, p.nbytes)).collect();
    let shards = split(tensors, &sizes, max_shard_size);
    let count = shards.len();
    let names: Vec<String> = (1..=count)
        .map(|i| {
            if count == 1 {
                "model.safetensors".to_owned()
            } else {
                format!("model-{i:05}-of-{count:05}.safetensors")
            }
        })
        .collect();
    let plans = shards
        .iter()
        .map(|shard| {
            let plan = plan(shard)?;
            let header = header_json(&plan, metadata)?;
            Ok((plan, header))
        })
        .collect::<Result<Vec<_>>>()?;
    let total: u64 = sizes.values().sum();
    let index = (count > 1).then(|| {
        let weight_map: BTreeMap<&str, &str> = shards
            .iter()
            .zip(&names)
            .flat_map(|(shard, file)| shard.iter().map(move |(name, _)| (*name, file.as_str())))
            .collect();
        let json = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let mut text = serde_json::to_string_pretty(&json).unwrap_or_default();
        text.push('\n');
        text
    });
    std::fs::create_dir_all(folder).map_err(|e| io_error(folder, e))?;

    let parallel = count.min(options.threads.max(1)).clamp(1, 4);
    let shard_options = WriteOptions {
        threads: options.threads.div_ceil(parallel).max(1),
        ..*options
    };
    let done: Vec<AtomicU64> = (0..count).map(|_| AtomicU64::new(0)).collect();
    let next = AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<Pending>>>> =
        (0..count).map(|_| std::sync::Mutex::new(None)).collect();
    let data_total: u64 = plans
        .iter()
        .map(|(_, h)| h.len() as u64 + PREFIX_LEN)
        .sum::<u64>()
        + total;
    let caller = std::thread::current();
    let shards_copied = AtomicUsize::new(0);
    let shard_copied = || {
        if shards_copied.fetch_add(1, Ordering::AcqRel) + 1 == count {
            copied();
        }
    };
    let staged = Staged {
        streams,
        copied: &shard_copied,
    };
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..parallel)
            .map(|_| {
                scope.spawn(|| {
                    while let Some(((plan, header), i)) = {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        plans.get(i).map(|p| (p, i))
                    } {
                        let path = folder.join(&names[i]);
                        let result =
                            prepare(plan, header, &path, &shard_options, &staged, &mut |d, _| {
                                done[i].store(d, Ordering::Relaxed)
                            });
                        let failed = result.is_err();
                        *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
                        if failed {
                            // The other workers stop at their next shard.
                            next.store(count, Ordering::Relaxed);
                        }
                    }
                    caller.unpark();
                })
            })
            .collect();
        while !workers.iter().all(|w| w.is_finished()) {
            progress(
                done.iter().map(|d| d.load(Ordering::Relaxed)).sum(),
                data_total,
            );
            std::thread::park_timeout(std::time::Duration::from_millis(100));
        }
    });
    let mut pending = Vec::with_capacity(count);
    for slot in slots {
        match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(p)) => pending.push(p),
            Some(Err(e)) => return Err(e),
            None => {
                return Err(Error::Driver {
                    backend: "writer",
                    message: "a shard writer stopped before its shard".into(),
                });
            }
        }
    }
    for p in pending {
        p.commit()?;
    }
    progress(data_total, data_total);
    let path = match index {
        Some(text) => {
            let path = folder.join(INDEX_NAME);
            write_small_file(&path, text.as_bytes())?;
            path
        }
        None => folder.join(&names[0]),
    };
    remove_stale_shards(folder, &names, count > 1)?;
    Ok(path)
}

/// Removes from `folder` the checkpoint files of an earlier save that the one just written
/// (`names`, with an index where `indexed`) does not name: shards named as Hugging Face names
/// them, `model.safetensors`, and the index. Other files stay, also ones named alike but not
/// exactly (`model-1-of-2.safetensors`, `model-00001-of-00002.safetensors.bak`).
fn remove_stale_shards(folder: &Path, names: &[String], indexed: bool) -> Result<()> {
    let is_shard = |name: &str| {
        let Some(rest) = name
            .strip_prefix("model-")
            .and_then(|r| r.strip_suffix(".safetensors"))
        else {
            return false;
        };
        let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
        matches!(rest.split_once("-of-"), Some((i, n)) if digits(i) && digits(n))
    };
    let entries = std::fs::read_dir(folder).map_err(|e| io_error(folder, e))?;
    let mut removed = false;
    for entry in entries {
        let entry = entry.map_err(|e| io_error(folder, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let checkpoint_file =
            is_shard(name) || name == "model.safetensors" || (name == INDEX_NAME && !indexed);
        if !checkpoint_file || names.iter().any(|n| n == name) {
            continue;
        }
        let path = entry.path();
        // Only files (or links to them): a folder of that name is left alone.
        if entry.file_type().map_err(|e| io_error(&path, e))?.is_dir() {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => removed = true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error(&path, e)),
        }
    }
    if removed {
        sync_folder(&folder.join(INDEX_NAME)).map_err(|e| io_error(folder, e))?;
    }
    Ok(())
}

/// Hugging Face's split of `tensors` (in order) into shards of at most `max` bytes each.
fn split<'a>(
    tensors: &[(&'a str, &'a Tensor)],
    sizes: &BTreeMap<&str, u64>,
    max: u64,
) -> Vec<Vec<(&'a str, &'a Tensor)>> {
    let mut shards = Vec::new();
    let mut current = Vec::new();
    let mut current_size = 0u64;
    for &(name, tensor) in tensors {
        let size = sizes.get(name).copied().unwrap_or(0);
        if size > max {
            shards.push(vec![(name, tensor)]);
            continue;
        }
        if current_size + size > max && !current.is_empty() {
            shards.push(std::mem::take(&mut current));
            current_size = 0;
        }
        current.push((name, tensor));
        current_size += size;
    }
    if !current.is_empty() || shards.is_empty() {
        shards.push(current);
    }
    shards
}

/// Writes `bytes` to `path` atomically and durably (a synced temporary renamed over it, then
/// the folder synced).
fn write_small_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write as _;
    let temp = temp_path(path);
    let pending = Pending {
        path: path.to_path_buf(),
        temp,
        target: path.to_path_buf(),
        committed: false,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&pending.temp)
        .map_err(|e| io_error(path, e))?;
    file.write_all(bytes).map_err(|e| io_error(path, e))?;
    file.sync_all().map_err(|e| io_error(path, e))?;
    pending.commit()
}

/// An engine error about the temporary `temp`, told about `path`, the file the caller named.
fn renamed(e: Error, temp: &Path, path: &Path) -> Error {
    match e {
        Error::Io { path: p, source } if p == temp => io_error(path, source),
        other => other,
    }
}

/// The length prefix and the header: the bytes before the data section.
fn head_bytes(header: &str) -> Vec<u8> {
    let mut head = Vec::with_capacity(PREFIX_LEN as usize + header.len());
    head.extend_from_slice(&(header.len() as u64).to_le_bytes());
    head.extend_from_slice(header.as_bytes());
    head
}

/// The engine's items of a plan whose data section starts at `data_start`.
fn write_items<'a>(plan: &[Planned<'a>], data_start: u64) -> Vec<WriteItem<'a>> {
    let mut offset = data_start;
    plan.iter()
        .map(|item| {
            let write = WriteItem {
                tensor: item.tensor,
                offset,
                nbytes: item.nbytes,
            };
            offset += item.nbytes;
            write
        })
        .collect()
}

/// Syncs the folder `path` lies in, so that a rename into it is durable.
fn sync_folder(path: &Path) -> std::io::Result<()> {
    let folder = match path.parent() {
        Some(folder) if !folder.as_os_str().is_empty() => folder,
        _ => Path::new("."),
    };
    std::fs::File::open(folder)?.sync_all()
}

/// Takes an exclusive `flock` on `file`; `try_only`: without waiting (`WouldBlock` where another
/// holds it).
fn lock(file: &std::fs::File, try_only: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let flags = libc::LOCK_EX | if try_only { libc::LOCK_NB } else { 0 };
    // SAFETY: `flock` on a descriptor `file` owns; it only takes an advisory lock, released when
    // the descriptor is closed.
    if unsafe { libc::flock(file.as_raw_fd(), flags) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Removes the temporaries of saves to `target` that their process left behind: named as
/// [`temp_path`] names them, not locked (the lock goes with the process that wrote them), and
/// not changed for a second (a temporary is locked right after it is created). Best effort.
fn remove_stale_temporaries(target: &Path) {
    let (Some(folder), Some(name)) = (target.parent(), target.file_name()) else {
        return;
    };
    let folder = if folder.as_os_str().is_empty() {
        Path::new(".")
    } else {
        folder
    };
    let prefix = format!(".{}.", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(middle) = file_name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".tmp"))
        else {
            continue;
        };
        let numbered = middle.split('.').count() == 2
            && middle
                .split('.')
                .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if !numbered {
            continue;
        }
        let candidate = entry.path();
        let Ok(file) = std::fs::File::open(&candidate) else {
            continue;
        };
        let old = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= std::time::Duration::from_secs(1));
        if old && file.metadata().is_ok_and(|m| m.is_file()) && lock(&file, true).is_ok() {
            let _ = std::fs::remove_file(&candidate);
        }
    }
}

/// Where a save to `path` writes: `path` itself, or where the chain of symbolic links that
/// `path` is leads (a link's relative target is relative to the link's folder), whether or not
/// that exists.
fn final_target(path: &Path) -> Result<PathBuf> {
    // Linux's own limit on links followed in one path lookup.
    const MAX_LINKS: usize = 40;
    let mut current = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match std::fs::symlink_metadata(&current) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let link = std::fs::read_link(&current).map_err(|e| io_error(path, e))?;
                current = match current.parent() {
                    Some(folder) if link.is_relative() => folder.join(link),
                    _ => link,
                };
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_error(path, e));
            }
            _ => return Ok(current),
        }
    }
    Err(io_error(
        path,
        std::io::Error::from_raw_os_error(libc::ELOOP),
    ))
}

/// A name beside `path` that no other save in this process uses at the same time.
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let stem = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{stem}.{}.{n}.tmp", std::process::id()))
}

/// Writes the planned tensors under `header` (from [`header_json`]) to `writer`; `path` names
/// the destination in I/O errors.
fn write_planned(
    plan: &[Planned<'_>],
    header: &str,
    writer: &mut dyn Write,
    path: &Path,
) -> Result<()> {
    let head = head_bytes(header);
    let items = write_items(plan, head.len() as u64);
    write_to(writer, &head, &items, path)
}

/// Checks names and dtypes and orders the tensors as they will lie in the file: by element type
/// as [`FILE_ORDER`] has them (widest first), then by name.
fn plan<'a>(tensors: &'a [(&'a str, &'a Tensor)]) -> Result<Vec<Planned<'a>>> {
    let mut seen = BTreeSet::new();
    let mut plan = Vec::with_capacity(tensors.len());
    for &(name, tensor) in tensors {
        if name == METADATA_KEY {
            return Err(Error::InvalidArgument(format!(
                "`{METADATA_KEY}` is reserved and cannot name a tensor"
            )));
        }
        if !seen.insert(name) {
            return Err(Error::InvalidArgument(format!(
                "tensor `{name}` is given twice"
            )));
        }
        let dtype = tensor.dtype();
        let Some(dtype_text) = dtype_name(dtype) else {
            return Err(Error::UnsupportedDType(format!(
                "tensor `{name}`: safetensors cannot hold {dtype}"
            )));
        };
        let bits = (tensor.numel() as u128) * dtype.bits() as u128;
        if bits % 8 != 0 {
            return Err(Error::Shape(format!(
                "tensor `{name}`: {} {dtype} elements do not fill whole bytes",
                tensor.numel()
            )));
        }
        plan.push(Planned {
            name,
            tensor,
            dtype: dtype_text,
            // At most the tensor's own size in memory, which fits in isize.
            nbytes: (bits / 8) as u64,
        });
    }
    let rank = |dtype: &str| FILE_ORDER.iter().position(|&d| d == dtype);
    plan.sort_by(|a, b| {
        rank(b.dtype)
            .cmp(&rank(a.dtype))
            .then_with(|| a.name.cmp(b.name))
    });
    Ok(plan)
}

/// The order of element types in a file, last first: the `safetensors` package's (its `Dtype`'s
/// order), so that both write the same bytes for the same tensors. It goes by size, so every
/// tensor is aligned for its elements.
const FILE_ORDER: [&str; 22] = [
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
];

/// The header JSON, padded with spaces so that `8 + len` is a multiple of 8; an
/// [`Error::InvalidArgument`] naming the sizes where it would be longer than [`MAX_HEADER_LEN`].
fn header_json(
    plan: &[Planned<'_>],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<String> {
    let metadata_len: usize = metadata.map_or(0, |m| {
        m.iter().map(|(key, value)| key.len() + value.len()).sum()
    });
    let too_long = |len: usize| {
        Error::InvalidArgument(format!(
            "the safetensors header would be {len} bytes or more ({metadata_len} bytes of \
             metadata keys and values, {} tensors), over the limit of {MAX_HEADER_LEN} bytes \
             that readers accept; nothing was written",
            plan.len()
        ))
    };
    // The JSON is at least as long as the metadata's text: refused before it is built.
    if metadata_len as u64 > MAX_HEADER_LEN {
        return Err(too_long(metadata_len));
    }
    let quote =
        |text: &str| serde_json::to_string(text).map_err(|e| Error::InvalidArgument(e.to_string()));
    let mut json = String::from("{");
    let mut first = true;
    if let Some(metadata) = metadata {
        json.push_str(&quote(METADATA_KEY)?);
        json.push_str(":{");
        for (i, (key, value)) in metadata.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push_str(&quote(key)?);
            json.push(':');
            json.push_str(&quote(value)?);
        }
        json.push('}');
        first = false;
    }
    let mut offset = 0u64;
    for item in plan {
        if !first {
            json.push(',');
        }
        first = false;
        let shape: Vec<String> = item.tensor.shape().iter().map(usize::to_string).collect();
        let end = offset
            .checked_add(item.nbytes)
            .ok_or_else(|| crate::error::overflow("safetensors data section"))?;
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            quote(item.name)?,
            item.dtype,
            shape.join(",")
        ));
        offset = end;
    }
    json.push('}');
    let padded = (PREFIX_LEN as usize + json.len()).next_multiple_of(8) - PREFIX_LEN as usize;
    if padded as u64 > MAX_HEADER_LEN {
        return Err(too_long(padded));
    }
    json.extend(std::iter::repeat_n(' ', padded - json.len()));
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element type the format names has its place in the file order, and the order goes
    /// from the widest to the narrowest, so each tensor starts aligned for its elements.
    #[test]
    fn the_file_order_covers_every_dtype_widest_first() {
        let names: Vec<&str> = crate::safetensors::dtype_names().collect();
        assert_eq!(names.len(), FILE_ORDER.len());
        let bits = |name: &str| crate::safetensors::dtype_from_name(name).unwrap().bits();
        for name in names {
            assert!(FILE_ORDER.contains(&name), "{name}");
        }
        // BOOL (a byte, aligned anywhere) comes last, below the packed types, as safetensors
        // places it.
        assert_eq!(FILE_ORDER[0], "BOOL");
        for pair in FILE_ORDER[1..].windows(2) {
            assert!(bits(pair[0]) <= bits(pair[1]), "{pair:?}");
        }
    }

    /// Hugging Face's split: tensors in order, a new shard where the next would overflow, one
    /// Only checkpoint files an earlier save left are removed: shards of another count, an
    /// index under a one-file checkpoint; files named alike but not exactly stay.
    #[test]
    fn stale_shards_are_removed_and_nothing_else() {
        let folder =
            std::env::temp_dir().join(format!("dlbridge-stale-shards-{}", std::process::id()));
        std::fs::create_dir_all(&folder).unwrap();
        let stale = [
            "model-00001-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            INDEX_NAME,
        ];
        let kept = [
            "model-00001-of-00001.safetensors.tmp",
            "model-1-of-3.safetensors",
            "model-0000a-of-00003.safetensors",
            "xmodel-00001-of-00003.safetensors",
            "notes.txt",
        ];
        for name in stale.iter().chain(&kept) {
            std::fs::write(folder.join(name), b"old").unwrap();
        }
        std::fs::create_dir(folder.join("model-00002-of-00003.safetensors")).unwrap();
        std::fs::write(folder.join("model.safetensors"), b"new").unwrap();
        remove_stale_shards(&folder, &["model.safetensors".to_owned()], false).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&folder)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut expected: Vec<String> = kept.iter().map(|s| s.to_string()).collect();
        expected.push("model-00002-of-00003.safetensors".into()); // a folder: left alone
        expected.push("model.safetensors".into());
        expected.sort();
        assert_eq!(left, expected);
        std::fs::remove_dir_all(&folder).unwrap();
    }

    /// over the limit alone (placed before the shard being filled), nothing left empty.
    #[test]
    fn shards_split_as_hugging_face_splits_them() {
        let t = |n: usize| Tensor::zeros(&[n], crate::DType::U8, crate::Device::CPU).unwrap();
        let (a, b, c, huge, d) = (t(4), t(4), t(4), t(12), t(2));
        let tensors = [("a", &a), ("b", &b), ("c", &c), ("huge", &huge), ("d", &d)];
        let sizes: BTreeMap<&str, u64> = tensors
            .iter()
            .map(|(n, t)| (*n, t.numel() as u64))
            .collect();
        let names = |max| -> Vec<Vec<&str>> {
            split(&tensors, &sizes, max)
                .iter()
                .map(|s| s.iter().map(|(n, _)| *n).collect())
                .collect()
        };
        assert_eq!(names(10), [vec!["a", "b"], vec!["huge"], vec!["c", "d"]]);
        assert_eq!(names(100), [vec!["a", "b", "c", "huge", "d"]]);
        assert_eq!(
            names(1),
            [vec!["a"], vec!["b"], vec!["c"], vec!["huge"], vec!["d"]]
        );
        assert_eq!(
            split(&[], &sizes, 10).len(),
            1,
            "no tensors: one empty file"
        );
    }
}
