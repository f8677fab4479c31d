//! safetensors: round trips of every dtype, zero-copy loading, shards, and every malformed input
//! the parser must refuse (written byte by byte here).

mod common;
use common::gpu;

use std::collections::BTreeMap;
use std::io::ErrorKind as IoKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use dlbridge::safetensors::{
    Checkpoint, Header, MAX_HEADER_LEN, SafeTensors, dtype_from_name, dtype_name, dtype_names,
    save_file, serialize,
};
use dlbridge::{DType, Device, Error, Layout, Tensor};

// ---------------------------------------------------------------------------------------------
// Helpers

/// A fresh folder under the system's temporary folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("dlbridge-st-{}-{tag}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `bytes` to `name` in the folder.
    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A file in the format from a header's JSON text and the data section, the header padded with
/// spaces to a multiple of 8 (as writers do).
fn st_bytes(json: &str, data: &[u8]) -> Vec<u8> {
    let mut json = json.to_owned();
    while (8 + json.len()) % 8 != 0 {
        json.push(' ');
    }
    raw(json.as_bytes(), data)
}

/// Length prefix + header bytes as given + data.
fn raw(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// A CPU tensor of `dtype` and `shape` holding `bytes` (a byte buffer viewed as `dtype`).
fn tensor_of(bytes: &[u8], dtype: DType, shape: &[usize]) -> Tensor {
    let storage = Tensor::from_slice(bytes, &[bytes.len()]).unwrap();
    Tensor::new(
        storage.buffer().clone(),
        dtype,
        Layout::contiguous(shape).unwrap(),
    )
    .unwrap()
}

/// The elements' bytes in row-major order (sub-byte elements one per byte).
fn bytes_of(t: &Tensor) -> Vec<u8> {
    let compact = t.unpacked().unwrap();
    let n = compact.numel() * compact.dtype().itemsize();
    Tensor::new(
        compact.buffer().clone(),
        DType::U8,
        Layout::contiguous_at(&[n], compact.byte_offset()).unwrap(),
    )
    .unwrap()
    .to_vec::<u8>()
    .unwrap()
}

/// Asserts an `Error::InvalidFile` for `path` whose reason holds every one of `needles`.
#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(result: dlbridge::Result<T>, path: &Path, needles: &[&str]) {
    match result {
        Err(Error::InvalidFile { path: p, reason }) => {
            assert_eq!(p, path, "reason: {reason}");
            for needle in needles {
                assert!(reason.contains(needle), "`{reason}` lacks `{needle}`");
            }
        }
        other => panic!("expected InvalidFile for {}, got {other:?}", path.display()),
    }
}

/// Writes `bytes` as a file and asserts opening it fails as [`assert_invalid`] says, through
/// both the mapping reader and the header-only reader.
#[track_caller]
fn assert_rejected(bytes: &[u8], needles: &[&str]) {
    let dir = TempDir::new("bad");
    let path = dir.file("bad.safetensors", bytes);
    assert_invalid(SafeTensors::open(&path), &path, needles);
    assert_invalid(Header::read(&path), &path, needles);
    assert_invalid(
        Header::parse(bytes, bytes.len() as u64, &path),
        &path,
        needles,
    );
}

const F32_1: &str = r#""dtype":"F32","shape":[1],"data_offsets""#;

// ---------------------------------------------------------------------------------------------
// Dtypes and round trips

#[test]
fn every_dtype_name_maps_both_ways() {
    let names: Vec<&str> = dtype_names().collect();
    for required in [
        "BOOL",
        "U8",
        "I8",
        "U16",
        "I16",
        "U32",
        "I32",
        "U64",
        "I64",
        "F16",
        "BF16",
        "F32",
        "F64",
        "F8_E4M3",
        "F8_E5M2",
        "F8_E8M0",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "F6_E2M3",
        "F6_E3M2",
        "F4",
        "C64",
    ] {
        assert!(names.contains(&required), "{required}");
    }
    for name in names {
        let dtype = dtype_from_name(name).unwrap();
        assert_eq!(dtype_name(dtype), Some(name));
    }
    assert_eq!(dtype_from_name("F8_E4M3").unwrap().name(), "float8_e4m3fn");
    assert_eq!(dtype_from_name("F8_E8M0").unwrap().name(), "float8_e8m0fnu");
    assert_eq!(dtype_from_name("C64"), Some(DType::C64));
    assert_eq!(dtype_from_name("f32"), None);
    assert_eq!(dtype_name(DType::C128), None);
}

#[test]
fn round_trip_every_dtype() {
    let dir = TempDir::new("dtypes");
    let mut originals = Vec::new();
    for (i, name) in dtype_names().enumerate() {
        let dtype = dtype_from_name(name).unwrap();
        let shape = [2usize, 4];
        let numel = 8;
        // Sub-byte elements are held one per byte (padded) here and packed in the file.
        let width = dtype.itemsize();
        let mask = if dtype.is_sub_byte() {
            (1u8 << dtype.bits()) - 1
        } else {
            0xff
        };
        let bytes: Vec<u8> = (0..numel * width)
            .map(|b| ((b * 7 + i * 13 + 1) as u8) & mask)
            .map(|b| if dtype == DType::BOOL { b & 1 } else { b })
            .collect();
        originals.push((name.to_owned(), tensor_of(&bytes, dtype, &shape), bytes));
    }
    let named: Vec<(&str, &Tensor)> = originals.iter().map(|(n, t, _)| (n.as_str(), t)).collect();
    let path = dir.path("all.safetensors");
    save_file(&named, None, &path).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        serialize(&named, None).unwrap()
    );

    let file = SafeTensors::open(&path).unwrap();
    assert_eq!(
        file.header().data_start() % 8,
        0,
        "header padded to a multiple of 8"
    );
    assert_eq!(file.keys().count(), originals.len());
    for (name, original, bytes) in &originals {
        let info = file.info(name).unwrap();
        assert_eq!(info.dtype(), original.dtype(), "{name}");
        assert_eq!(info.shape(), &[2, 4]);
        let loaded = file.tensor(name, false).unwrap();
        assert_eq!(loaded.dtype(), original.dtype(), "{name}");
        assert_eq!(loaded.shape(), &[2, 4]);
        assert_eq!(loaded.is_packed(), original.dtype().is_sub_byte(), "{name}");
        assert_eq!(&bytes_of(&loaded), bytes, "{name}");
        let copied = file.tensor(name, true).unwrap();
        assert_eq!(&bytes_of(&copied), bytes, "{name} copied");
        // Everything the reference writer puts first is aligned, so no tensor needed a copy.
        assert!(loaded.buffer().same_allocation(file.buffer()), "{name}");
    }
}

#[test]
fn sub_byte_elements_are_packed_low_bits_first() {
    let dir = TempDir::new("packed");
    let f4 = dtype_from_name("F4").unwrap();
    let t = tensor_of(&[1, 2, 3, 4], f4, &[4]);
    let path = dir.path("f4.safetensors");
    save_file(&[("q", &t)], None, &path).unwrap();
    let file = SafeTensors::open(&path).unwrap();
    let range = file.info("q").unwrap().byte_range();
    assert_eq!(range.end - range.start, 2);
    let raw = std::fs::read(&path).unwrap();
    assert_eq!(
        &raw[range.start as usize..range.end as usize],
        &[0x21, 0x43]
    );
    // Saving the loaded (packed) tensor writes the same bytes back.
    let loaded = file.tensor("q", false).unwrap();
    assert!(loaded.is_packed());
    let again = serialize(&[("q", &loaded)], None).unwrap();
    assert_eq!(again, raw);
    // Three F4 elements are 12 bits: not whole bytes.
    let odd = tensor_of(&[1, 2, 3], f4, &[3]);
    assert!(matches!(
        serialize(&[("odd", &odd)], None),
        Err(Error::Shape(_))
    ));
}

#[test]
fn zero_d_and_empty_tensors() {
    let dir = TempDir::new("empty");
    let scalar = Tensor::from_slice(&[2.5f64], &[]).unwrap();
    let empty = Tensor::zeros(&[0, 3], DType::F32, Device::CPU).unwrap();
    let empty2 = Tensor::zeros(&[2, 0], DType::I64, Device::CPU).unwrap();
    let path = dir.path("e.safetensors");
    save_file(
        &[("scalar", &scalar), ("empty", &empty), ("empty2", &empty2)],
        None,
        &path,
    )
    .unwrap();
    let file = SafeTensors::open(&path).unwrap();
    let s = file.tensor("scalar", false).unwrap();
    assert_eq!(s.shape(), &[] as &[usize]);
    assert_eq!(s.to_vec::<f64>().unwrap(), vec![2.5]);
    let e = file.tensor("empty", false).unwrap();
    assert_eq!(e.shape(), &[0, 3]);
    assert_eq!(e.numel(), 0);
    assert_eq!(file.info("empty").unwrap().nbytes(), 0);
    assert_eq!(file.tensor("empty2", true).unwrap().shape(), &[2, 0]);
    // A file of no tensors at all.
    let none = dir.path("none.safetensors");
    save_file(&[], None, &none).unwrap();
    assert_eq!(SafeTensors::open(&none).unwrap().keys().count(), 0);
}

#[test]
fn metadata_round_trips() {
    let dir = TempDir::new("meta");
    let mut meta = BTreeMap::new();
    meta.insert("format".to_owned(), "pt".to_owned());
    meta.insert(
        "quoted \"key\"".to_owned(),
        "line\nbreak ünïcode".to_owned(),
    );
    let t = Tensor::from_slice(&[1i32, 2, 3], &[3]).unwrap();
    let path = dir.path("m.safetensors");
    save_file(&[("t", &t)], Some(&meta), &path).unwrap();
    let file = SafeTensors::open(&path).unwrap();
    assert_eq!(file.metadata(), &meta);
    // Without metadata there is no `__metadata__` entry.
    save_file(&[("t", &t)], None, &path).unwrap();
    assert!(SafeTensors::open(&path).unwrap().metadata().is_empty());
    let text = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned();
    assert!(!text.contains("__metadata__"));
}

#[test]
fn strided_views_are_saved_compact() {
    let dir = TempDir::new("strided");
    let t = Tensor::from_slice(&[1u16, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
    let transposed = t.transpose().unwrap();
    let path = dir.path("s.safetensors");
    save_file(&[("t", &transposed)], None, &path).unwrap();
    let back = SafeTensors::open(&path)
        .unwrap()
        .tensor("t", false)
        .unwrap();
    assert_eq!(back.shape(), &[3, 2]);
    assert_eq!(back.to_vec::<u16>().unwrap(), vec![1, 4, 2, 5, 3, 6]);
}

#[test]
fn data_is_ordered_widest_first_and_aligned() {
    let a = Tensor::from_slice(&[1u8], &[1]).unwrap();
    let b = Tensor::from_slice(&[1.0f64, 2.0], &[2]).unwrap();
    let c = Tensor::from_slice(&[7i16; 3], &[3]).unwrap();
    let bytes = serialize(&[("a", &a), ("b", &b), ("c", &c)], None).unwrap();
    let header = Header::parse(&bytes, bytes.len() as u64, Path::new("mem")).unwrap();
    assert_eq!(header.tensor("b").unwrap().data_offsets(), 0..16);
    assert_eq!(header.tensor("c").unwrap().data_offsets(), 16..22);
    assert_eq!(header.tensor("a").unwrap().data_offsets(), 22..23);
    assert_eq!(header.data_start() % 8, 0);
    assert_eq!(bytes.len() as u64, header.data_start() + 23);
}

// ---------------------------------------------------------------------------------------------
// Loading: zero-copy, alignment, copies, selection

#[test]
fn views_are_zero_copy_and_read_only() {
    let dir = TempDir::new("zc");
    let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let path = dir.path("z.safetensors");
    save_file(&[("w", &t)], None, &path).unwrap();
    let file = SafeTensors::open(&path).unwrap();
    let map = file.buffer();
    assert!(map.is_foreign() && map.is_read_only());
    assert_eq!(map.len() as u64, std::fs::metadata(&path).unwrap().len());
    let base = map.host_ptr().unwrap().as_ptr() as usize;

    let mut view = file.tensor("w", false).unwrap();
    let addr = view.as_slice::<f32>().unwrap().as_ptr() as usize;
    let range = file.info("w").unwrap().byte_range();
    assert_eq!(
        addr,
        base + range.start as usize,
        "the view points into the mapping"
    );
    assert!(addr + 16 <= base + map.len());
    let again = file.tensor("w", false).unwrap();
    assert_eq!(again.as_slice::<f32>().unwrap().as_ptr() as usize, addr);
    assert!(view.is_read_only());
    assert!(matches!(
        view.as_mut_slice::<f32>(),
        Err(Error::ReadOnly(_))
    ));

    // Every view keeps the map alive after the file handle is gone.
    drop(file);
    drop(again);
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(view.buffer().ref_count(), 1);
}

#[test]
fn misaligned_tensor_is_copied_into_aligned_memory() {
    let dir = TempDir::new("align");
    // `a` takes one byte, so `b` (F32) starts at data offset 1: never 4-byte aligned, as the data
    // section starts at a multiple of 8.
    let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                   "b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}}"#;
    let mut data = vec![9u8];
    data.extend_from_slice(&1.5f32.to_le_bytes());
    data.extend_from_slice(&(-2.0f32).to_le_bytes());
    let path = dir.file("a.safetensors", &st_bytes(json, &data));
    let file = SafeTensors::open(&path).unwrap();
    assert_eq!(file.header().data_start() % 8, 0);
    let b = file.tensor("b", false).unwrap();
    assert!(!b.buffer().same_allocation(file.buffer()), "copied");
    assert_eq!(b.as_slice::<f32>().unwrap().as_ptr() as usize % 4, 0);
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
    assert!(
        b.is_read_only(),
        "copy=false gives read-only memory either way"
    );
    let a = file.tensor("a", false).unwrap();
    assert!(
        a.buffer().same_allocation(file.buffer()),
        "bytes need no alignment"
    );
    assert_eq!(a.to_vec::<u8>().unwrap(), vec![9]);
}

#[test]
fn copy_true_gives_private_writable_memory() {
    let dir = TempDir::new("copy");
    let t = Tensor::from_slice(&[1i64, 2, 3], &[3]).unwrap();
    let path = dir.path("c.safetensors");
    save_file(&[("t", &t)], None, &path).unwrap();
    let file = SafeTensors::open(&path).unwrap();
    let mut copy = file.tensor("t", true).unwrap();
    assert!(!copy.buffer().same_allocation(file.buffer()));
    assert!(!copy.is_read_only() && !copy.buffer().is_foreign());
    copy.as_mut_slice::<i64>().unwrap()[0] = 100;
    assert_eq!(copy.to_vec::<i64>().unwrap(), vec![100, 2, 3]);
    assert_eq!(
        file.tensor("t", false).unwrap().to_vec::<i64>().unwrap(),
        vec![1, 2, 3]
    );
}

#[test]
fn loads_only_the_tensors_asked_for() {
    let dir = TempDir::new("select");
    let tensors: Vec<(String, Tensor)> = (0..5)
        .map(|i| {
            (
                format!("layer.{i}.w"),
                Tensor::from_slice(&[i as f32], &[1]).unwrap(),
            )
        })
        .collect();
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let path = dir.path("sel.safetensors");
    save_file(&named, None, &path).unwrap();
    let file = SafeTensors::open(&path).unwrap();
    let picked = file.load(&["layer.3.w", "layer.1.w"], false).unwrap();
    assert_eq!(
        picked.keys().collect::<Vec<_>>(),
        ["layer.1.w", "layer.3.w"]
    );
    assert_eq!(picked["layer.3.w"].to_vec::<f32>().unwrap(), vec![3.0]);
    let even = file
        .load_where(|name| name.contains(".0.") || name.contains(".2."), true)
        .unwrap();
    assert_eq!(even.len(), 2);
    assert!(matches!(
        file.load(&["nope"], false),
        Err(Error::InvalidArgument(_))
    ));
    let plan = file.plan(|name| name != "layer.4.w");
    assert_eq!(plan.len(), 4);
    assert!(
        plan.windows(2)
            .all(|w| w[0].byte_range.end <= w[1].byte_range.start)
    );
    assert_eq!(&*plan[0].file, path.as_path());
}

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints

fn two_shards(dir: &TempDir) -> (PathBuf, PathBuf) {
    let a = Tensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    let b = Tensor::from_slice(&[3i32], &[1]).unwrap();
    let c = Tensor::from_slice(&[4u8, 5, 6], &[3]).unwrap();
    let one = dir.path("model-00001-of-00002.safetensors");
    let two = dir.path("model-00002-of-00002.safetensors");
    save_file(&[("a", &a), ("b", &b)], None, &one).unwrap();
    save_file(&[("c", &c)], None, &two).unwrap();
    (one, two)
}

#[test]
fn checkpoint_from_index_and_from_files() {
    let dir = TempDir::new("shards");
    let (one, two) = two_shards(&dir);
    let index = dir.file(
        "model.safetensors.index.json",
        br#"{"metadata": {"total_size": 15, "format": "pt"},
             "weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00001-of-00002.safetensors",
                            "c": "model-00002-of-00002.safetensors"}}"#,
    );
    let ckpt = Checkpoint::open(&index).unwrap();
    assert_eq!(ckpt.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(ckpt.metadata()["total_size"], "15");
    assert_eq!(ckpt.metadata()["format"], "pt");
    assert_eq!(ckpt.shards().len(), 2);
    assert_eq!(
        ckpt.tensor("c", false).unwrap().to_vec::<u8>().unwrap(),
        vec![4, 5, 6]
    );
    let (shard, info) = ckpt.info("a").unwrap();
    assert_eq!(shard.path(), one.as_path());
    assert_eq!(info.dtype(), DType::F32);
    let plan = ckpt.plan(|_| true);
    assert_eq!(
        plan.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    assert_eq!(&*plan[2].file, two.as_path());
    assert_eq!(
        plan[2].byte_range.end,
        std::fs::metadata(&two).unwrap().len()
    );
    let all = ckpt.load_where(|_| true, false).unwrap();
    assert_eq!(all["b"].to_vec::<i32>().unwrap(), vec![3]);

    let listed = Checkpoint::open_files(&[&one, &two]).unwrap();
    assert_eq!(listed.keys().count(), 3);
    assert!(listed.metadata().is_empty());
    assert_eq!(
        listed.load(&["a"], true).unwrap()["a"]
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0, 2.0]
    );
    assert_eq!(Checkpoint::open(&one).unwrap().keys().count(), 2);
}

#[test]
fn checkpoint_errors() {
    let dir = TempDir::new("shard-errors");
    let (one, _) = two_shards(&dir);
    // The same name in two shards.
    let dup = dir.path("dup.safetensors");
    save_file(
        &[("a", &Tensor::from_slice(&[0u8], &[1]).unwrap())],
        None,
        &dup,
    )
    .unwrap();
    assert_invalid(
        Checkpoint::open_files(&[&one, &dup]),
        &dup,
        &["`a`", "one shard"],
    );

    // An index naming a missing shard: NotFound, naming it.
    let index = dir.file(
        "missing.index.json",
        br#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "z": "gone.safetensors"}}"#,
    );
    match Checkpoint::open_index(&index) {
        Err(Error::Io { path, source }) => {
            assert_eq!(path, dir.path("gone.safetensors"));
            assert_eq!(source.kind(), IoKind::NotFound);
        }
        other => panic!("{other:?}"),
    }
    // A name the index places in a shard that lacks it.
    let index = dir.file(
        "wrong.index.json",
        br#"{"weight_map": {"c": "model-00001-of-00002.safetensors"}}"#,
    );
    assert_invalid(
        Checkpoint::open_index(&index),
        &index,
        &["`c`", "no such tensor"],
    );
    // Paths leaving the folder, a missing weight_map, duplicate keys, bad JSON.
    for (name, text, needle) in [
        (
            "up.index.json",
            r#"{"weight_map": {"a": "../x.safetensors"}}"#,
            "inside",
        ),
        (
            "abs.index.json",
            r#"{"weight_map": {"a": "/etc/x.safetensors"}}"#,
            "inside",
        ),
        ("nomap.index.json", r#"{"metadata": {}}"#, "weight_map"),
        (
            "dupkey.index.json",
            r#"{"weight_map": {"a": "x", "a": "y"}}"#,
            "duplicate key",
        ),
        ("notjson.index.json", r#"{"weight_map": "#, "JSON"),
    ] {
        let index = dir.file(name, text.as_bytes());
        assert_invalid(Checkpoint::open_index(&index), &index, &[needle]);
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed files

#[test]
fn missing_file_and_directory_keep_their_io_kind() {
    let dir = TempDir::new("io");
    let missing = dir.path("missing.safetensors");
    for result in [
        SafeTensors::open(&missing).map(|_| ()),
        Header::read(&missing).map(|_| ()),
    ] {
        match result {
            Err(Error::Io { path, source }) => {
                assert_eq!(path, missing);
                assert_eq!(source.kind(), IoKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
    }
    let err = SafeTensors::open(&dir.0).unwrap_err();
    assert_eq!(err.kind(), dlbridge::ErrorKind::Runtime);
    match err {
        Error::Io { path, source } => {
            assert_eq!(path, dir.0);
            assert_eq!(source.kind(), IoKind::IsADirectory);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncated_files() {
    assert_rejected(&[], &["shorter than the 8-byte"]);
    assert_rejected(&[1, 0, 0], &["3 bytes is shorter than the 8-byte"]);
    // The prefix promises 100 header bytes; the file has 12 after it.
    let mut bytes = 100u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}          ");
    assert_rejected(&bytes, &["header length 100", "past the end"]);
    // A tensor's bytes beyond the end of a truncated file.
    let json = format!(r#"{{"x":{{{F32_1}:[0,4]}}}}"#);
    assert_rejected(
        &st_bytes(&json, &[0, 0]),
        &["`x`", "outside the data section of 2 bytes"],
    );
}

#[test]
fn header_larger_than_the_cap() {
    let mut bytes = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_rejected(&bytes, &["exceeds the limit"]);
    let bytes = u64::MAX.to_le_bytes();
    assert_rejected(&bytes, &["exceeds the limit"]);
}

#[test]
fn header_not_utf8_or_not_json() {
    assert_rejected(&raw(b"{\"a\xff\":1}", &[]), &["not UTF-8", "offset 3"]);
    assert_rejected(&st_bytes("{not json", &[]), &["not valid JSON"]);
    assert_rejected(&st_bytes("{} trailing", &[]), &["not valid JSON"]);
    assert_rejected(&st_bytes("[1, 2]", &[]), &["not a JSON object"]);
    assert_rejected(&st_bytes(r#"{"x": 3}"#, &[]), &["`x`", "not an object"]);
    // Deep nesting is an error, not a stack overflow.
    let deep = format!(
        "{{\"__metadata__\":{}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert_rejected(&st_bytes(&deep, &[]), &["not valid JSON"]);
}

#[test]
fn duplicate_names_and_keys() {
    let json = format!(r#"{{"x":{{{F32_1}:[0,4]}},"x":{{{F32_1}:[4,8]}}}}"#);
    assert_rejected(&st_bytes(&json, &[0; 8]), &["duplicate key `x`"]);
    let json = r#"{"x":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}}"#;
    assert_rejected(&st_bytes(json, &[0; 4]), &["duplicate key `dtype`"]);
    let json = r#"{"__metadata__":{"k":"a","k":"b"}}"#;
    assert_rejected(&st_bytes(json, &[]), &["duplicate key `k`"]);
}

#[test]
fn offsets_outside_or_overlapping() {
    let json = format!(r#"{{"x":{{{F32_1}:[8,12]}}}}"#);
    assert_rejected(&st_bytes(&json, &[0; 8]), &["`x`", "[8, 12]", "outside"]);
    let json = format!(r#"{{"x":{{{F32_1}:[4,0]}}}}"#);
    assert_rejected(&st_bytes(&json, &[0; 8]), &["`x`", "end before they begin"]);
    let json = format!(r#"{{"x":{{{F32_1}:[0,4]}},"y":{{{F32_1}:[2,6]}}}}"#);
    assert_rejected(&st_bytes(&json, &[0; 8]), &["`x`", "`y`", "overlap"]);
    let huge = format!(r#"{{"x":{{{F32_1}:[18446744073709551612,18446744073709551616]}}}}"#);
    assert_rejected(&st_bytes(&huge, &[0; 8]), &["`x`", "data_offsets"]);
    // Empty tensors at the same offset as another's bytes share none of them.
    let json = format!(
        r#"{{"x":{{{F32_1}:[0,4]}},"e":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}},"f":{{"dtype":"F32","shape":[0],"data_offsets":[2,2]}}}}"#
    );
    let dir = TempDir::new("empties");
    let ok = dir.file("ok.safetensors", &st_bytes(&json, &[0; 4]));
    assert_eq!(SafeTensors::open(&ok).unwrap().keys().count(), 3);
}

#[test]
fn length_must_match_dtype_and_shape() {
    let json = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#;
    assert_rejected(
        &st_bytes(json, &[0; 8]),
        &["`x`", "hold 4 bytes", "needs 8"],
    );
    let json =
        r#"{"x":{"dtype":"F64","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#;
    assert_rejected(&st_bytes(json, &[0; 8]), &["`x`", "overflows"]);
    // An extent past isize::MAX, even beside a 0, is refused as a `Layout` refuses it.
    let json = r#"{"x":{"dtype":"U8","shape":[9223372036854775808,0],"data_offsets":[0,0]}}"#;
    assert_rejected(&st_bytes(json, &[0; 8]), &["`x`", "overflows"]);
    let json = r#"{"x":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
    assert_rejected(&st_bytes(json, &[0; 8]), &["`x`", "whole bytes"]);
    let json = r#"{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#;
    assert_rejected(&st_bytes(json, &[0; 8]), &["`x`", "non-negative integer"]);
    let json = r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#;
    assert_rejected(&st_bytes(json, &[0; 8]), &["`x`", "not 2"]);
    let json = r#"{"x":{"dtype":"F32","data_offsets":[0,4]}}"#;
    assert_rejected(&st_bytes(json, &[0; 8]), &["`x`", "no `shape`"]);
}

#[test]
fn unknown_dtype_names_tensor_and_file() {
    let json = r#"{"weight":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}}"#;
    assert_rejected(
        &st_bytes(json, &[0; 8]),
        &["`weight`", "unknown dtype `F7`"],
    );
    let json = r#"{"__metadata__":{"k":1}}"#;
    assert_rejected(&st_bytes(json, &[]), &["`k`", "not a string"]);
}

#[test]
fn save_errors_leave_no_file() {
    let dir = TempDir::new("save-errors");
    let t = Tensor::from_slice(&[1.0f32], &[1]).unwrap();
    let c128 = Tensor::zeros(&[1], DType::C128, Device::CPU).unwrap();
    let path = dir.path("out.safetensors");
    assert!(matches!(
        save_file(&[("t", &t), ("z", &c128)], None, &path),
        Err(Error::UnsupportedDType(m)) if m.contains("`z`")
    ));
    assert!(matches!(
        save_file(&[("t", &t), ("t", &t)], None, &path),
        Err(Error::InvalidArgument(m)) if m.contains("twice")
    ));
    assert!(matches!(
        save_file(&[("__metadata__", &t)], None, &path),
        Err(Error::InvalidArgument(_))
    ));
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
    let nowhere = dir.path("no-such-folder/out.safetensors");
    match save_file(&[("t", &t)], None, &nowhere) {
        Err(Error::Io { path, source }) => {
            assert_eq!(path, nowhere);
            assert_eq!(source.kind(), IoKind::NotFound);
        }
        other => panic!("{other:?}"),
    }
    // A successful save replaces the file whole and leaves nothing else behind.
    save_file(&[("t", &t)], None, &path).unwrap();
    save_file(&[("u", &t)], None, &path).unwrap();
    assert_eq!(dir.entries(), ["out.safetensors"]);
    assert_eq!(
        SafeTensors::open(&path).unwrap().keys().collect::<Vec<_>>(),
        ["u"]
    );
}

// ---------------------------------------------------------------------------------------------
// Device tensors (run with `--include-ignored` on a GPU machine)

#[test]
#[ignore = "needs a CUDA device"]
fn saves_device_tensors() {
    let device = gpu();
    let dir = TempDir::new("cuda");
    let host = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let on_device = host.copy_to(device).unwrap();
    let strided = on_device.transpose().unwrap();
    let path = dir.path("d.safetensors");
    save_file(&[("d", &on_device), ("t", &strided)], None, &path).unwrap();
    let file = SafeTensors::open(&path).unwrap();
    assert_eq!(
        file.tensor("d", false).unwrap().to_vec::<f32>().unwrap(),
        host.to_vec::<f32>().unwrap()
    );
    assert_eq!(
        file.tensor("t", false).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
}
