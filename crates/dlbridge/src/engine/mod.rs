//! The loading and saving engine: arrays of files onto any device and back, knowing no file
//! format. A format (the
//! [`safetensors`](crate::safetensors) checkpoints, `npy` arrays) opens its files
//! with [`MappedFile::open`], parses its header from the mapped bytes, and hands the engine a
//! plan: per file, each array's byte range, element type and layout ([`Item`]). The engine does
//! the rest on every device: views of the mapped pages where the device addresses them, reads
//! into device memory elsewhere.
//!
//! | piece | item | what it does |
//! | --- | --- | --- |
//! | open | [`MappedFile::open`] | a regular file only (a FIFO, socket or device is refused before it could block), mapped whole copy-on-write as a foreign, read-only [`Buffer`](crate::Buffer) |
//! | plan | [`Item`] | one array: absolute byte range, dtype, layout over those bytes (row-major or column-major) |
//! | load | [`load`] with [`LoadOptions`] | CPU views of the mapping (or private copies); Metal views of the wrapped pages (or blits); CUDA through parallel positioned reads, pinned staging and asynchronous copies, or direct reads and cuFile for files not in the page cache |
//! | part | [`load_part`], [`PartPlan`] | a strided part of one array (a rank's rows or columns) reading only the bytes it needs |
//! | into | [`load_parts_into`] with [`PartInto`] | parts read straight into existing memory (a model's parameters) on the CPU or CUDA, one run of the reader per device, or converted and copied into it with its strides |
//! | one array on the CPU | [`host_tensor`] | a view of the mapping or a private copy, as a CPU load makes each |
//! | stream | [`stream`] with [`GroupPlan`]s over a [`FileSet`] | groups of arrays loaded one after another in the caller's order on a thread of the engine's, each handed out ([`LoadedGroup`]) with a CUDA event that completes when its bytes are on the device, while the next groups load |
//! | save | [`write_file`] with [`WriteItem`], [`WriteOptions`]; [`write_file_staged`] with [`CopyStreams`] | a head and arrays of any device and layout at their file offsets: a ring of page-aligned host buffers (pinned for CUDA arrays, copied into on the save's streams) filled in file order, strided arrays piece by piece, written by several threads around the page cache (`O_DIRECT`, buffered where refused), then synced; the asynchronous form holds the whole file and tells when every byte is in host memory |
//!
//! How a load reads: reader threads ([`default_threads`], [`default_direct_threads`]) take
//! pieces of at most [`DEFAULT_CHUNK`] (or [`DEFAULT_DIRECT_CHUNK`]) bytes; whether a file is
//! read through the page cache or around it follows a sample of its pages' residency; device
//! memory is one allocation per file or per array ([`Allocation`]). The reads themselves go
//! through the backend seam ([`crate::backend`]), which knows the device.

mod file;
mod load;
mod part;
mod save;
mod stream;

pub use file::MappedFile;
#[cfg_attr(not(cuda), allow(unused_imports))] // `Mapping`: the CUDA reader's shared mappings
pub(crate) use file::{Mapping, check_regular, file_len, io_error, open_regular};
pub(crate) use load::cast_floating;
#[cfg(test)]
pub(crate) use load::wrapped_ranges;
pub use load::{
    Allocation, DEFAULT_CHUNK, DEFAULT_DIRECT_CHUNK, Item, LoadOptions, LoadSession, PartInto,
    default_direct_threads, default_threads, host_tensor, load, load_part, load_parts_into,
};
pub use part::{DEFAULT_MAX_GAP, PartPlan};
pub(crate) use save::write_to;
pub use save::{
    CopyStreams, DEFAULT_WRITE_CHUNK, WriteItem, WriteOptions, default_write_threads, write_file,
    write_file_staged,
};
#[cfg(test)]
pub(crate) use stream::THREAD_NAME as STREAM_THREAD_NAME;
pub use stream::{FileSet, GroupPlan, LoadStream, LoadedGroup, stream};
