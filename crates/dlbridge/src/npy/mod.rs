//! NumPy's `.npy` arrays and `.npz` archives of them (`np.save`, `np.savez`), loaded onto any
//! device through the loading engine ([`crate::engine`]): this module parses, the engine moves
//! the bytes. A second format beside [`safetensors`](crate::safetensors), on the same seam.
//!
//! | step | item | what it does |
//! | --- | --- | --- |
//! | parse | [`NpyHeader::parse`] | magic, version (1.0, 2.0, 3.0), the header's dict: dtype, byte order, memory order, shape; bytes in, checked once |
//! | archive | [`read_directory`] | an `.npz`'s ZIP central directory (ZIP64 too): each member's name, compression and stored bytes |
//! | load | [`load_npy`], [`load_npz`] with [`LoadOptions`] | on the CPU read-only views of the mapped file (zero-copy where the data is aligned), elsewhere the engine's reads |
//!
//! What `numpy.load` users meet:
//! - every dtype dlbridge has a type for: `bool`, the signed and unsigned integers, `float16`,
//!   `float32`, `float64`, `complex64`, `complex128`;
//! - `fortran_order=True` arrays get column-major strides (a view of the file on the CPU, as
//!   the row-major ones);
//! - big-endian data is byte-swapped on load, into memory of its own;
//! - object arrays (which need pickle), structured, string, date and void dtypes (`np.save`
//!   writes ml_dtypes' `bfloat16` as void) are refused ([`Error::InvalidFile`], as `numpy.load`
//!   without pickle refuses objects with a `ValueError`);
//! - `.npz` members must be stored (`np.savez`): a deflated member (`np.savez_compressed`) is
//!   refused with an error saying so; keys are the member names without `.npy`, as
//!   `NpzFile.files` gives them;
//! - a truncated file, a bad magic or an impossible shape is an [`Error::InvalidFile`], and only
//!   regular files are opened (a FIFO or a device is refused before it could block).
//!
//! ```
//! use dlbridge::{Device, Tensor};
//! use dlbridge::engine::LoadOptions;
//!
//! // np.save("a.npy", np.arange(3, dtype="<i4")) writes these bytes.
//! let mut bytes = b"\x93NUMPY\x01\x00\x76\x00".to_vec();
//! let dict = "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }";
//! bytes.extend_from_slice(format!("{dict:<117}\n").as_bytes());
//! for v in 0i32..3 {
//!     bytes.extend_from_slice(&v.to_le_bytes());
//! }
//! let path = std::env::temp_dir().join(format!("dlbridge-doc-{}.npy", std::process::id()));
//! std::fs::write(&path, &bytes)?;
//! let a = dlbridge::npy::load_npy(&path, &LoadOptions::new(Device::CPU))?;
//! assert_eq!(a.to_vec::<i32>()?, vec![0, 1, 2]);
//! assert!(a.is_read_only()); // a view of the mapped file
//! # drop(a);
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod header;
mod zip;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

pub use header::{ByteOrder, MAGIC, MAX_HEADER_LEN, NpyHeader};
pub use zip::{Compression, MAX_MEMBERS, ZipMember, read_directory};

use crate::backend;
use crate::dtype::{DType, DTypeCode};
use crate::engine::{self, Item, LoadOptions, MappedFile};
use crate::error::{Error, Result, invalid_file};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// One array of a file: where its data lies, and its header.
struct Array {
    key: String,
    header: NpyHeader,
    data: Range<u64>,
}

/// The array of the `.npy` file at `path`, on `options.device`.
///
/// # Errors
/// The file's ([`Error::Io`]: missing, unreadable, not a regular file), its header's (as
/// [`NpyHeader::parse`] says), data shorter than the header's shape ([`Error::InvalidFile`]),
/// and the loading engine's ([`engine::load`]).
pub fn load_npy(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Tensor> {
    let path = path.as_ref();
    let (mapped, array) = MappedFile::open(path, |bytes| {
        let header = NpyHeader::parse(bytes, path)?;
        array(String::new(), header, 0, bytes.len() as u64, path)
    })?;
    let mut loaded = load_arrays(&mapped, vec![array], options)?;
    loaded.remove("").ok_or_else(|| Error::Driver {
        backend: "loader",
        message: "the engine returned no array".into(),
    })
}

/// The arrays of the `.npz` archive at `path` (as `np.savez` writes it), on `options.device`,
/// by key: each member's name without its `.npy` suffix, as `numpy.load(path).files` gives it.
///
/// # Errors
/// The file's ([`Error::Io`]), its directory's (as [`read_directory`] says), a member that is
/// compressed (`np.savez_compressed`) or not a `.npy` file, two members with one key
/// ([`Error::InvalidFile`]), each member's header's ([`NpyHeader::parse`]), and the loading
/// engine's ([`engine::load`]).
pub fn load_npz(path: impl AsRef<Path>, options: &LoadOptions) -> Result<BTreeMap<String, Tensor>> {
    let path = path.as_ref();
    let (mapped, arrays) = MappedFile::open(path, |bytes| members(bytes, path))?;
    load_arrays(&mapped, arrays, options)
}

/// The arrays of an `.npz` archive's bytes, named `path` in errors.
fn members(bytes: &[u8], path: &Path) -> Result<Vec<Array>> {
    let mut arrays: Vec<Array> = Vec::new();
    for member in read_directory(bytes, path)? {
        // Names the member in errors (a leading `/` would make the join replace the path).
        let label = path.join(member.name.trim_start_matches('/'));
        match member.compression {
            Compression::Stored => {}
            Compression::Deflated => {
                return Err(invalid_file(
                    &label,
                    "the member is compressed (np.savez_compressed writes so): dlbridge reads \
                     the members of np.savez archives, stored as they are; load this one with \
                     numpy.load, or save it with np.savez"
                        .into(),
                ));
            }
            Compression::Other(method) => {
                return Err(invalid_file(
                    &label,
                    format!("the member is stored with ZIP method {method}, not stored as it is"),
                ));
            }
        }
        // Inside the archive (checked by the directory's reader).
        let data = &bytes[member.data.start as usize..member.data.end as usize];
        let header = NpyHeader::parse(data, &label)?;
        let key = member
            .name
            .strip_suffix(".npy")
            .unwrap_or(&member.name)
            .to_owned();
        if let Some(other) = arrays.iter().find(|a| a.key == key) {
            return Err(invalid_file(
                path,
                format!(
                    "two members give the key {key:?} ({:?} and {:?})",
                    other.key, member.name
                ),
            ));
        }
        let array = array(key, header, member.data.start, member.data.end, &label)?;
        arrays.push(array);
    }
    Ok(arrays)
}

/// The array whose header is `header`, in the `.npy` bytes that begin at byte `start` of the
/// file and end at byte `end`: its data must lie inside them (bytes after it are ignored, as
/// `numpy.load` ignores them).
fn array(key: String, header: NpyHeader, start: u64, end: u64, path: &Path) -> Result<Array> {
    let data_start = start + header.data_offset();
    let data_end = data_start.checked_add(header.nbytes());
    match data_end {
        Some(data_end) if data_end <= end => Ok(Array {
            key,
            header,
            data: data_start..data_end,
        }),
        _ => Err(invalid_file(
            path,
            format!(
                "the data of shape {:?} ({}) needs {} bytes after the header, and the file has {} \
                 (truncated?)",
                header.shape(),
                header.dtype(),
                header.nbytes(),
                end.saturating_sub(data_start)
            ),
        )),
    }
}

/// The arrays loaded by the engine; big-endian ones read into host memory of their own, swapped
/// there, then moved to the device.
fn load_arrays(
    mapped: &MappedFile,
    arrays: Vec<Array>,
    options: &LoadOptions,
) -> Result<BTreeMap<String, Tensor>> {
    let mut swapped = Vec::new();
    let mut items = Vec::with_capacity(arrays.len());
    for a in arrays {
        let item = Item {
            layout: a.header.layout()?,
            name: a.key,
            byte_range: a.data,
            dtype: a.header.dtype(),
        };
        if a.header.byte_order() == ByteOrder::Big {
            swapped.push(item);
        } else {
            items.push(item);
        }
    }
    let mut out = engine::load(&[(mapped, items)], options, &mut |_, _| {})?;
    for item in swapped {
        let tensor = load_swapped(mapped, &item, options)?;
        out.insert(item.name, tensor);
    }
    Ok(out)
}

/// A big-endian array: its bytes copied into host memory of its own, each element's bytes
/// reversed there (each half of a complex number's), then moved to the device as a compact copy
/// (kept on the CPU, read-only unless `copy`, as every CPU load without it is).
fn load_swapped(mapped: &MappedFile, item: &Item, options: &LoadOptions) -> Result<Tensor> {
    let len = (item.byte_range.end - item.byte_range.start) as usize;
    let mut bytes = engine::host_tensor(
        mapped,
        item.byte_range.clone(),
        DType::U8,
        &Layout::contiguous(&[len])?,
        true,
    )?;
    let unit = match item.dtype.code() {
        DTypeCode::Complex => item.dtype.itemsize() / 2,
        _ => item.dtype.itemsize(),
    };
    for element in bytes.as_mut_slice::<u8>()?.chunks_exact_mut(unit.max(1)) {
        element.reverse();
    }
    let host = Tensor::new(bytes.buffer().clone(), item.dtype, item.layout.clone())?;
    drop(bytes);
    let mut tensor = if options.device.is_cpu() {
        if options.copy {
            host
        } else {
            host.into_read_only()
        }
    } else {
        let device = backend::placement(options.device, options.storage)?;
        host.copy_to_storage(device, options.storage)?
    };
    engine::cast_floating(&mut tensor, options.dtype)?;
    Ok(tensor)
}

#[cfg(test)]
mod tests {
    use super::header::tests::npy;
    use super::*;
    use crate::device::Device;
    use std::path::PathBuf;

    fn temp(tag: &str, bytes: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!("dlbridge-npy-{}-{tag}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn cpu(copy: bool) -> LoadOptions {
        LoadOptions {
            copy,
            ..LoadOptions::new(Device::CPU)
        }
    }

    #[test]
    fn arrays_load_as_views_copies_and_swapped() {
        let data: Vec<u8> = [1.5f32, -2.0, 3.25, 4.0, 5.0, 6.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let c = temp(
            "c.npy",
            &npy(
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                &data,
            ),
        );
        let view = load_npy(&c, &cpu(false)).unwrap();
        assert!(view.is_read_only());
        assert_eq!(view.shape(), [2, 3]);
        assert_eq!(
            view.to_vec::<f32>().unwrap(),
            [1.5, -2.0, 3.25, 4.0, 5.0, 6.5]
        );
        let copy = load_npy(&c, &cpu(true)).unwrap();
        assert!(!copy.is_read_only());
        // Column-major: element [i, j] at i + 2 j.
        let f = temp(
            "f.npy",
            &npy(
                "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
                &data,
            ),
        );
        let fortran = load_npy(&f, &cpu(false)).unwrap();
        assert_eq!(fortran.strides(), [1, 2]);
        assert_eq!(
            fortran.to_vec::<f32>().unwrap(),
            [1.5, 3.25, 5.0, -2.0, 4.0, 6.5]
        );
        let big: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_be_bytes())
            .collect();
        let b = temp(
            "b.npy",
            &npy(
                "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }",
                &big,
            ),
        );
        let swapped = load_npy(&b, &cpu(false)).unwrap();
        assert!(swapped.is_read_only());
        assert_eq!(swapped.to_vec::<f32>().unwrap(), [1.5, -2.0]);
        let short = temp(
            "short.npy",
            &npy(
                "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }",
                &data[..8],
            ),
        );
        let e = load_npy(&short, &cpu(false)).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        for p in [c, f, b, short] {
            std::fs::remove_file(p).unwrap();
        }
    }

    #[test]
    fn archives_load_by_key_and_refuse_compressed_members() {
        let a = npy(
            "{'descr': '<i2', 'fortran_order': False, 'shape': (2,), }",
            &[1, 0, 2, 0],
        );
        let b = npy(
            "{'descr': '|b1', 'fortran_order': False, 'shape': (), }",
            &[1],
        );
        let bytes = zip::tests::archive(&[("a.npy", &a, 0), ("b.npy", &b, 0)], true);
        let path = temp("ab.npz", &bytes);
        let loaded = load_npz(&path, &cpu(false)).unwrap();
        assert_eq!(loaded.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(loaded["a"].to_vec::<i16>().unwrap(), [1, 2]);
        assert_eq!(loaded["b"].shape(), [0usize; 0]);
        let compressed = temp(
            "z.npz",
            &zip::tests::archive(&[("a.npy", &a, 0), ("c.npy", &b, 8)], false),
        );
        let e = load_npz(&compressed, &cpu(false)).unwrap_err();
        assert!(matches!(e, Error::InvalidFile { .. }), "{e}");
        assert!(e.to_string().contains("np.savez_compressed"), "{e}");
        assert!(e.to_string().contains("c.npy"), "{e}");
        let twice = temp(
            "twice.npz",
            &zip::tests::archive(&[("a.npy", &a, 0), ("a", &a, 0)], false),
        );
        let e = load_npz(&twice, &cpu(false)).unwrap_err().to_string();
        assert!(e.contains("two members"), "{e}");
        for p in [path, compressed, twice] {
            std::fs::remove_file(p).unwrap();
        }
    }

    /// A member past 4 GiB, as `np.savez` writes one (ZIP64 lengths in the central entry and a
    /// ZIP64 end record): its directory is read and its array is a view of the mapped file, in a
    /// sparse file (no byte of the data is written or read).
    #[test]
    fn zip64_members_past_four_gib() {
        use std::io::{Seek, SeekFrom, Write};
        const LEN: u64 = (5 << 30) + 3;
        let npy_header = npy(
            &format!("{{'descr': '|u1', 'fortran_order': False, 'shape': ({LEN},), }}"),
            &[],
        );
        let member = npy_header.len() as u64 + LEN;
        let name = b"big.npy";
        let mut local = b"PK\x03\x04".to_vec();
        local.extend_from_slice(&[45, 0, 0, 0, 0, 0]);
        local.extend_from_slice(&[0; 8]);
        local.extend_from_slice(&u32::MAX.to_le_bytes());
        local.extend_from_slice(&u32::MAX.to_le_bytes());
        local.extend_from_slice(&(name.len() as u16).to_le_bytes());
        local.extend_from_slice(&20u16.to_le_bytes());
        local.extend_from_slice(name);
        local.extend_from_slice(&[1, 0, 16, 0]);
        local.extend_from_slice(&member.to_le_bytes());
        local.extend_from_slice(&member.to_le_bytes());
        let cd_start = local.len() as u64 + member;
        let mut central = b"PK\x01\x02".to_vec();
        central.extend_from_slice(&[45, 3, 45, 0, 0, 0, 0, 0]);
        central.extend_from_slice(&[0; 8]);
        central.extend_from_slice(&u32::MAX.to_le_bytes());
        central.extend_from_slice(&u32::MAX.to_le_bytes());
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&20u16.to_le_bytes());
        central.extend_from_slice(&[0; 10]);
        central.extend_from_slice(&0u32.to_le_bytes());
        central.extend_from_slice(name);
        central.extend_from_slice(&[1, 0, 16, 0]);
        central.extend_from_slice(&member.to_le_bytes());
        central.extend_from_slice(&member.to_le_bytes());
        let record = cd_start + central.len() as u64;
        let mut tail = b"PK\x06\x06".to_vec();
        tail.extend_from_slice(&44u64.to_le_bytes());
        tail.extend_from_slice(&[45, 3, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        tail.extend_from_slice(&1u64.to_le_bytes());
        tail.extend_from_slice(&1u64.to_le_bytes());
        tail.extend_from_slice(&(central.len() as u64).to_le_bytes());
        tail.extend_from_slice(&cd_start.to_le_bytes());
        tail.extend_from_slice(b"PK\x06\x07");
        tail.extend_from_slice(&0u32.to_le_bytes());
        tail.extend_from_slice(&record.to_le_bytes());
        tail.extend_from_slice(&1u32.to_le_bytes());
        tail.extend_from_slice(b"PK\x05\x06");
        tail.extend_from_slice(&[0; 4]);
        tail.extend_from_slice(&1u16.to_le_bytes());
        tail.extend_from_slice(&1u16.to_le_bytes());
        tail.extend_from_slice(&(central.len() as u32).to_le_bytes());
        tail.extend_from_slice(&u32::MAX.to_le_bytes());
        tail.extend_from_slice(&0u16.to_le_bytes());
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("dlbridge-npy-{}-big.npz", std::process::id()));
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(&local).unwrap();
        file.write_all(&npy_header).unwrap();
        file.seek(SeekFrom::Start(cd_start)).unwrap();
        file.write_all(&central).unwrap();
        file.write_all(&tail).unwrap();
        drop(file);
        let loaded = load_npz(&path, &cpu(false));
        std::fs::remove_file(&path).unwrap();
        let big = &loaded.unwrap()["big"];
        assert_eq!(big.shape(), [LEN as usize]);
        assert!(big.is_read_only());
        let data_start = (local.len() + npy_header.len()) as usize;
        assert_eq!(
            big.byte_offset(),
            data_start,
            "a view of the mapping, no copy"
        );
    }
}
