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
use super::header::{MAX_HEADER_LEN, METADATA_KEY, PREFIX_LEN};
use crate::engine::{check_regular, io_error};

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

/// [`write()`] to the file at `path`, atomically: the bytes go to a temporary file in the same
/// folder, which is synced and then renamed over `path`, so a failed save leaves no partial file
/// (and nothing at all where the tensors or metadata are refused).
///
/// - A `path` that is a symbolic link (such as a shard in the Hugging Face cache, a link into
///   its `blobs/`) stays one: the file it leads to is replaced, through any chain of links.
/// - An existing file keeps its permission bits (and, when the caller is root, its owner and
///   group): the temporary is created readable and writable by its owner only, and given them
///   before it is renamed over the file. A new file gets the usual mode (`0o666` less the
///   umask). Other links to the old file (hard links) keep the old content.
/// - A `path` that exists but is not a regular file (a directory, a FIFO, a device) is refused
///   with an [`Error::Io`] saying what it is.
pub fn save_file(
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
    path: impl AsRef<Path>,
) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let path = path.as_ref();
    let plan = plan(tensors)?;
    let header = header_json(&plan, metadata)?;
    let target = final_target(path)?;
    let existing = match std::fs::metadata(&target) {
        Ok(meta) => {
            check_regular(path, &meta)?;
            Some(meta)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_error(path, e)),
    };
    let temp = temp_path(&target);
    let result = (|| {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(if existing.is_some() { 0o600 } else { 0o666 })
            .open(&temp)
            .map_err(|e| io_error(path, e))?;
        if let Some(meta) = &existing {
            // SAFETY: `geteuid` only reads the process's effective user id.
            if unsafe { libc::geteuid() } == 0 {
                std::os::unix::fs::fchown(&file, Some(meta.uid()), Some(meta.gid()))
                    .map_err(|e| io_error(path, e))?;
            }
            // After the owner: changing it clears the set-user-ID and set-group-ID bits.
            let mode = std::fs::Permissions::from_mode(meta.mode() & 0o7777);
            file.set_permissions(mode).map_err(|e| io_error(path, e))?;
        }
        let mut writer = std::io::BufWriter::new(file);
        write_planned(&plan, &header, &mut writer, path)?;
        let file = writer
            .into_inner()
            .map_err(|e| io_error(path, e.into_error()))?;
        file.sync_all().map_err(|e| io_error(path, e))?;
        std::fs::rename(&temp, &target).map_err(|e| io_error(path, e))
    })();
    if result.is_err() {
        // Best effort: the temporary may not exist (creating it failed).
        let _ = std::fs::remove_file(&temp);
    }
    result
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
    let io = |e| io_error(path, e);
    writer
        .write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    writer.write_all(header.as_bytes()).map_err(io)?;
    for item in plan {
        let bytes = host_bytes(item)?;
        writer.write_all(&bytes).map_err(io)?;
    }
    writer.flush().map_err(io)
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
}
