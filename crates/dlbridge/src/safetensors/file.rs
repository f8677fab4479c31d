//! Opening safetensors files: one file ([`SafeTensors`]) or a sharded checkpoint
//! ([`Checkpoint`]), each mapped copy-on-write; tensors are zero-copy views of the mapping.

use std::collections::BTreeMap;
use std::io::Read;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::backend;
use crate::buffer::Buffer;
use crate::device::Device;
use crate::dtype::DType;
use crate::engine::{MappedFile, file_len, host_tensor, io_error, open_regular};
use crate::error::{Error, Result, invalid_file};
use crate::layout::Layout;
use crate::tensor::Tensor;

use super::header::{Header, MAX_HEADER_LEN, PREFIX_LEN, TensorInfo, header_len, too_short};
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

impl Header {
    /// Reads and parses the header of the file at `path`, without reading its data.
    ///
    /// I/O failures are [`Error::Io`] with the system's error kind (`NotFound`, `IsADirectory`,
    /// `PermissionDenied`, ...); a path that is not a regular file (a FIFO, a socket, a device)
    /// is refused before it is read, as [`SafeTensors::open`](super::SafeTensors::open) says.
    pub fn read(path: &Path) -> Result<Header> {
        let mut file = open_regular(path, 0)?;
        let file_len = file_len(&file, path)?;
        let mut prefix = [0u8; PREFIX_LEN as usize];
        if file_len < PREFIX_LEN {
            return Err(too_short(path, file_len));
        }
        file.read_exact(&mut prefix)
            .map_err(|e| io_error(path, e))?;
        let header_len = header_len(&prefix, file_len, path)?;
        // At most PREFIX_LEN + MAX_HEADER_LEN bytes (checked above).
        let total = (PREFIX_LEN + header_len) as usize;
        let mut bytes = crate::error::host_vec::<u8>(total)?;
        bytes.extend_from_slice(&prefix);
        bytes.resize(total, 0);
        file.read_exact(&mut bytes[PREFIX_LEN as usize..])
            .map_err(|e| io_error(path, e))?;
        Header::parse(&bytes, file_len, path)
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
    header: Header,
    /// The open file and its mapping: loaders read from the file, not from the path again.
    mapped: MappedFile,
}

impl SafeTensors {
    /// Opens, maps and validates the file at `path` (see [`Header::parse`] for what is checked).
    ///
    /// Anything but a regular file (a FIFO, a socket, a device, a directory) is refused with an
    /// [`Error::Io`] saying what it is, before it is read, so that no open or read can block.
    pub fn open(path: impl AsRef<Path>) -> Result<SafeTensors> {
        let path = path.as_ref();
        let (mapped, header) =
            MappedFile::open(path, |bytes| Header::parse(bytes, bytes.len() as u64, path))?;
        Ok(SafeTensors { header, mapped })
    }

    /// Whether the file is mapped copy-on-write (writable private pages: tensors are views of
    /// them), or read-only because the system refused that (tensors are copies).
    pub fn is_copy_on_write(&self) -> bool {
        self.mapped.is_copy_on_write()
    }

    /// The opened file and its mapping, as the loading engine takes them.
    pub fn mapped(&self) -> &MappedFile {
        &self.mapped
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.mapped.path()
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The mapping of the whole file, a read-only buffer (byte 0 is the start of the file).
    pub fn buffer(&self) -> &Buffer {
        self.mapped.buffer()
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
                file: self.mapped.shared_path().clone(),
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
            Error::InvalidArgument(format!("no tensor `{name}` in {}", self.path().display()))
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
        let layout = Layout::contiguous(info.shape())?;
        host_tensor(&self.mapped, info.byte_range(), info.dtype(), &layout, copy)
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
