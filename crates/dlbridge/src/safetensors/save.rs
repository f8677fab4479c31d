//! Writing safetensors files from tensors on any device.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

use super::dtype::dtype_name;
use super::header::{METADATA_KEY, PREFIX_LEN, io_error};

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
/// Errors: a repeated or reserved name, or a dtype the format cannot hold
/// ([`Error::UnsupportedDType`], naming the tensor).
pub fn write(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    writer: &mut dyn Write,
) -> Result<()> {
    let sink = Path::new("<writer>");
    write_to(tensors, metadata, writer, sink)
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

/// [`write()`] to the file at `path`, atomically: the bytes go to a temporary file in the same
/// folder, which is synced and then renamed over `path`, so a failed save leaves no partial file.
pub fn save_file(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    path: impl AsRef<Path>,
) -> Result<()> {
    let path = path.as_ref();
    let temp = temp_path(path);
    let result = (|| {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| io_error(path, e))?;
        let mut writer = std::io::BufWriter::new(file);
        write_to(tensors, metadata, &mut writer, path)?;
        let file = writer
            .into_inner()
            .map_err(|e| io_error(path, e.into_error()))?;
        file.sync_all().map_err(|e| io_error(path, e))?;
        std::fs::rename(&temp, path).map_err(|e| io_error(path, e))
    })();
    if result.is_err() {
        // Best effort: the temporary may not exist (creating it failed).
        let _ = std::fs::remove_file(&temp);
    }
    result
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

fn write_to(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    writer: &mut dyn Write,
    path: &Path,
) -> Result<()> {
    let plan = plan(tensors)?;
    let header = header_json(&plan, metadata)?;
    let io = |e| io_error(path, e);
    writer
        .write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    writer.write_all(header.as_bytes()).map_err(io)?;
    for item in &plan {
        let bytes = host_bytes(item)?;
        writer.write_all(&bytes).map_err(io)?;
    }
    writer.flush().map_err(io)
}

/// Checks names and dtypes and orders the tensors as they will lie in the file: widest element
/// first, then by name.
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
    plan.sort_by(|a, b| {
        b.tensor
            .dtype()
            .bits()
            .cmp(&a.tensor.dtype().bits())
            .then_with(|| a.name.cmp(b.name))
    });
    Ok(plan)
}

/// The header JSON, padded with spaces so that `8 + len` is a multiple of 8.
fn header_json(
    plan: &[Planned<'_>],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<String> {
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
    json.extend(std::iter::repeat_n(' ', padded - json.len()));
    Ok(json)
}

/// The tensor's bytes as the file stores them: compact, row-major, on the host; sub-byte
/// elements packed.
fn host_bytes(item: &Planned<'_>) -> Result<Vec<u8>> {
    let tensor = item.tensor;
    if item.nbytes == 0 {
        return Ok(Vec::new());
    }
    if tensor.dtype().is_sub_byte() && !tensor.is_packed() {
        // One element per byte (DLPack's padded form): pack them.
        let padded = raw_bytes(&tensor.copy_to(Device::CPU)?, tensor.numel())?;
        return Ok(pack(&padded, tensor.dtype(), item.nbytes as usize));
    }
    let compact = if tensor.is_contiguous() {
        tensor.clone()
    } else {
        tensor.copy()?
    };
    raw_bytes(&compact, item.nbytes as usize)
}

/// The first `nbytes` bytes of a compact tensor's elements, copied to a host `Vec`.
fn raw_bytes(compact: &Tensor, nbytes: usize) -> Result<Vec<u8>> {
    let layout = Layout::contiguous_at(&[nbytes], compact.byte_offset())?;
    let bytes = Tensor::new(compact.buffer().clone(), DType::U8, layout)?;
    let host = if bytes.device().is_cpu() {
        bytes
    } else {
        bytes.copy_to(Device::CPU)?
    };
    let mut out = crate::error::host_vec(nbytes)?;
    out.extend_from_slice(host.as_slice::<u8>()?);
    Ok(out)
}

/// Packs one-per-byte sub-byte elements densely, element `i` at bit `i * bits`.
fn pack(padded: &[u8], dtype: DType, nbytes: usize) -> Vec<u8> {
    let bits = dtype.bits() as usize;
    let mask = (1u16 << bits) - 1;
    let mut out = vec![0u8; nbytes];
    for (i, &value) in padded.iter().enumerate() {
        let (byte, shift) = ((i * bits) / 8, (i * bits) % 8);
        let wide = (u16::from(value) & mask) << shift;
        if let Some(slot) = out.get_mut(byte) {
            *slot |= wide as u8;
        }
        if let Some(slot) = out.get_mut(byte + 1) {
            *slot |= (wide >> 8) as u8;
        }
    }
    out
}
