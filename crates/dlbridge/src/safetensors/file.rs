//! Opening safetensors files: one file ([`SafeTensors`]) or a sharded checkpoint
//! ([`Checkpoint`]), each mapped read-only; tensors are zero-copy views of the mapping.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::ops::Range;
use std::path::{Component, Path};
use std::ptr::NonNull;
use std::sync::Arc;

use serde_json::Value;

use crate::backend;
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

use super::header::{
    Header, MAX_HEADER_LEN, TensorInfo, file_len, invalid_file, io_error, open_file,
};

/// Where one tensor's bytes lie: the plan a loader (the CPU path here, a device loader elsewhere)
/// reads from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLocation {
    /// The tensor's name.
    pub name: String,
    /// The file holding it.
    pub file: Arc<Path>,
    /// Absolute byte range in the file.
    pub byte_range: Range<u64>,
    /// Element type (sub-byte types are stored densely packed).
    pub dtype: DType,
    /// Extents.
    pub shape: Vec<usize>,
}

/// A read-only memory map of a whole file (private, or shared for the CUDA reader that registers
/// its pages with the driver), unmapped when dropped.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only (PROT_READ) and owned by this value alone: any thread may read
// through it, and `munmap` in `Drop` may run on any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared access only reads the immutable pointer and length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` (> 0) bytes of `file`, privately or `shared`.
    pub(crate) fn new(
        file: &std::fs::File,
        len: usize,
        path: &Path,
        shared: bool,
    ) -> Result<Mapping> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh mapping at an address of the kernel's choosing (NULL hint, no
        // MAP_FIXED) replaces no existing memory; `fd` is an open descriptor that outlives the
        // call, and the mapping stays valid after the descriptor is closed.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                if shared {
                    libc::MAP_SHARED
                } else {
                    libc::MAP_PRIVATE
                },
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io_error(path, std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io_error(path, std::io::Error::other("mmap returned a NULL mapping")))?;
        Ok(Mapping { ptr, len })
    }

    /// The address of the file's byte 0.
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The mapped length.
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` addresses `len` readable bytes mapped for as long as `self` lives. The file
        // may change under a private mapping if another process writes it; the header is parsed
        // once from these bytes and the result is what is trusted afterwards.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly one live mapping made in `Mapping::new`; every view of
        // it holds a clone of the buffer that owns this value, so none outlives the unmap.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            log::warn!(
                "munmap of a safetensors mapping failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// One safetensors file, opened: its validated [`Header`] and a read-only map of the whole file
/// as a foreign-owned [`Buffer`].
///
/// Tensors are views of the mapping (zero-copy, read-only, keeping the map alive) unless their
/// bytes are not aligned for their element type, or a copy is asked for.
#[derive(Clone, Debug)]
pub struct SafeTensors {
    path: Arc<Path>,
    header: Header,
    buffer: Buffer,
}

impl SafeTensors {
    /// Opens, maps and validates the file at `path` (see [`Header::parse`] for what is checked).
    ///
    /// The file must not be truncated while mapped: reading a page past the new end raises
    /// `SIGBUS`, as with any memory-mapped file.
    pub fn open(path: impl AsRef<Path>) -> Result<SafeTensors> {
        let path = path.as_ref();
        let file = open_file(path)?;
        let len = file_len(&file, path)?;
        if len < super::header::PREFIX_LEN {
            // Too short to map usefully; the parser names what is missing.
            return Err(Header::parse(&[], len, path)
                .err()
                .unwrap_or_else(|| invalid_file(path, format!("{len} bytes is too short"))));
        }
        let map_len = usize::try_from(len)
            .map_err(|_| invalid_file(path, format!("{len} bytes cannot be mapped")))?;
        let mapping = Mapping::new(&file, map_len, path, false)?;
        let header = Header::parse(mapping.bytes(), len, path)?;
        let base = mapping.ptr.as_ptr();
        // SAFETY: `base` addresses the `map_len` bytes of the mapping, readable (never writable:
        // PROT_READ, and the buffer is read-only) for as long as `mapping`, moved into the keep-alive,
        // lives.
        let buffer = unsafe {
            Buffer::from_foreign(
                base.cast(),
                base,
                map_len,
                Device::CPU,
                StorageMode::Shared,
                true,
                Box::new(mapping),
            )
        };
        Ok(SafeTensors {
            path: Arc::from(path),
            header,
            buffer,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The read-only mapping of the whole file (byte 0 is the start of the file).
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The tensor names, in name order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.header.keys()
    }

    /// The header's string metadata.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        self.header.metadata()
    }

    /// One tensor's dtype, shape and byte range.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }

    /// The locations of the tensors `select` accepts, in file order.
    pub fn plan(&self, mut select: impl FnMut(&str) -> bool) -> Vec<TensorLocation> {
        let mut plan: Vec<TensorLocation> = self
            .header
            .tensors()
            .iter()
            .filter(|(name, _)| select(name))
            .map(|(name, info)| TensorLocation {
                name: name.clone(),
                file: self.path.clone(),
                byte_range: info.byte_range(),
                dtype: info.dtype(),
                shape: info.shape().to_vec(),
            })
            .collect();
        plan.sort_by_key(|loc| loc.byte_range.start);
        plan
    }

    /// One tensor on the CPU. With `copy` false: a read-only view of the mapping (a read-only
    /// private copy when the bytes are not aligned for the element type); with `copy` true:
    /// writable memory of dlbridge's pool that nothing else references.
    pub fn tensor(&self, name: &str, copy: bool) -> Result<Tensor> {
        let info = self.info(name).ok_or_else(|| {
            Error::InvalidArgument(format!("no tensor `{name}` in {}", self.path.display()))
        })?;
        self.load_info(info, copy)
    }

    /// The tensors named in `names` (each must exist), as [`SafeTensors::tensor`] loads them.
    pub fn load<S: AsRef<str>>(&self, names: &[S], copy: bool) -> Result<BTreeMap<String, Tensor>> {
        by_name(names, |name| self.tensor(name, copy))
    }

    /// The tensors whose names `select` accepts.
    pub fn load_where(
        &self,
        mut select: impl FnMut(&str) -> bool,
        copy: bool,
    ) -> Result<BTreeMap<String, Tensor>> {
        self.header
            .tensors()
            .iter()
            .filter(|(name, _)| select(name))
            .map(|(name, info)| Ok((name.clone(), self.load_info(info, copy)?)))
            .collect()
    }

    fn load_info(&self, info: &TensorInfo, copy: bool) -> Result<Tensor> {
        let range = info.byte_range();
        // Inside the mapped file (checked by the parser), so both ends fit in usize.
        let (start, len) = (range.start as usize, info.nbytes() as usize);
        let base = self.buffer.require_host("loading a tensor")?;
        let packed = info.is_packed();
        let aligned = is_aligned((base.as_ptr() as usize).wrapping_add(start), info.dtype());
        if aligned && !copy {
            let layout = Layout::contiguous_at(info.shape(), start)?;
            return Tensor::with_packing(self.buffer.clone(), info.dtype(), layout, packed);
        }
        let buffer = backend::allocate(Device::CPU, len, None, false)?;
        if len > 0 {
            let dst = buffer.require_host("copying a tensor")?;
            let src = base.as_ptr().wrapping_add(start);
            // SAFETY: `src` starts `len` bytes inside the live mapping (bounds checked by the
            // parser); `dst` is a new allocation of `len` bytes no one else references; a mapping
            // and a pool block never overlap.
            unsafe { std::ptr::copy_nonoverlapping(src, dst.as_ptr(), len) };
        }
        let tensor = Tensor::with_packing(
            buffer,
            info.dtype(),
            Layout::contiguous(info.shape())?,
            packed,
        )?;
        // Without `copy` the caller gets read-only memory whether or not it had to be copied.
        Ok(if copy {
            tensor
        } else {
            tensor.into_read_only()
        })
    }
}

/// A checkpoint of one or more safetensors files (shards): a single file, a list of files, or a
/// `model.safetensors.index.json` (`{"metadata": {..}, "weight_map": {name: file}}`).
///
/// Every tensor name belongs to exactly one shard.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    shards: Vec<SafeTensors>,
    /// Tensor name → index into `shards`.
    names: BTreeMap<String, usize>,
    metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens an index (a path ending in `.json`) with [`Checkpoint::open_index`], else one
    /// safetensors file.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        if path.extension().is_some_and(|ext| ext == "json") {
            Checkpoint::open_index(path)
        } else {
            Checkpoint::open_files(&[path])
        }
    }

    /// Opens the given shards; a tensor name in two of them is an [`Error::InvalidFile`].
    pub fn open_files<P: AsRef<Path>>(paths: &[P]) -> Result<Checkpoint> {
        let shards = paths
            .iter()
            .map(SafeTensors::open)
            .collect::<Result<Vec<_>>>()?;
        Checkpoint::from_shards(shards, BTreeMap::new())
    }

    /// Opens a sharded checkpoint from its index file. Shard paths are relative to the index's
    /// folder and may not leave it; a missing shard is an [`Error::Io`] naming it (kind
    /// `NotFound`); a name the index places in a shard that lacks it, or a name found in two
    /// shards, is an [`Error::InvalidFile`]. String metadata values are kept as they are; other
    /// values (such as `total_size`) as their JSON text.
    pub fn open_index(index: impl AsRef<Path>) -> Result<Checkpoint> {
        let index = index.as_ref();
        let invalid = |reason: String| invalid_file(index, reason);
        let text = read_index(index)?;
        let value: Value = super::header::parse_strict_json(&text)
            .map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        let Value::Object(mut root) = value else {
            return Err(invalid("the index is not a JSON object".into()));
        };
        let metadata = match root.remove("metadata") {
            None | Some(Value::Null) => BTreeMap::new(),
            Some(Value::Object(map)) => map
                .into_iter()
                .map(|(key, value)| match value {
                    Value::String(text) => (key, text),
                    other => (key, other.to_string()),
                })
                .collect(),
            Some(_) => return Err(invalid("`metadata` is not an object".into())),
        };
        let Some(Value::Object(weight_map)) = root.remove("weight_map") else {
            return Err(invalid("the index has no `weight_map` object".into()));
        };
        let folder = index.parent().unwrap_or(Path::new(""));
        let mut wanted: Vec<(String, String)> = Vec::with_capacity(weight_map.len());
        for (name, file) in weight_map {
            let Value::String(file) = file else {
                return Err(invalid(format!(
                    "`weight_map` entry `{name}` is not a file name"
                )));
            };
            let relative = Path::new(&file);
            let inside = relative
                .components()
                .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
            if !inside || file.is_empty() {
                return Err(invalid(format!(
                    "shard `{file}` (of tensor `{name}`) is not a path inside the index's folder"
                )));
            }
            wanted.push((name, file));
        }
        let files: BTreeSet<&str> = wanted.iter().map(|(_, file)| file.as_str()).collect();
        let shards = files
            .iter()
            .map(|file| SafeTensors::open(folder.join(file)))
            .collect::<Result<Vec<_>>>()?;
        let files: Vec<&str> = files.into_iter().collect();
        for (name, file) in &wanted {
            // Every file of `wanted` is in `files`, so the search finds it.
            let shard = files.binary_search(&file.as_str()).unwrap_or(0);
            if shards[shard].info(name).is_none() {
                return Err(invalid(format!(
                    "`weight_map` places tensor `{name}` in `{file}`, which has no such tensor"
                )));
            }
        }
        Checkpoint::from_shards(shards, metadata)
    }

    fn from_shards(
        shards: Vec<SafeTensors>,
        metadata: BTreeMap<String, String>,
    ) -> Result<Checkpoint> {
        let mut names = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            for name in shard.keys() {
                if let Some(&first) = names.get(name) {
                    let first: &SafeTensors = &shards[first];
                    return Err(invalid_file(
                        shard.path(),
                        format!(
                            "tensor `{name}` is also in {}: a name may be in one shard only",
                            first.path().display()
                        ),
                    ));
                }
                names.insert(name.to_owned(), i);
            }
        }
        Ok(Checkpoint {
            shards,
            names,
            metadata,
        })
    }

    /// The shards, in the order given (for an index: in file-name order).
    pub fn shards(&self) -> &[SafeTensors] {
        &self.shards
    }

    /// All tensor names, in name order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// The checkpoint's metadata: the index's, or a single file's own header metadata (empty for
    /// a list of several files; each shard's own header metadata is in [`Checkpoint::shards`]).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        match self.shards.as_slice() {
            [only] if self.metadata.is_empty() => only.metadata(),
            _ => &self.metadata,
        }
    }

    /// The shard holding `name`, and the tensor's entry there.
    pub fn info(&self, name: &str) -> Option<(&SafeTensors, &TensorInfo)> {
        let shard = &self.shards[*self.names.get(name)?];
        Some((shard, shard.info(name)?))
    }

    /// The locations of the tensors `select` accepts, shard by shard, in file order within a
    /// shard: the plan a loader reads sequentially.
    pub fn plan(&self, mut select: impl FnMut(&str) -> bool) -> Vec<TensorLocation> {
        self.shards
            .iter()
            .flat_map(|shard| shard.plan(&mut select))
            .collect()
    }

    /// One tensor, as [`SafeTensors::tensor`] loads it.
    pub fn tensor(&self, name: &str, copy: bool) -> Result<Tensor> {
        match self.names.get(name) {
            Some(&shard) => self.shards[shard].tensor(name, copy),
            None => Err(Error::InvalidArgument(format!(
                "no tensor `{name}` in the checkpoint"
            ))),
        }
    }

    /// The tensors named in `names` (each must exist).
    pub fn load<S: AsRef<str>>(&self, names: &[S], copy: bool) -> Result<BTreeMap<String, Tensor>> {
        by_name(names, |name| self.tensor(name, copy))
    }

    /// The tensors whose names `select` accepts.
    pub fn load_where(
        &self,
        mut select: impl FnMut(&str) -> bool,
        copy: bool,
    ) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for shard in &self.shards {
            out.append(&mut shard.load_where(&mut select, copy)?);
        }
        Ok(out)
    }
}

/// Whether bytes at `address` can be viewed in place as elements of `dtype`: aligned for its
/// item size (one byte for packed sub-byte elements). Bytes that are not are copied.
pub(super) fn is_aligned(address: usize, dtype: DType) -> bool {
    address % dtype.itemsize() == 0
}

/// The index file's text, at most [`MAX_HEADER_LEN`] bytes.
fn read_index(path: &Path) -> Result<String> {
    let file = open_file(path)?;
    let len = file_len(&file, path)?;
    if len > MAX_HEADER_LEN {
        return Err(invalid_file(
            path,
            format!("the index is {len} bytes, over the limit of {MAX_HEADER_LEN}"),
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_HEADER_LEN)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(path, e))?;
    String::from_utf8(bytes).map_err(|e| {
        invalid_file(
            path,
            format!(
                "not UTF-8 (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// The tensors named in `names`, each loaded by `load`: the one loop behind
/// [`SafeTensors::load`] and [`Checkpoint::load`].
fn by_name<S: AsRef<str>>(
    names: &[S],
    mut load: impl FnMut(&str) -> Result<Tensor>,
) -> Result<BTreeMap<String, Tensor>> {
    names
        .iter()
        .map(|name| {
            let name = name.as_ref();
            Ok((name.to_owned(), load(name)?))
        })
        .collect()
}
