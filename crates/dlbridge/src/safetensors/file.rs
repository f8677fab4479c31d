//! Opening safetensors files: one file ([`SafeTensors`]) or a sharded checkpoint
//! ([`Checkpoint`]), each mapped copy-on-write; tensors are zero-copy views of the mapping.

use std::collections::BTreeMap;
use std::io::Read;
use std::ops::Range;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::backend;
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

use super::header::{
    Header, MAX_HEADER_LEN, TensorInfo, file_len, invalid_file, io_error, open_regular,
};
use super::index::Index;

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

/// A memory map of a whole file, unmapped when dropped: private and copy-on-write (the file's
/// pages, readable and writable, a written page becoming the process's own copy and the file
/// never written), private and read-only where the system refuses that, or shared and read-only
/// for the CUDA reader that registers its pages with the driver (never handed out).
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is owned by this value alone and `munmap` in `Drop` may run on any thread.
// This value itself only reads through it (`bytes`, while the file is opened, before any view of
// it exists); writes, where the mapping is writable, come from views' consumers, whose
// synchronisation is theirs, as for any memory a tensor views.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared access only reads the immutable pointer and length.
unsafe impl Sync for Mapping {}

/// The environment variable that makes [`Mapping::copy_on_write`] act as if the system had
/// refused the writable mapping (`1`), so that tests can run the read-only fallback where no
/// strict overcommit policy refuses it. For tests only.
const REFUSE_COPY_ON_WRITE: &str = "_DLBRIDGE_TEST_REFUSE_COPY_ON_WRITE";

impl Mapping {
    /// Maps the first `len` (> 0) bytes of `file` privately and copy-on-write, without reserving
    /// swap for the pages a writer could copy (`MAP_NORESERVE`, so that a mapping larger than
    /// the machine's memory is not refused under the kernel's default overcommit heuristic).
    /// Where the system refuses a writable mapping (strict overcommit accounting,
    /// `vm.overcommit_memory=2`, charges the whole length), the bytes are mapped private and
    /// read-only instead: [`Mapping::is_writable`] then says `false`.
    pub(crate) fn copy_on_write(file: &std::fs::File, len: usize, path: &Path) -> Result<Mapping> {
        let refused = std::env::var_os(REFUSE_COPY_ON_WRITE).is_some_and(|v| v == "1");
        let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE;
        let writable = if refused {
            None
        } else {
            Mapping::map(file, len, path, libc::PROT_READ | libc::PROT_WRITE, flags).ok()
        };
        match writable {
            Some(mapping) => Ok(mapping),
            None => Mapping::map(file, len, path, libc::PROT_READ, libc::MAP_PRIVATE),
        }
    }

    /// Maps the first `len` (> 0) bytes of `file` shared and read-only.
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) fn shared(file: &std::fs::File, len: usize, path: &Path) -> Result<Mapping> {
        Mapping::map(file, len, path, libc::PROT_READ, libc::MAP_SHARED)
    }

    fn map(
        file: &std::fs::File,
        len: usize,
        path: &Path,
        prot: libc::c_int,
        flags: libc::c_int,
    ) -> Result<Mapping> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh mapping at an address of the kernel's choosing (NULL hint, no
        // MAP_FIXED) replaces no existing memory; `fd` is an open descriptor that outlives the
        // call, and the mapping stays valid after the descriptor is closed. A writable mapping
        // is private (the callers never pass MAP_SHARED with PROT_WRITE): the file is not written.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, file.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io_error(path, std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io_error(path, std::io::Error::other("mmap returned a NULL mapping")))?;
        Ok(Mapping {
            ptr,
            len,
            writable: prot & libc::PROT_WRITE != 0,
        })
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

    /// Whether the pages are writable (private and copy-on-write): a write through a view, by a
    /// consumer that ignores the views' read-only flag, then cannot fault.
    pub(crate) fn is_writable(&self) -> bool {
        self.writable
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` addresses `len` readable bytes mapped for as long as `self` lives. The file
        // may change under a private mapping if another process writes it; the header is parsed
        // once from these bytes, before any view of the mapping exists, and the result is what is
        // trusted afterwards.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly one live mapping made in `Mapping::map`; every view of
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

/// One safetensors file, opened: its validated [`Header`] and a map of the whole file as a
/// foreign-owned, read-only [`Buffer`].
///
/// Tensors are views of the mapping (zero-copy, read-only, keeping the map alive) unless their
/// bytes are not aligned for their element type, or a copy is asked for.
///
/// The file is mapped private and copy-on-write: its pages are the file's until written, the
/// file itself is never written, and a consumer that ignores the views' read-only flag (PyTorch
/// does, through DLPack) writes a page that becomes this process's own copy instead of faulting.
/// Such a write is seen by every view of this opening of the file (they are one memory), not by
/// the file, other openings of it or other processes. Where the system refuses a writable
/// private mapping (strict overcommit, `vm.overcommit_memory=2`), the file is mapped read-only
/// and tensors are copies, so that no write into one can fault ([`SafeTensors::is_copy_on_write`]
/// says which).
///
/// A view shows the file's pages: the file must not be truncated while mapped (reading a page
/// past the new end raises `SIGBUS`, as with any memory-mapped file), and a change written into
/// the file in place shows through in pages this process has not written. Copies
/// (`copy = true`) are memory of their own.
#[derive(Clone, Debug)]
pub struct SafeTensors {
    path: Arc<Path>,
    header: Header,
    buffer: Buffer,
    /// The open file the mapping was made from: loaders read from it, not from the path again.
    file: Arc<std::fs::File>,
    copy_on_write: bool,
}

impl SafeTensors {
    /// Opens, maps and validates the file at `path` (see [`Header::parse`] for what is checked).
    ///
    /// Anything but a regular file (a FIFO, a socket, a device, a directory) is refused with an
    /// [`Error::Io`] saying what it is, before it is read, so that no open or read can block.
    pub fn open(path: impl AsRef<Path>) -> Result<SafeTensors> {
        let path = path.as_ref();
        let file = open_regular(path, 0)?;
        let len = file_len(&file, path)?;
        if len < super::header::PREFIX_LEN {
            // Too short to map usefully; the parser names what is missing.
            return Err(Header::parse(&[], len, path)
                .err()
                .unwrap_or_else(|| invalid_file(path, format!("{len} bytes is too short"))));
        }
        let map_len = usize::try_from(len)
            .map_err(|_| invalid_file(path, format!("{len} bytes cannot be mapped")))?;
        let mapping = Mapping::copy_on_write(&file, map_len, path)?;
        let header = Header::parse(mapping.bytes(), len, path)?;
        let copy_on_write = mapping.is_writable();
        let base = mapping.ptr.as_ptr();
        // SAFETY: `base` addresses the `map_len` bytes of the mapping, readable for as long as
        // `mapping`, moved into the keep-alive, lives. The buffer is read-only, so dlbridge never
        // writes them; a consumer that ignores that writes private copy-on-write pages, or, where
        // the mapping is read-only, gets no view of them (`load_info` copies).
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
            file: Arc::new(file),
            copy_on_write,
        })
    }

    /// Whether the file is mapped copy-on-write (writable private pages: tensors are views of
    /// them), or read-only because the system refused that (tensors are copies).
    pub fn is_copy_on_write(&self) -> bool {
        self.copy_on_write
    }

    /// The open file the mapping was made from, for readers (no second open of the path, which
    /// could have changed since).
    pub(crate) fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The mapping of the whole file, a read-only buffer (byte 0 is the start of the file).
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The tensor names, in name order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.header.keys()
    }

    /// The header's string metadata (`None` where the header has none).
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.header.metadata()
    }

    /// One tensor's dtype, shape and byte range.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }

    /// The locations of the tensors `select` accepts, in file order (by byte range).
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
        // As the `safetensors` package orders them: an empty tensor before one that begins
        // where it lies.
        plan.sort_by_key(|loc| (loc.byte_range.start, loc.byte_range.end));
        plan
    }

    /// One tensor on the CPU. With `copy` false: a read-only view of the mapping (a read-only
    /// private copy when the bytes are not aligned for the element type, or the mapping is not
    /// copy-on-write); with `copy` true: writable memory of dlbridge's pool that nothing else
    /// references.
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
        if aligned && !copy && self.copy_on_write {
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
/// `model.safetensors.index.json` (`{"metadata": {..}, "weight_map": {name: file}}`, see
/// [`Index`]).
///
/// Every tensor name belongs to exactly one shard.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    shards: Vec<SafeTensors>,
    /// Tensor name → index into `shards`.
    names: BTreeMap<String, usize>,
    /// The index's metadata (for a checkpoint opened from an index).
    metadata: Option<BTreeMap<String, String>>,
    from_index: bool,
}

impl Checkpoint {
    /// Opens an index (a path ending in `.json`) with [`Checkpoint::open_index`], a folder with
    /// [`Checkpoint::open_folder`], else one safetensors file.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        if path.extension().is_some_and(|ext| ext == "json") {
            Checkpoint::open_index(path)
        } else if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            Checkpoint::open_folder(path)
        } else {
            Checkpoint::open_files(&[path])
        }
    }

    /// Opens the checkpoint a folder holds, as Hugging Face lays one out: its
    /// `model.safetensors.index.json` where there is one, else its one `*.safetensors.index.json`
    /// (such as diffusers' `diffusion_pytorch_model.safetensors.index.json`), else every
    /// `*.safetensors` file in it, in name order. Links are followed (a snapshot of the Hugging
    /// Face cache is a folder of links).
    ///
    /// # Errors
    /// A folder with none of these ([`Error::Io`] of kind `NotFound`, saying what was looked
    /// for), several indexes and no `model.safetensors.index.json` ([`Error::InvalidArgument`]
    /// naming them), and the errors of [`Checkpoint::open_index`] and
    /// [`Checkpoint::open_files`].
    pub fn open_folder(folder: impl AsRef<Path>) -> Result<Checkpoint> {
        const INDEX: &str = "model.safetensors.index.json";
        let folder = folder.as_ref();
        let mut names: Vec<std::ffi::OsString> = std::fs::read_dir(folder)
            .map_err(|e| io_error(folder, e))?
            .map(|entry| entry.map(|e| e.file_name()))
            .collect::<std::io::Result<_>>()
            .map_err(|e| io_error(folder, e))?;
        names.sort();
        let ends = |name: &std::ffi::OsString, suffix: &str| {
            name.as_encoded_bytes().ends_with(suffix.as_bytes())
        };
        let indexes: Vec<&std::ffi::OsString> = names
            .iter()
            .filter(|n| ends(n, ".safetensors.index.json"))
            .collect();
        let index = match indexes.as_slice() {
            _ if indexes.iter().any(|n| *n == INDEX) => Some(Path::new(INDEX)),
            [one] => Some(Path::new(one.as_os_str())),
            [] => None,
            several => {
                let listed: Vec<String> = several
                    .iter()
                    .map(|n| n.to_string_lossy().into_owned())
                    .collect();
                return Err(Error::InvalidArgument(format!(
                    "{} holds several checkpoint indexes ({}) and no {INDEX}: name the one to load",
                    folder.display(),
                    listed.join(", ")
                )));
            }
        };
        if let Some(index) = index {
            return Checkpoint::open_index(folder.join(index));
        }
        let files: Vec<std::path::PathBuf> = names
            .iter()
            .filter(|n| ends(n, ".safetensors"))
            .map(|n| folder.join(n))
            .collect();
        if files.is_empty() {
            return Err(io_error(
                folder,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("is a directory holding no {INDEX} and no *.safetensors file"),
                ),
            ));
        }
        Checkpoint::open_files(&files)
    }

    /// Opens the given shards; a tensor name in two of them is an [`Error::InvalidFile`].
    pub fn open_files<P: AsRef<Path>>(paths: &[P]) -> Result<Checkpoint> {
        let shards = paths
            .iter()
            .map(SafeTensors::open)
            .collect::<Result<Vec<_>>>()?;
        Checkpoint::from_shards(shards, None, false)
    }

    /// Opens a sharded checkpoint from its index file ([`Index::parse`] says what is checked).
    /// Shard paths are relative to the index's folder and may not leave it; a missing shard is an
    /// [`Error::Io`] naming it (kind `NotFound`); a name the index places in a shard that lacks
    /// it, or a name found in two shards, is an [`Error::InvalidFile`]. The index and the shards
    /// must be regular files, as [`SafeTensors::open`] says.
    pub fn open_index(index: impl AsRef<Path>) -> Result<Checkpoint> {
        let index = index.as_ref();
        let parsed = Index::parse(&read_index(index)?, index)?;
        let folder = index.parent().unwrap_or(Path::new(""));
        let files: Vec<&str> = parsed.shards().into_iter().collect();
        let shards = files
            .iter()
            .map(|file| SafeTensors::open(folder.join(file)))
            .collect::<Result<Vec<_>>>()?;
        for (name, file) in parsed.weight_map() {
            // Every file of the weight map is in `files`, so the search finds it.
            let shard = files.binary_search(&file.as_str()).unwrap_or(0);
            if shards[shard].info(name).is_none() {
                return Err(invalid_file(
                    index,
                    format!(
                        "`weight_map` places tensor `{name}` in `{file}`, which has no such tensor"
                    ),
                ));
            }
        }
        Checkpoint::from_shards(shards, parsed.metadata().cloned(), true)
    }

    fn from_shards(
        shards: Vec<SafeTensors>,
        metadata: Option<BTreeMap<String, String>>,
        from_index: bool,
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
            from_index,
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

    /// The checkpoint's metadata: an index's `metadata`, or a single file's header metadata;
    /// `None` where that has none, and for a list of several files (each shard's own header
    /// metadata is in [`Checkpoint::shards`]).
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        match self.shards.as_slice() {
            _ if self.from_index => self.metadata.as_ref(),
            [only] => only.metadata(),
            _ => None,
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

/// The tensors and metadata of a safetensors file held in memory (what [`serialize`] gives; the
/// `safetensors` package's `load(bytes)`): the header is checked as [`Header::parse`] checks a
/// file's (errors name the file `<bytes>`), and each tensor is copied into writable CPU memory
/// of its own.
///
/// [`serialize`]: super::serialize
#[allow(clippy::type_complexity)] // (metadata, tensors): what `serialize` takes, given back
pub fn deserialize(
    bytes: &[u8],
) -> Result<(Option<BTreeMap<String, String>>, BTreeMap<String, Tensor>)> {
    let header = Header::parse(bytes, bytes.len() as u64, Path::new("<bytes>"))?;
    let mut out = BTreeMap::new();
    for (name, info) in header.tensors() {
        let range = info.byte_range();
        // Inside `bytes` (checked by the parser).
        let src = &bytes[range.start as usize..range.end as usize];
        let buffer = backend::allocate(Device::CPU, src.len(), None, false)?;
        if !src.is_empty() {
            let dst = buffer.require_host("copying a tensor")?;
            // SAFETY: `dst` is a new allocation of `src.len()` bytes that nothing else references,
            // so it cannot overlap `src`.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), src.len()) };
        }
        let layout = Layout::contiguous(info.shape())?;
        let tensor = Tensor::with_packing(buffer, info.dtype(), layout, info.is_packed())?;
        out.insert(name.clone(), tensor);
    }
    Ok((header.metadata().cloned(), out))
}

/// Whether bytes at `address` can be viewed in place as elements of `dtype`: aligned for its
/// item size (one byte for packed sub-byte elements). Bytes that are not are copied.
pub(super) fn is_aligned(address: usize, dtype: DType) -> bool {
    address % dtype.itemsize() == 0
}

/// The index file's bytes: at most [`MAX_HEADER_LEN`] (plus one, for [`Index::parse`] to
/// refuse), read from a regular file.
fn read_index(path: &Path) -> Result<Vec<u8>> {
    let file = open_regular(path, 0)?;
    let len = file_len(&file, path)?;
    if len > MAX_HEADER_LEN {
        return Err(invalid_file(
            path,
            format!("the index is {len} bytes, over the limit of {MAX_HEADER_LEN}"),
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_HEADER_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(path, e))?;
    Ok(bytes)
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
