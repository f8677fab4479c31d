//! A checkpoint's plan for the loading engine ([`crate::engine`]): which bytes of which shard
//! hold each selected tensor. The engine does the rest (threads, staging, direct reads, views
//! of the mapped files) on any device.

use std::collections::BTreeMap;

use super::file::{Checkpoint, SafeTensors, TensorLocation};
use crate::engine::{self, Item, LoadOptions, MappedFile};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

impl Checkpoint {
    /// Loads the tensors `select` accepts onto `options.device` ([`engine::load`] says how on each
    /// device), calling `progress(done, total)` (bytes) about ten times a second while a device
    /// load runs and once at the end.
    ///
    /// # Errors
    /// The device's allocation errors ([`Error::OutOfMemory`], an unavailable backend), the
    /// file's I/O errors ([`Error::Io`], also for a file truncated while it is read), and the
    /// cast's. On error nothing loaded stays allocated.
    pub fn load_to(
        &self,
        mut select: impl FnMut(&str) -> bool,
        options: &LoadOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<BTreeMap<String, Tensor>> {
        let files = self
            .shards()
            .iter()
            .map(|shard| Ok((shard.mapped(), shard.items(&mut select)?)))
            .collect::<Result<Vec<(&MappedFile, Vec<Item>)>>>()?;
        engine::load(&files, options, progress)
    }

    /// The part of tensor `name` that `part` selects, on `options.device`, reading only the bytes
    /// it needs: [`engine::load_part`] over the tensor's bytes in its shard. `part` is a layout
    /// over the tensor's elements, its byte offset counted from the tensor's first byte (what
    /// basic indexing gives: `Layout::contiguous(shape)` then [`Layout::slice`] and
    /// [`Layout::index`]), as a tensor-parallel rank takes its rows or its columns. On the CPU
    /// it is a read-only view of the mapped file, zero-copy, where the bytes allow.
    ///
    /// # Errors
    /// No tensor `name` ([`Error::InvalidArgument`]); packed sub-byte elements
    /// ([`Error::UnsupportedDType`]); and the errors of [`engine::load_part`].
    pub fn load_part(&self, name: &str, part: &Layout, options: &LoadOptions) -> Result<Tensor> {
        let (shard, info) = self.info(name).ok_or_else(|| {
            Error::InvalidArgument(format!("no tensor `{name}` in the checkpoint"))
        })?;
        let dtype = info.dtype();
        if info.is_packed() {
            return Err(Error::UnsupportedDType(format!(
                "tensor `{name}` holds packed sub-byte {dtype} elements: a part of it cannot be \
                 read on its own; load the tensor whole"
            )));
        }
        engine::load_part(
            shard.mapped(),
            info.byte_range().start,
            info.nbytes() as usize,
            part,
            dtype,
            options,
        )
    }

    /// Reads each part `(name, part, dst)` of `parts` (the part of tensor `name` that `part`
    /// selects, as [`Checkpoint::load_part`] takes it) into `dst`, existing memory of the part's
    /// shape on any device, calling `progress(done, total)` (bytes); returns the bytes of the
    /// files the parts need: [`engine::load_parts_into`], straight into each `dst` that is
    /// compact and of its tensor's dtype on the CPU or CUDA (one run of the reader per device),
    /// else converted and copied with its strides. Every part is checked before anything is read.
    ///
    /// # Errors
    /// As [`Checkpoint::load_part`], and a `dst` of another shape ([`Error::Shape`], naming the
    /// tensor and both shapes) or read-only.
    ///
    /// # Safety
    /// As [`engine::load_parts_into`]: nothing else reads or writes the `dst`s' bytes during the
    /// call, and no two `dst`s overlap.
    pub unsafe fn load_parts_into(
        &self,
        parts: &[(&str, Layout, &Tensor)],
        options: &LoadOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<u64> {
        let mut items = Vec::with_capacity(parts.len());
        for (name, part, dst) in parts {
            let (shard, info) = self.info(name).ok_or_else(|| {
                Error::InvalidArgument(format!("no tensor `{name}` in the checkpoint"))
            })?;
            let dtype = info.dtype();
            if info.is_packed() {
                return Err(Error::UnsupportedDType(format!(
                    "tensor `{name}` holds packed sub-byte {dtype} elements: a part of it cannot \
                     be read on its own; load the tensor whole"
                )));
            }
            if dst.shape() != part.shape() {
                return Err(Error::Shape(format!(
                    "tensor `{name}`: the target has shape {} but the part read into it has \
                     shape {}",
                    crate::layout::shape_text(dst.shape()),
                    crate::layout::shape_text(part.shape())
                )));
            }
            items.push(engine::PartInto {
                file: shard.mapped(),
                start: info.byte_range().start,
                array_len: info.nbytes() as usize,
                part: part.clone(),
                dtype,
                dst,
            });
        }
        // SAFETY: the caller's guarantee, passed on.
        unsafe { engine::load_parts_into(&items, options, progress) }
    }
}

impl SafeTensors {
    /// The engine's plan for the tensors `select` accepts, in file order ([`SafeTensors::plan`]).
    pub(crate) fn items(&self, select: impl FnMut(&str) -> bool) -> Result<Vec<Item>> {
        self.plan(select).into_iter().map(item).collect()
    }
}

/// The engine's item for a tensor of the plan: its bytes, row-major.
fn item(location: TensorLocation) -> Result<Item> {
    Ok(Item {
        layout: Layout::contiguous(&location.shape)?,
        name: location.name,
        byte_range: location.byte_range,
        dtype: location.dtype,
    })
}
