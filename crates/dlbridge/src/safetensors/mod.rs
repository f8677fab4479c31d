//! The [safetensors] checkpoint format: parse and validate headers, open files and sharded
//! checkpoints, plan their loads for the loading engine ([`crate::engine`], which maps files
//! copy-on-write, hands out zero-copy, read-only views and reads onto any device), and save
//! tensors from any device. Every file a caller names is opened only if it is a regular file (a
//! FIFO, socket or device is refused before it could block).
//!
//! | step | item | what it does |
//! | --- | --- | --- |
//! | parse | [`Header::parse`], [`Header::read`] | length prefix, JSON, dtypes, byte ranges: all checked once, then trusted |
//! | open | [`SafeTensors::open`] | the engine's [`MappedFile`](crate::engine::MappedFile): the whole file mapped copy-on-write as a foreign, read-only [`Buffer`](crate::Buffer), its header parsed from those bytes |
//! | shards | [`Index::parse`], [`Checkpoint::open_index`], [`Checkpoint::open_files`], [`Checkpoint::open_folder`] | one name → one shard, from `model.safetensors.index.json`, a list, or a folder |
//! | plan | [`SafeTensors::plan`], [`Checkpoint::plan`] | (file, absolute byte range, dtype, shape) per tensor, in file order: what the loading engine is handed |
//! | load | [`SafeTensors::tensor`], [`SafeTensors::load`], [`SafeTensors::load_where`] | CPU views of the mapping (zero-copy, read-only; a consumer that writes anyway writes private pages), or private copies |
//! | part | [`PartPlan`], [`Checkpoint::load_part`] | a strided part of one tensor (a rank's rows or columns) reading only the bytes it needs: CPU views, or runs of bytes read into one allocation on any device |
//! | load anywhere | [`Checkpoint::load_to`] with [`LoadOptions`] | the engine's [`load`](crate::engine::load) on any device, with progress: Metal from the mapped files without a copy (read-only views in shared storage, a GPU blit into private storage), CUDA through pinned staging buffers and asynchronous copies |
//! | bytes | [`serialize`], [`deserialize`] | a file's bytes in memory, both ways |
//! | save | [`save_file`], [`save_file_with`], [`save_file_staged`] (the asynchronous save's), [`write()`], [`serialize`] | the format from CPU or device tensors, written by the engine's [`write_file`](crate::engine::write_file) (aligned ring, parallel `O_DIRECT` writes) atomically and durably to a file |
//! | shards | [`save_sharded`], [`save_sharded_staged`] | Hugging Face's layout: `model-00001-of-00003.safetensors` shards of at most `max_shard_size` bytes written in parallel, and [`INDEX_NAME`] |
//! | stream | [`Checkpoint::stream`] | groups of tensors in the caller's order, each handed out with a CUDA event once on the device while the next load ([`crate::engine::stream`]) |
//!
//! ```
//! use dlbridge::Tensor;
//! use dlbridge::safetensors::{SafeTensors, save_file};
//!
//! let path = std::env::temp_dir().join(format!("dlbridge-doc-{}.safetensors", std::process::id()));
//! let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! save_file(&[("w", &w)], None, &path)?;
//!
//! let file = SafeTensors::open(&path)?;
//! let view = file.tensor("w", false)?; // a read-only view of the mapped file
//! assert_eq!(view.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 4.0]);
//! assert!(view.buffer().same_allocation(file.buffer()));
//! # drop((view, file));
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), dlbridge::Error>(())
//! ```
//!
//! [safetensors]: https://huggingface.co/docs/safetensors

mod dtype;
mod file;
mod header;
mod index;
mod plan;
mod save;
mod stream;

pub use dtype::{dtype_from_name, dtype_name, dtype_names};
pub use file::{Checkpoint, SafeTensors, TensorLocation, deserialize};
pub use header::{Header, MAX_HEADER_LEN, METADATA_KEY, PREFIX_LEN, TensorInfo};
pub use index::Index;
// The loading engine's options and plans, where users of this module have always found them.
pub use crate::engine::{
    Allocation, CopyStreams, DEFAULT_CHUNK, DEFAULT_DIRECT_CHUNK, DEFAULT_MAX_GAP, LoadOptions,
    PartPlan, WriteOptions, default_direct_threads, default_threads,
};
pub use save::{
    INDEX_NAME, save_file, save_file_staged, save_file_with, save_sharded, save_sharded_staged,
    serialize, write,
};
