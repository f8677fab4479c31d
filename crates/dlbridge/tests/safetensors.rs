//! safetensors: round trips of every dtype, zero-copy loading, shards, and every malformed input
//! the parser must refuse (written byte by byte here).

mod common;
use common::gpu;

use std::collections::BTreeMap;
use std::io::ErrorKind as IoKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use dlbridge::safetensors::{
    Checkpoint, DEFAULT_MAX_GAP, Header, LoadOptions, MAX_HEADER_LEN, PartPlan, SafeTensors,
    deserialize, dtype_from_name, dtype_name, dtype_names, save_file, serialize,
};
use dlbridge::{DType, Device, Error, Layout, SliceArg, Tensor};

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
    assert_eq!(file.metadata(), Some(&meta));
    // Empty metadata is an empty `__metadata__` object, read back as such.
    save_file(&[("t", &t)], Some(&BTreeMap::new()), &path).unwrap();
    assert_eq!(
        SafeTensors::open(&path).unwrap().metadata(),
        Some(&BTreeMap::new())
    );
    // Without metadata there is no `__metadata__` entry, and none is read back.
    save_file(&[("t", &t)], None, &path).unwrap();
    assert_eq!(SafeTensors::open(&path).unwrap().metadata(), None);
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
    assert_eq!(ckpt.metadata().unwrap()["total_size"], "15");
    assert_eq!(ckpt.metadata().unwrap()["format"], "pt");
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
    assert_eq!(listed.metadata(), None);
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
    assert_rejected(
        &bytes,
        &[
            "not a safetensors file",
            "100000001, over the format's limit",
        ],
    );
    let bytes = u64::MAX.to_le_bytes();
    assert_rejected(
        &bytes,
        &["not a safetensors file", "over the format's limit"],
    );
}

/// Bytes that cannot be a safetensors file say so, naming what they begin with (and the
/// format, where it is a common one), not only the header length the first 8 bytes make.
#[test]
fn other_formats_say_they_are_not_safetensors() {
    let mut zip = b"PK\x03\x04\x14\x00\x00\x00".to_vec();
    zip.extend_from_slice(&[0; 64]);
    assert_rejected(
        &zip,
        &[
            "not a safetensors file: it begins b\"PK\\x03\\x04\\x14\\x00\\x00\\x00\"",
            "a ZIP archive",
        ],
    );
    let mut pickle = b"\x80\x02}q\x00(X\x07".to_vec();
    pickle.extend_from_slice(&[0; 64]);
    assert_rejected(&pickle, &["not a safetensors file", "a Python pickle"]);
    let text = b"hello world, this is a text file and not a checkpoint".to_vec();
    assert_rejected(&text, &["not a safetensors file: it begins b\"hello wo\""]);
    // A plausible length, then something other than a JSON object.
    assert_rejected(
        &raw(b"[1, 2]", &[]),
        &["not a safetensors file", "does not begin with `{`"],
    );
    assert_rejected(&raw(b"", &[]), &["not a safetensors file", "0-byte header"]);
}

#[test]
fn header_not_utf8_or_not_json() {
    assert_rejected(&raw(b"{\"a\xff\":1}", &[]), &["not UTF-8", "offset 3"]);
    assert_rejected(&st_bytes("{not json", &[]), &["not valid JSON"]);
    assert_rejected(&st_bytes("{} trailing", &[]), &["not valid JSON"]);
    assert_rejected(&st_bytes("[1, 2]", &[]), &["not a safetensors file"]);
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
    assert_rejected(
        &st_bytes(&json, &[0; 8]),
        &["`x` [0, 4]", "`y` [2, 6]", "overlap"],
    );
    let huge = format!(r#"{{"x":{{{F32_1}:[18446744073709551612,18446744073709551616]}}}}"#);
    assert_rejected(&st_bytes(&huge, &[0; 8]), &["`x`", "data_offsets"]);
}

/// The tensors must tile the data section, as the `safetensors` package requires: no byte
/// before the first, between two, or after the last belongs to no tensor (such bytes could hold
/// a second format); an empty tensor lies where one tensor ends and the next begins.
#[test]
fn tensors_tile_the_data_section() {
    let e = |at: u32| format!(r#""dtype":"F32","shape":[0],"data_offsets":[{at},{at}]"#);
    // Empty tensors at the start, between two and at the end; names in any order.
    let json = format!(
        r#"{{"y":{{{F32_1}:[4,8]}},"e":{{{}}},"x":{{{F32_1}:[0,4]}},"f":{{{}}},"g":{{{}}}}}"#,
        e(0),
        e(4),
        e(8)
    );
    let dir = TempDir::new("tiles");
    let ok = dir.file("ok.safetensors", &st_bytes(&json, &[0; 8]));
    assert_eq!(SafeTensors::open(&ok).unwrap().keys().count(), 5);
    let ok = dir.file("empty.safetensors", &st_bytes("{}", &[]));
    assert_eq!(SafeTensors::open(&ok).unwrap().keys().count(), 0);

    let hole = format!(r#"{{"x":{{{F32_1}:[0,4]}},"y":{{{F32_1}:[8,12]}}}}"#);
    assert_rejected(
        &st_bytes(&hole, &[0; 12]),
        &[
            "bytes [4, 8)",
            "between `x` [0, 4] and `y` [8, 12]",
            "no gaps",
        ],
    );
    let late = format!(r#"{{"x":{{{F32_1}:[4,8]}}}}"#);
    assert_rejected(
        &st_bytes(&late, &[0; 8]),
        &["bytes [0, 4)", "the start of the data section", "no gaps"],
    );
    let trailing = format!(r#"{{"x":{{{F32_1}:[0,4]}}}}"#);
    assert_rejected(
        &st_bytes(&trailing, &[0; 5]),
        &[
            "5 bytes but its tensors end at byte 4",
            "after the last tensor",
        ],
    );
    assert_rejected(
        &st_bytes("{}", &[0; 8]),
        &["8 bytes but its tensors end at byte 0"],
    );
    let inside = format!(r#"{{"x":{{{F32_1}:[0,4]}},"e":{{{}}}}}"#, e(2));
    assert_rejected(
        &st_bytes(&inside, &[0; 4]),
        &["`e` [2, 2] begins inside `x` [0, 4]"],
    );
    let past = format!(r#"{{"x":{{{F32_1}:[0,4]}},"e":{{{}}}}}"#, e(8));
    assert_rejected(
        &st_bytes(&past, &[0; 4]),
        &["`e`", "outside the data section"],
    );
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

// ---------------------------------------------------------------------------------------------
// Files that are not regular files, views that consumers write, and how a save replaces a file

/// `f` run on a thread, its result within 20 s: a call that blocks forever fails the test
/// (naming `what`) instead of hanging it.
fn within_seconds<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} blocked for 20 s"))
}

fn mkfifo(path: &Path) {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
}

/// Every way the crate opens a file a caller names (one file, a list of shards, an index, the
/// shards an index lists, a header alone) refuses a FIFO, a socket, a character device and a
/// directory with an `Error::Io` saying what it is, and none of them blocks (a FIFO without a
/// writer blocked `open` forever). A save refuses them as its target too. (`Checkpoint::open`
/// opens a folder as the checkpoint in it: an empty one is `NotFound`, saying so.)
#[test]
fn non_regular_files_are_refused_without_blocking() {
    let dir = TempDir::new("special");
    let good = dir.path("good.safetensors");
    let t = Tensor::from_slice(&[1.0f32], &[1]).unwrap();
    save_file(&[("g", &t)], None, &good).unwrap();
    let fifo = dir.path("fifo.safetensors");
    mkfifo(&fifo);
    let socket = dir.path("socket.safetensors");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let folder = dir.path("folder.safetensors");
    std::fs::create_dir(&folder).unwrap();
    let null = dir.path("null.safetensors");
    std::os::unix::fs::symlink("/dev/null", &null).unwrap();
    let cases = [
        (
            &fifo,
            "is a FIFO (named pipe), not a regular file",
            IoKind::InvalidInput,
        ),
        (
            &socket,
            "is a socket, not a regular file",
            IoKind::InvalidInput,
        ),
        (
            &null,
            "is a character device, not a regular file",
            IoKind::InvalidInput,
        ),
        (
            &folder,
            "is a directory, not a regular file",
            IoKind::IsADirectory,
        ),
    ];
    let expect = |result: dlbridge::Result<()>, path: &Path, says: &str, kind: IoKind| match result
    {
        Err(Error::Io {
            path: named,
            source,
        }) => {
            assert_eq!(named, path);
            assert_eq!(source.kind(), kind, "{source}");
            assert!(source.to_string().contains(says), "{source}");
        }
        other => panic!("{}: {other:?}", path.display()),
    };
    for (path, says, kind) in cases {
        type Open = fn(PathBuf, PathBuf) -> dlbridge::Result<()>;
        let opens: [(&str, Open); 4] = [
            ("SafeTensors::open", |p, _| SafeTensors::open(p).map(drop)),
            ("Header::read", |p, _| Header::read(&p).map(drop)),
            ("Checkpoint::open", |p, _| Checkpoint::open(p).map(drop)),
            ("Checkpoint::open_files", |p, good| {
                Checkpoint::open_files(&[good, p]).map(drop)
            }),
        ];
        for (what, open) in opens {
            let (p, g) = (path.clone(), good.clone());
            let result = within_seconds(what, move || open(p, g));
            if what == "Checkpoint::open" && path == &folder {
                // A folder opens as the checkpoint it holds: this one holds none.
                let says = "is a directory holding no model.safetensors.index.json";
                expect(result, path, says, IoKind::NotFound);
            } else {
                expect(result, path, says, kind);
            }
        }
        // An index naming it as a shard.
        let name = path.file_name().unwrap().to_str().unwrap();
        let index = dir.file(
            "model.safetensors.index.json",
            format!(r#"{{"weight_map": {{"g": "good.safetensors", "x": "{name}"}}}}"#).as_bytes(),
        );
        let result = within_seconds("an index's shard", move || {
            Checkpoint::open(index).map(drop)
        });
        expect(result, path, says, kind);
        // A save to it (through the link, for the device) leaves it as it was.
        let result = save_file(&[("t", &t)], None, path);
        expect(result, path, says, kind);
    }
    assert!(
        std::fs::metadata("/dev/null")
            .unwrap()
            .file_type()
            .is_char_device()
    );
    // The index itself as a FIFO.
    let index = dir.path("fifo.index.json");
    mkfifo(&index);
    let named = index.clone();
    let result = within_seconds("a FIFO index", move || Checkpoint::open(named).map(drop));
    expect(
        result,
        &index,
        "is a FIFO (named pipe), not a regular file",
        IoKind::InvalidInput,
    );
    let left: Vec<String> = dir.entries();
    assert_eq!(
        left,
        [
            "fifo.index.json",
            "fifo.safetensors",
            "folder.safetensors",
            "good.safetensors",
            "model.safetensors.index.json",
            "null.safetensors",
            "socket.safetensors",
        ]
    );
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
}

/// A consumer that ignores a view's read-only flag (PyTorch, through DLPack) and writes into it
/// writes the process's private copy of the page (the file is mapped copy-on-write): no fault,
/// the file unchanged on disk, another opening of it unchanged; the views of the same opening
/// share the write (they are one memory).
#[test]
fn writes_into_views_are_private_to_the_mapping() {
    let dir = TempDir::new("cow");
    let path = dir.path("w.safetensors");
    let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    save_file(&[("w", &w)], None, &path).unwrap();
    let before = std::fs::read(&path).unwrap();
    let file = SafeTensors::open(&path).unwrap();
    assert!(file.is_copy_on_write());
    let view = file.tensor("w", false).unwrap();
    assert!(view.is_read_only() && view.buffer().same_allocation(file.buffer()));
    let ptr = view.buffer().host_ptr().unwrap().as_ptr();
    let first = ptr.wrapping_add(view.byte_offset()).cast::<f32>();
    // SAFETY: what a consumer ignoring the read-only flag does: `first` is the view's first
    // element, 4-byte aligned (the loader views aligned bytes only), inside the live mapping.
    unsafe { first.write(9.0) };
    assert_eq!(
        file.tensor("w", false).unwrap().to_vec::<f32>().unwrap(),
        [9.0, 2.0, 3.0, 4.0]
    );
    let again = SafeTensors::open(&path).unwrap();
    assert_eq!(
        again.tensor("w", false).unwrap().to_vec::<f32>().unwrap(),
        [1.0, 2.0, 3.0, 4.0]
    );
    drop((view, file));
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

/// A save over an existing file keeps its permission bits (it used to get the temporary's
/// 0o644-ish default), and, as root, its owner and group; a new file gets what any new file
/// gets (0o666 less the umask, as `File::create` makes it).
#[test]
fn a_save_keeps_the_mode_and_owner_of_the_file_it_replaces() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = TempDir::new("modes");
    let t = Tensor::from_slice(&[1u8, 2], &[2]).unwrap();
    let path = dir.path("m.safetensors");
    for mode in [0o600, 0o640, 0o604, 0o444, 0o755] {
        std::fs::write(&path, b"old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        save_file(&[("t", &t)], None, &path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o7777, mode, "{mode:o}");
        assert_eq!(SafeTensors::open(&path).unwrap().keys().count(), 1);
        std::fs::remove_file(&path).unwrap();
    }
    let reference = dir.path("reference");
    std::fs::File::create(&reference).unwrap();
    save_file(&[("t", &t)], None, &path).unwrap();
    assert_eq!(
        std::fs::metadata(&path).unwrap().mode() & 0o7777,
        std::fs::metadata(&reference).unwrap().mode() & 0o7777
    );
    // SAFETY: `geteuid` only reads the process's effective user id.
    if unsafe { libc::geteuid() } == 0 {
        // As root, another user's file stays theirs (root's save used to take it over).
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        save_file(&[("u", &t)], None, &path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (65534, 65534, 0o640)
        );
    }
    assert_eq!(dir.entries(), ["m.safetensors", "reference"]);
}

/// A save to a symbolic link (a Hugging Face cache shard: `snapshots/<rev>/x.safetensors` →
/// `../../blobs/<hash>`) replaces the file the link leads to and leaves the link a link, through
/// chains of links and to a target that does not exist yet; a loop of links is an error.
#[test]
fn a_save_writes_through_symbolic_links() {
    use std::os::unix::fs::symlink;
    let dir = TempDir::new("links");
    std::fs::create_dir_all(dir.path("blobs")).unwrap();
    std::fs::create_dir_all(dir.path("snapshots/rev")).unwrap();
    let blob = dir.path("blobs/abc123");
    let old = Tensor::from_slice(&[1i32], &[1]).unwrap();
    let new = Tensor::from_slice(&[7i32, 8], &[2]).unwrap();
    save_file(&[("old", &old)], None, &blob).unwrap();
    let link = dir.path("snapshots/rev/model.safetensors");
    symlink("../../blobs/abc123", &link).unwrap();
    // A chain: an absolute link to the relative one.
    let chain = dir.path("chain.safetensors");
    symlink(&link, &chain).unwrap();
    for (path, name) in [(&link, "new"), (&chain, "newer")] {
        save_file(&[(name, &new)], None, path).unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert!(std::fs::symlink_metadata(&chain).unwrap().is_symlink());
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            Path::new("../../blobs/abc123")
        );
        let file = SafeTensors::open(&blob).unwrap();
        assert_eq!(file.keys().collect::<Vec<_>>(), [name]);
        assert_eq!(
            file.tensor(name, false).unwrap().to_vec::<i32>().unwrap(),
            [7, 8]
        );
    }
    // A link to a file that does not exist yet: the file is made where it leads.
    let dangling = dir.path("snapshots/rev/later.safetensors");
    symlink("../../blobs/def456", &dangling).unwrap();
    save_file(&[("t", &new)], None, &dangling).unwrap();
    assert!(std::fs::symlink_metadata(&dangling).unwrap().is_symlink());
    assert!(
        std::fs::symlink_metadata(dir.path("blobs/def456"))
            .unwrap()
            .is_file()
    );
    // A loop.
    let (a, b) = (dir.path("a.safetensors"), dir.path("b.safetensors"));
    symlink(&b, &a).unwrap();
    symlink(&a, &b).unwrap();
    match save_file(&[("t", &new)], None, &a) {
        Err(Error::Io { path, source }) => {
            assert_eq!(path, a);
            assert_eq!(source.raw_os_error(), Some(libc::ELOOP), "{source}");
        }
        other => panic!("{other:?}"),
    }
    // No temporary is left anywhere.
    let listing = |p: &str| {
        let mut names: Vec<String> = std::fs::read_dir(dir.path(p))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(listing("blobs"), ["abc123", "def456"]);
    assert_eq!(
        listing("snapshots/rev"),
        ["later.safetensors", "model.safetensors"]
    );
}

/// A save whose header readers would refuse (metadata over the 100 MB cap) is refused before
/// anything is written: no file, no temporary, an existing file untouched. Just under the cap,
/// the file is written and loads.
#[test]
fn a_save_refuses_a_header_over_the_cap() {
    let dir = TempDir::new("cap");
    let t = Tensor::from_slice(&[1u8], &[1]).unwrap();
    let path = dir.path("big.safetensors");
    let mut metadata = BTreeMap::new();
    metadata.insert("k".to_owned(), "x".repeat(MAX_HEADER_LEN as usize));
    let expect_refused = |result: dlbridge::Result<()>| match result {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("over the limit of 100000000 bytes"), "{m}");
            assert!(
                m.contains(&format!("{} bytes of metadata", MAX_HEADER_LEN + 1)),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    };
    expect_refused(save_file(&[("t", &t)], Some(&metadata), &path));
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
    expect_refused(serialize(&[("t", &t)], Some(&metadata)).map(drop));
    save_file(&[("t", &t)], None, &path).unwrap();
    let before = std::fs::read(&path).unwrap();
    expect_refused(save_file(&[("t", &t)], Some(&metadata), &path));
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(dir.entries(), ["big.safetensors"]);
    // Metadata under the cap whose JSON (escaped) is over it.
    metadata.insert("k".to_owned(), "\"".repeat(MAX_HEADER_LEN as usize / 2 + 1));
    match save_file(&[("t", &t)], Some(&metadata), &path) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("header would be 10000"), "{m}");
            assert!(m.contains("over the limit of 100000000 bytes"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), before);
    // Just under the cap: written, and read back.
    metadata.insert("k".to_owned(), "x".repeat(MAX_HEADER_LEN as usize - 200));
    save_file(&[("t", &t)], Some(&metadata), &path).unwrap();
    let header = Header::read(&path).unwrap();
    assert!(header.header_len() <= MAX_HEADER_LEN);
    assert_eq!(
        header.metadata().unwrap()["k"].len(),
        MAX_HEADER_LEN as usize - 200
    );
}

// ---------------------------------------------------------------------------------------------
// Parts of tensors: only the bytes a part needs (a tensor-parallel rank's rows or columns)

/// The bytes a plan's runs bring into its destination, from `array`.
fn gather(plan: &PartPlan, array: &[u8]) -> Vec<u8> {
    let mut dst = vec![0xEEu8; plan.len];
    for (run, at) in &plan.runs {
        let (start, end) = (run.start as usize, run.end as usize);
        dst[*at..*at + (end - start)].copy_from_slice(&array[start..end]);
    }
    dst
}

/// The `u32` elements `layout` addresses in `bytes`, in row-major order of the layout.
fn elements(layout: &Layout, bytes: &[u8]) -> Vec<u32> {
    let t = tensor_of(bytes, DType::U8, &[bytes.len()]);
    let view = Tensor::new(t.buffer().clone(), DType::U32, layout.clone()).unwrap();
    view.copy().unwrap().to_vec::<u32>().unwrap()
}

/// An array of `n` `u32` elements each holding its own index.
fn counting(n: usize) -> Vec<u8> {
    (0..n as u32).flat_map(u32::to_le_bytes).collect()
}

/// A layout over `shape` (row-major, byte offset 0) with `ops` applied: `Ok(arg)` slices the
/// axis, `Err(i)` indexes it.
fn part_of(shape: &[usize], ops: &[(isize, std::result::Result<SliceArg, isize>)]) -> Layout {
    let mut layout = Layout::contiguous(shape).unwrap();
    for (axis, op) in ops {
        layout = match op {
            Ok(arg) => layout.slice(*axis, *arg, 4).unwrap(),
            Err(i) => layout.index(*axis, *i, 4).unwrap(),
        };
    }
    layout
}

fn range(start: isize, stop: isize, step: isize) -> std::result::Result<SliceArg, isize> {
    Ok(SliceArg {
        start: Some(start),
        stop: Some(stop),
        step,
    })
}

/// Every kind of part of a (4, 6, 8) `u32` array, planned with no gap read through and with the
/// default: the destination holds exactly the part's elements where its layout says, the runs
/// are increasing and disjoint, and without gaps only the part's own bytes are read, in as few
/// runs as its rows allow (a dim-0 range is one run; an inner range one run per outer index).
#[test]
fn part_plans_read_only_the_bytes_a_part_needs() {
    let shape = [4usize, 6, 8];
    let array = counting(4 * 6 * 8);
    let cases: Vec<(&str, Layout, usize)> = vec![
        ("whole", part_of(&shape, &[]), 1),
        ("rows 1:3", part_of(&shape, &[(0, range(1, 3, 1))]), 1),
        ("row 2", part_of(&shape, &[(0, Err(2))]), 1),
        ("last row", part_of(&shape, &[(0, Err(-1))]), 1),
        ("columns 2:4", part_of(&shape, &[(1, range(2, 4, 1))]), 4),
        ("inner 1:3", part_of(&shape, &[(2, range(1, 3, 1))]), 24),
        (
            "row 1, inner 5:8",
            part_of(&shape, &[(0, Err(1)), (1, range(5, 8, 1))]),
            6,
        ),
        (
            "every other row",
            part_of(&shape, &[(0, range(0, 4, 2))]),
            2,
        ),
        ("a step inside", part_of(&shape, &[(2, range(0, 8, 3))]), 72),
        (
            "element",
            part_of(&shape, &[(0, Err(3)), (0, Err(5)), (0, Err(7))]),
            1,
        ),
        (
            "new axes",
            {
                let l = part_of(&shape, &[(1, range(1, 2, 1))]);
                l.expand_dims(0).unwrap().expand_dims(3).unwrap()
            },
            4,
        ),
        ("empty", part_of(&shape, &[(0, range(2, 2, 1))]), 0),
    ];
    for (name, part, runs_without_gaps) in &cases {
        let want = elements(part, &array);
        let exact = PartPlan::new(part, 4, array.len(), 0).unwrap();
        let merged = PartPlan::new(part, 4, array.len(), DEFAULT_MAX_GAP).unwrap();
        assert_eq!(exact.runs.len(), *runs_without_gaps, "{name}: {exact:?}");
        assert_eq!(
            exact.bytes_read(),
            4 * part.numel() as u64,
            "{name}: only the part's bytes"
        );
        assert_eq!(exact.len, 4 * part.numel(), "{name}");
        for plan in [&exact, &merged] {
            assert!(
                plan.runs.windows(2).all(|w| w[0].0.end < w[1].0.start),
                "{name}: runs increasing, disjoint and apart: {:?}",
                plan.runs
            );
            assert_eq!(plan.layout.shape(), part.shape(), "{name}");
            assert_eq!(
                elements(&plan.layout, &gather(plan, &array)),
                want,
                "{name}"
            );
            assert!(plan.bytes_read() as usize <= plan.len && plan.len <= array.len());
        }
        // Through gaps of at most `DEFAULT_MAX_GAP` (256 bytes), this small array is one run.
        assert!(merged.runs.len() <= 1, "{name}: {:?}", merged.runs);
    }
    // A 0-d array's part is its one element.
    let scalar = PartPlan::new(&Layout::contiguous(&[]).unwrap(), 4, 4, 0).unwrap();
    assert_eq!((scalar.runs.clone(), scalar.len), (vec![(0..4, 0)], 4));
    // A rank's columns: 1 KiB rows, 64 bytes of each, one run per row.
    let wide = part_of(&[16, 256], &[(1, range(8, 24, 1))]);
    let plan = PartPlan::new(&wide, 4, 16 * 1024, DEFAULT_MAX_GAP).unwrap();
    assert_eq!(plan.runs.len(), 16);
    assert_eq!(plan.runs[1], (1024 + 32..1024 + 96, 64));
    assert_eq!(plan.layout.strides(), [16, 1]);
}

#[test]
fn part_plans_refuse_what_is_not_a_part() {
    let shape = [4usize, 6];
    let backwards = part_of(&shape, &[(0, range(3, 0, -1))]);
    let transposed = Layout::contiguous(&shape).unwrap().transpose();
    let broadcast = Layout::contiguous(&[1, 6])
        .unwrap()
        .broadcast_to(&[4, 6])
        .unwrap();
    for (name, part) in [
        ("backwards", &backwards),
        ("transposed", &transposed),
        ("broadcast", &broadcast),
    ] {
        match PartPlan::new(part, 4, 96, 0) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("axis"), "{name}: {m}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    let whole = Layout::contiguous(&shape).unwrap();
    assert!(matches!(
        PartPlan::new(&whole, 4, 95, 0),
        Err(Error::OutOfBounds(_))
    ));
}

/// A file with a (16, 12) `f32` "w" (aligned), a `u8` "odd" of 3 bytes, and an (8, 5) `f32`
/// "m" after it, three bytes off its alignment; "w" holds its element indexes, "m" 1000 + index.
fn part_file(dir: &TempDir) -> PathBuf {
    let w: Vec<u8> = (0..192).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let m: Vec<u8> = (0..40)
        .flat_map(|i| (1000.0 + i as f32).to_le_bytes())
        .collect();
    let mut data = w.clone();
    data.extend_from_slice(&[1, 2, 3]);
    data.extend_from_slice(&m);
    let json = format!(
        r#"{{"w":{{"dtype":"F32","shape":[16,12],"data_offsets":[0,{a}]}},"odd":{{"dtype":"U8","shape":[3],"data_offsets":[{a},{b}]}},"m":{{"dtype":"F32","shape":[8,5],"data_offsets":[{b},{c}]}}}}"#,
        a = w.len(),
        b = w.len() + 3,
        c = data.len()
    );
    dir.file("parts.safetensors", &st_bytes(&json, &data))
}

/// The elements of `t` as `f32`, in row-major order.
fn f32s(t: &Tensor) -> Vec<f32> {
    t.copy_to(Device::CPU)
        .unwrap()
        .copy()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

/// On the CPU a part is a view of the mapped file with the part's strides (zero-copy); asked for
/// a copy, or where its bytes are misaligned, it is a compact copy of only its bytes, read from
/// the file: the same elements as the whole tensor sliced, every way.
#[test]
fn a_part_on_the_cpu_is_a_view_of_the_file_or_a_copy_of_its_bytes() {
    let dir = TempDir::new("parts");
    let path = part_file(&dir);
    let ckpt = Checkpoint::open(&path).unwrap();
    let shard = &ckpt.shards()[0];
    for name in ["w", "m"] {
        let whole = ckpt.tensor(name, true).unwrap();
        let shape = whole.shape().to_vec();
        let parts = [
            part_of(&shape, &[(0, range(2, 5, 1))]),
            part_of(&shape, &[(1, range(1, 4, 1))]),
            part_of(&shape, &[(0, Err(-1))]),
            part_of(&shape, &[(1, range(0, 5, 2))]),
            part_of(&shape, &[(0, range(4, 4, 1))]),
        ];
        for part in &parts {
            let mut expected = whole.clone();
            // The same selection on the loaded tensor: its layout is the part's.
            expected = Tensor::new(expected.buffer().clone(), DType::F32, part.clone()).unwrap();
            let want = f32s(&expected);
            for copy in [false, true] {
                let options = LoadOptions {
                    copy,
                    ..LoadOptions::new(Device::CPU)
                };
                let got = ckpt.load_part(name, part, &options).unwrap();
                assert_eq!(got.shape(), part.shape(), "{name} {part:?}");
                assert_eq!(f32s(&got), want, "{name} {part:?} copy={copy}");
                let is_view = got.buffer().same_allocation(shard.buffer());
                let viewable = !copy && name == "w" && part.numel() > 0;
                assert_eq!(is_view, viewable, "{name} {part:?} copy={copy}");
                assert_eq!(got.is_read_only(), !copy, "{name} {part:?} copy={copy}");
                if is_view {
                    assert_eq!(got.strides(), part.strides(), "a view keeps the strides");
                }
            }
        }
    }
}

#[test]
fn parts_that_cannot_be_read_are_clear_errors() {
    let dir = TempDir::new("part-errors");
    let path = part_file(&dir);
    let ckpt = Checkpoint::open(&path).unwrap();
    let cpu = LoadOptions::new(Device::CPU);
    let whole = Layout::contiguous(&[16, 12]).unwrap();
    assert!(matches!(
        ckpt.load_part("nope", &whole, &cpu),
        Err(Error::InvalidArgument(m)) if m.contains("nope")
    ));
    // A part of another tensor's shape that reaches past this one.
    let bigger = Layout::contiguous(&[17, 12]).unwrap();
    assert!(matches!(
        ckpt.load_part("w", &bigger, &cpu),
        Err(Error::OutOfBounds(_))
    ));
    // Packed sub-byte elements.
    let packed = dir.file(
        "fp4.safetensors",
        &st_bytes(
            r#"{"q":{"dtype":"F4","shape":[4,4],"data_offsets":[0,8]}}"#,
            &[0x21; 8],
        ),
    );
    let packed = Checkpoint::open(&packed).unwrap();
    let rows = part_of(&[4, 4], &[(0, range(0, 2, 1))]);
    assert!(matches!(
        packed.load_part("q", &rows, &cpu),
        Err(Error::UnsupportedDType(m)) if m.contains("packed")
    ));
    // A conversion to a type that is not floating-point would truncate: refused, for whole
    // loads and parts alike.
    for dtype in [DType::I8, DType::U32, DType::BOOL] {
        let options = LoadOptions {
            dtype: Some(dtype),
            ..LoadOptions::new(Device::CPU)
        };
        for result in [
            ckpt.load_to(|_| true, &options, &mut |_, _| {}).map(drop),
            ckpt.load_part("w", &whole, &options).map(drop),
        ] {
            match result {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("truncate"), "{m}"),
                other => panic!("{dtype}: {other:?}"),
            }
        }
    }
    let half = LoadOptions {
        dtype: Some(DType::F16),
        ..LoadOptions::new(Device::CPU)
    };
    let part = ckpt.load_part("w", &rows_of(2), &half).unwrap();
    assert_eq!(part.dtype(), DType::F16);
    assert_eq!(
        part.cast(DType::F32).unwrap().to_vec::<f32>().unwrap()[13],
        13.0
    );
}

fn rows_of(n: isize) -> Layout {
    part_of(&[16, 12], &[(0, range(0, n, 1))])
}

/// On the GPU a part's runs alone are read (staging or direct reads), into one allocation: the
/// same elements as the CPU's, for rows, columns, steps, an element and an empty part.
#[test]
#[ignore = "needs a CUDA device"]
fn a_part_on_the_gpu_holds_the_same_elements() {
    let device = gpu();
    let dir = TempDir::new("parts-gpu");
    let path = part_file(&dir);
    let ckpt = Checkpoint::open(&path).unwrap();
    for name in ["w", "m"] {
        let shape = ckpt.info(name).unwrap().1.shape().to_vec();
        for part in [
            part_of(&shape, &[(0, range(2, 5, 1))]),
            part_of(&shape, &[(1, range(1, 4, 1))]),
            part_of(&shape, &[(1, range(0, 5, 2))]),
            part_of(&shape, &[(0, Err(3)), (0, Err(1))]),
            part_of(&shape, &[(0, range(4, 4, 1))]),
        ] {
            let want = f32s(
                &ckpt
                    .load_part(name, &part, &LoadOptions::new(Device::CPU))
                    .unwrap(),
            );
            for direct in [Some(false), Some(true)] {
                let options = LoadOptions {
                    direct_io: direct,
                    threads: Some(2),
                    ..LoadOptions::new(device)
                };
                let got = ckpt.load_part(name, &part, &options).unwrap();
                assert_eq!(got.device(), device);
                assert_eq!(got.shape(), part.shape());
                assert_eq!(f32s(&got), want, "{name} {part:?} direct={direct:?}");
            }
        }
    }
}

/// `Checkpoint::load_parts_into` for one part.
///
/// # Safety
/// As `Checkpoint::load_parts_into`.
unsafe fn load_part_into(
    ckpt: &Checkpoint,
    name: &str,
    part: &Layout,
    dst: &Tensor,
    options: &LoadOptions,
) -> dlbridge::Result<u64> {
    // SAFETY: the caller's guarantee.
    unsafe { ckpt.load_parts_into(&[(name, part.clone(), dst)], options, &mut |_, _| {}) }
}

/// A part read into existing memory on `device` (`Checkpoint::load_parts_into`): a compact target
/// of the tensor's dtype is filled in place (its own allocation, nothing else on the device),
/// a strided target keeps its strides and the elements around it, a target of another dtype gets
/// the elements converted; each holds what `load_part` gives, and only the part's bytes are
/// counted. A target of another shape or a read-only one is refused, naming the tensor.
fn parts_into(device: Device) {
    let dir = TempDir::new("parts-into");
    let path = part_file(&dir);
    let ckpt = Checkpoint::open(&path).unwrap();
    let cpu = LoadOptions::new(Device::CPU);
    let options = LoadOptions {
        threads: Some(2),
        ..LoadOptions::new(device)
    };
    for name in ["w", "m"] {
        let shape = ckpt.info(name).unwrap().1.shape().to_vec();
        for part in [
            part_of(&shape, &[]),
            part_of(&shape, &[(0, range(2, 5, 1))]),
            part_of(&shape, &[(1, range(1, 4, 1))]),
            part_of(&shape, &[(0, Err(3)), (0, Err(1))]),
            part_of(&shape, &[(0, range(4, 4, 1))]),
        ] {
            let want = f32s(&ckpt.load_part(name, &part, &cpu).unwrap());
            let bytes = 4 * part.numel() as u64;
            // Compact, the tensor's dtype: filled in place.
            let dst = Tensor::zeros(part.shape(), DType::F32, device).unwrap();
            let before = dst.buffer().handle();
            // SAFETY: `dst` is this test's own memory, used by nothing else during the call.
            let read = unsafe { load_part_into(&ckpt, name, &part, &dst, &options) }.unwrap();
            assert_eq!(read, bytes, "{name} {part:?}");
            assert_eq!(dst.buffer().handle(), before);
            assert_eq!(f32s(&dst), want, "{name} {part:?} in place");
            // Strided: every other column of a wider array; the others stay zero.
            let mut wide_shape = part.shape().to_vec();
            if let Some(last) = wide_shape.last_mut() {
                *last *= 2;
            }
            let wide = Tensor::zeros(&wide_shape, DType::F32, device).unwrap();
            let mut layout = wide.layout().clone();
            if !wide_shape.is_empty() {
                let axis = wide_shape.len() as isize - 1;
                layout = layout
                    .slice(
                        axis,
                        SliceArg {
                            start: Some(0),
                            stop: None,
                            step: 2,
                        },
                        4,
                    )
                    .unwrap();
            }
            let strided = Tensor::new(wide.buffer().clone(), DType::F32, layout).unwrap();
            // SAFETY: as above.
            unsafe { load_part_into(&ckpt, name, &part, &strided, &options) }.unwrap();
            assert_eq!(f32s(&strided), want, "{name} {part:?} strided");
            let all = f32s(&wide);
            let zeros = all.iter().filter(|&&v| v == 0.0).count();
            let nonzero_want = want.iter().filter(|&&v| v != 0.0).count();
            assert_eq!(all.len() - zeros, nonzero_want, "the gaps stay untouched");
            // Another dtype: converted.
            let half = Tensor::zeros(part.shape(), DType::F16, device).unwrap();
            // SAFETY: as above.
            unsafe { load_part_into(&ckpt, name, &part, &half, &options) }.unwrap();
            let got = f32s(&half.cast(DType::F32).unwrap());
            assert_eq!(got, want, "{name} {part:?} converted");
        }
    }
    let part = part_of(&[16, 12], &[(0, range(0, 2, 1))]);
    let wrong = Tensor::zeros(&[3, 12], DType::F32, device).unwrap();
    // SAFETY: as above.
    match unsafe { load_part_into(&ckpt, "w", &part, &wrong, &options) } {
        Err(Error::Shape(m)) => assert!(
            m.contains("`w`") && m.contains("(3, 12)") && m.contains("(2, 12)"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    let read_only = Tensor::zeros(&[2, 12], DType::F32, device)
        .unwrap()
        .into_read_only();
    // SAFETY: as above.
    let e = unsafe { load_part_into(&ckpt, "w", &part, &read_only, &options) };
    assert!(matches!(e, Err(Error::ReadOnly(_))), "{e:?}");
}

#[test]
fn a_part_is_read_into_existing_memory_on_the_cpu() {
    parts_into(Device::CPU);
    many_parts_into(Device::CPU);
}

/// Several parts at once (`load_parts_into`), compact ones read by one run of the reader and the
/// others copied: each target holds its part, the bytes needed are the parts' own, progress ends
/// at the total; one bad target among them (another shape) fails the call before anything is
/// written.
fn many_parts_into(device: Device) {
    let dir = TempDir::new("many-parts-into");
    let path = part_file(&dir);
    let ckpt = Checkpoint::open(&path).unwrap();
    let cpu = LoadOptions::new(Device::CPU);
    let rows = part_of(&[16, 12], &[(0, range(4, 8, 1))]);
    let cols = part_of(&[16, 12], &[(1, range(6, 12, 1))]);
    let m_rows = part_of(&[8, 5], &[(0, range(0, 3, 1))]);
    let a = Tensor::zeros(rows.shape(), DType::F32, device).unwrap();
    let b = Tensor::zeros(cols.shape(), DType::F32, device).unwrap();
    let c = Tensor::zeros(m_rows.shape(), DType::F64, device).unwrap();
    let parts = [
        ("w", rows.clone(), &a),
        ("w", cols.clone(), &b),
        ("m", m_rows.clone(), &c),
    ];
    let options = LoadOptions {
        threads: Some(3),
        chunk_bytes: Some(16),
        ..LoadOptions::new(device)
    };
    let mut last = (0, 0);
    // SAFETY: the targets are this test's own memory, apart, used by nothing else meanwhile.
    let read =
        unsafe { ckpt.load_parts_into(&parts, &options, &mut |d, t| last = (d, t)) }.unwrap();
    assert_eq!(read, 4 * (48 + 96 + 15));
    assert_eq!(last, (read, read));
    for (name, part, dst) in &parts {
        let want = f32s(&ckpt.load_part(name, part, &cpu).unwrap());
        assert_eq!(
            f32s(&dst.cast(DType::F32).unwrap()),
            want,
            "{name} {part:?}"
        );
    }
    let fresh = Tensor::zeros(rows.shape(), DType::F32, device).unwrap();
    let wrong = Tensor::zeros(&[2, 2], DType::F32, device).unwrap();
    let bad = [("w", rows.clone(), &fresh), ("m", m_rows.clone(), &wrong)];
    // SAFETY: as above.
    let e = unsafe { ckpt.load_parts_into(&bad, &options, &mut |_, _| {}) };
    assert!(
        matches!(e, Err(Error::Shape(ref m)) if m.contains("`m`")),
        "{e:?}"
    );
    assert!(
        f32s(&fresh).iter().all(|&v| v == 0.0),
        "nothing read before the error"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_part_is_read_into_existing_memory_on_the_gpu() {
    parts_into(gpu());
    many_parts_into(gpu());
}

// ---------------------------------------------------------------------------------------------
// Folders, and files in memory

#[test]
fn a_folder_opens_as_the_checkpoint_it_holds() {
    let dir = TempDir::new("folder");
    let (one, two) = two_shards(&dir);
    // No index: every *.safetensors file, in name order.
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    assert_eq!(ckpt.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
    let shards: Vec<&Path> = ckpt.shards().iter().map(|s| s.path()).collect();
    assert_eq!(shards, [one.as_path(), two.as_path()]);
    // An index is preferred: this one leaves the second shard out.
    std::fs::write(dir.path("notes.txt"), "not a checkpoint").unwrap();
    dir.file(
        "model.safetensors.index.json",
        br#"{"metadata": {"m": "1"}, "weight_map": {"a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors"}}"#,
    );
    let ckpt = Checkpoint::open_folder(&dir.0).unwrap();
    assert_eq!(ckpt.keys().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(ckpt.metadata().unwrap()["m"], "1");
    // Another index beside it: model.safetensors.index.json still wins.
    dir.file(
        "other.safetensors.index.json",
        br#"{"weight_map": {"c": "model-00002-of-00002.safetensors"}}"#,
    );
    assert_eq!(Checkpoint::open(&dir.0).unwrap().keys().count(), 2);
    // Without it, two indexes are ambiguous; one is taken.
    std::fs::remove_file(dir.path("model.safetensors.index.json")).unwrap();
    assert_eq!(
        Checkpoint::open(&dir.0).unwrap().keys().collect::<Vec<_>>(),
        ["c"]
    );
    dir.file(
        "third.safetensors.index.json",
        br#"{"weight_map": {"c": "model-00002-of-00002.safetensors"}}"#,
    );
    match Checkpoint::open(&dir.0) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("other.safetensors.index.json"), "{m}");
            assert!(m.contains("third.safetensors.index.json"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    // A folder holding none of these says what it looked for.
    let empty = TempDir::new("empty-folder");
    std::fs::write(empty.path("README.md"), "hello").unwrap();
    match Checkpoint::open(&empty.0) {
        Err(Error::Io { path, source }) => {
            assert_eq!(path, empty.0);
            assert_eq!(source.kind(), IoKind::NotFound);
            assert!(
                source.to_string().contains("is a directory holding no"),
                "{source}"
            );
        }
        other => panic!("{other:?}"),
    }
    // A list of files still names files: a folder in it is refused.
    assert!(matches!(
        Checkpoint::open_files(&[&dir.0]),
        Err(Error::Io { source, .. }) if source.kind() == IoKind::IsADirectory
    ));
}

#[test]
fn bytes_in_memory_round_trip() {
    let a = Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0], &[2, 2]).unwrap();
    let b = Tensor::from_slice(&[7u8, 8, 9], &[3]).unwrap();
    let empty = Tensor::zeros(&[0, 3], DType::F16, Device::CPU).unwrap();
    let metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    let bytes = serialize(&[("a", &a), ("b", &b), ("e", &empty)], Some(&metadata)).unwrap();
    let (meta, tensors) = deserialize(&bytes).unwrap();
    assert_eq!(meta, Some(metadata));
    assert_eq!(
        tensors["a"].to_vec::<f32>().unwrap(),
        a.to_vec::<f32>().unwrap()
    );
    assert_eq!(tensors["b"].to_vec::<u8>().unwrap(), vec![7, 8, 9]);
    assert_eq!(tensors["e"].shape(), [0, 3]);
    assert!(!tensors["a"].is_read_only(), "memory of its own");
    let (meta, _) = deserialize(&serialize(&[("a", &a)], None).unwrap()).unwrap();
    assert_eq!(meta, None);
    assert_invalid(
        deserialize(b"PK\x03\x04 this is a zip file"),
        Path::new("<bytes>"),
        &["not a safetensors file"],
    );
}
