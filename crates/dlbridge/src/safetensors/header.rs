//! The header of a safetensors file: parsed once from bytes (no file is opened here), validated
//! completely, then trusted.
//!
//! Layout of a file: an 8-byte little-endian `u64` N, N bytes of UTF-8 JSON, then the data
//! section. The JSON is an object: an optional `"__metadata__"` object of strings, and for each
//! tensor `{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}`, offsets relative to the
//! start of the data section.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::Path;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use crate::dtype::DType;
use crate::error::{Error, Result, invalid_file};
use crate::layout::MAX_NDIM;

use super::dtype::dtype_from_name;

/// The largest header accepted, in bytes (the reference implementation's limit): a larger length
/// prefix is taken for a corrupt or hostile file, not allocated.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Bytes of the length prefix before the JSON header.
pub const PREFIX_LEN: u64 = 8;

/// The key of the free-form string metadata in the header.
pub const METADATA_KEY: &str = "__metadata__";

/// One tensor's entry in a header: dtype, shape and where its bytes lie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    dtype: DType,
    shape: Vec<usize>,
    numel: usize,
    data_offsets: Range<u64>,
    data_start: u64,
}

impl TensorInfo {
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Extents (empty for a 0-d tensor).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements (1 for a 0-d tensor).
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Whether elements are narrower than a byte and stored densely packed (`F4`, `F6_*`).
    pub fn is_packed(&self) -> bool {
        self.dtype.is_sub_byte()
    }

    /// The tensor's bytes as the header gives them: relative to the start of the data section.
    pub fn data_offsets(&self) -> Range<u64> {
        self.data_offsets.clone()
    }

    /// The tensor's bytes as absolute offsets in the file (what a reader seeks to).
    pub fn byte_range(&self) -> Range<u64> {
        // Both ends lie inside the file (checked when parsing), so the sums cannot overflow.
        self.data_start + self.data_offsets.start..self.data_start + self.data_offsets.end
    }

    /// Length of the tensor's bytes.
    pub fn nbytes(&self) -> u64 {
        self.data_offsets.end - self.data_offsets.start
    }
}

/// A parsed and validated safetensors header.
///
/// The tensors tile the data section: sorted by their byte ranges, each begins where the one
/// before it ends, the first at byte 0 and the last at the end of the file, so every byte of the
/// file belongs to the header or to exactly one tensor (the `safetensors` package's rule: a hole
/// or trailing bytes could carry a second format). Each tensor's length is its dtype's size
/// times its element count, and every name appears once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    metadata: Option<BTreeMap<String, String>>,
    tensors: BTreeMap<String, TensorInfo>,
    header_len: u64,
    file_len: u64,
}

impl Header {
    /// Parses the header at the start of `bytes` (the file's first `8 + N` bytes or more) of a
    /// file `file_len` bytes long, named `path` in errors.
    ///
    /// Errors are [`Error::InvalidFile`]: a length prefix past [`MAX_HEADER_LEN`] or the end of the
    /// file, a header that is not UTF-8 or not a JSON object (said as "not a safetensors file"
    /// where the bytes cannot be one), duplicate names or keys, an unknown dtype, any tensor
    /// whose bytes fall outside the data section or differ in length from its dtype and shape,
    /// and tensors that do not tile the data section (an overlap, a hole, trailing bytes).
    ///
    /// The verdict is the `safetensors` package's on every file but two kinds, which dlbridge
    /// refuses where it accepts: a name or key given twice (it keeps the last), and a tensor that
    /// dlbridge cannot hold (more than [`MAX_NDIM`] axes, an extent past `isize::MAX`).
    pub fn parse(bytes: &[u8], file_len: u64, path: &Path) -> Result<Header> {
        let invalid = |reason: String| invalid_file(path, reason);
        let header_len = header_len(bytes, file_len, path)?;
        // `header_len` <= MAX_HEADER_LEN, so the end fits in usize on any target that maps it.
        let end = (PREFIX_LEN + header_len) as usize;
        let Some(json) = bytes.get(PREFIX_LEN as usize..end) else {
            return Err(invalid(format!(
                "the header needs {end} bytes but only {} were given",
                bytes.len()
            )));
        };
        if json.trim_ascii_start().first() != Some(&b'{') {
            return Err(not_safetensors(
                path,
                format!(
                    "its {header_len}-byte header does not begin with `{{` (it begins {})",
                    quoted(json)
                ),
            ));
        }
        let text = std::str::from_utf8(json).map_err(|e| {
            invalid(format!(
                "the header is not UTF-8 (invalid byte at header offset {})",
                e.valid_up_to()
            ))
        })?;
        let value = parse_strict_json(text)
            .map_err(|e| invalid(format!("the header is not valid JSON: {e}")))?;
        let Value::Object(entries) = value else {
            // Not reached: JSON text that begins with `{` is an object or no JSON at all.
            return Err(not_safetensors(
                path,
                "the header is not a JSON object".into(),
            ));
        };
        let data_start = PREFIX_LEN + header_len;
        let data_len = file_len - data_start;
        let mut metadata = None;
        let mut tensors = BTreeMap::new();
        for (name, entry) in entries {
            if name == METADATA_KEY {
                metadata = parse_metadata(entry).map_err(invalid)?;
                continue;
            }
            let info = parse_tensor(entry, data_start, data_len)
                .map_err(|reason| invalid(format!("tensor `{name}`: {reason}")))?;
            tensors.insert(name, info);
        }
        check_tiling(&tensors, data_len).map_err(invalid)?;
        Ok(Header {
            metadata,
            tensors,
            header_len,
            file_len,
        })
    }

    /// The free-form string metadata (`"__metadata__"`); `None` when the header has none (or
    /// `null`), as the `safetensors` package says it.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.metadata.as_ref()
    }

    /// The tensors by name, in name order.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// One tensor's entry.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The tensor names, in name order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// N: the JSON header's length in bytes (padding included).
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// Absolute file offset of the data section (`8 + N`).
    pub fn data_start(&self) -> u64 {
        PREFIX_LEN + self.header_len
    }

    /// The file length the header was validated against.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }
}

/// The JSON header's length N from the prefix, checked against the cap and the file length.
pub(super) fn header_len(bytes: &[u8], file_len: u64, path: &Path) -> Result<u64> {
    if file_len < PREFIX_LEN {
        return Err(too_short(path, file_len));
    }
    let Some(prefix) = bytes.first_chunk::<{ PREFIX_LEN as usize }>() else {
        return Err(too_short(path, bytes.len() as u64));
    };
    let header_len = u64::from_le_bytes(*prefix);
    if header_len > MAX_HEADER_LEN {
        let kind = known_format(bytes).map_or(String::new(), |kind| format!(", {kind}"));
        return Err(not_safetensors(
            path,
            format!(
                "it begins {}{kind}, where a safetensors file begins with its header's length \
                 (these bytes read as {header_len}, over the format's limit of {MAX_HEADER_LEN})",
                quoted(prefix)
            ),
        ));
    }
    if header_len > file_len - PREFIX_LEN {
        return Err(invalid_file(
            path,
            format!(
                "header length {header_len} runs past the end of the file ({} bytes after the \
                 length prefix)",
                file_len - PREFIX_LEN
            ),
        ));
    }
    Ok(header_len)
}

/// The string map under `"__metadata__"` (`null` counts as none).
fn parse_metadata(entry: Value) -> std::result::Result<Option<BTreeMap<String, String>>, String> {
    match entry {
        Value::Null => Ok(None),
        Value::Object(map) => map
            .into_iter()
            .map(|(key, value)| match value {
                Value::String(text) => Ok((key, text)),
                other => Err(format!(
                    "metadata value of `{key}` is {}, not a string",
                    json_kind(&other)
                )),
            })
            .collect::<std::result::Result<_, _>>()
            .map(Some),
        other => Err(format!(
            "`{METADATA_KEY}` is {}, not an object of strings",
            json_kind(&other)
        )),
    }
}

/// One tensor's entry, validated against the data section `data_len` bytes long.
fn parse_tensor(
    entry: Value,
    data_start: u64,
    data_len: u64,
) -> std::result::Result<TensorInfo, String> {
    let Value::Object(mut fields) = entry else {
        return Err(format!("the entry is {}, not an object", json_kind(&entry)));
    };
    let dtype_name = match take(&mut fields, "dtype")? {
        Value::String(text) => text,
        other => return Err(format!("`dtype` is {}, not a string", json_kind(&other))),
    };
    let dtype = dtype_from_name(&dtype_name).ok_or_else(|| {
        format!(
            "unknown dtype `{dtype_name}` (known: {})",
            super::dtype::dtype_names().collect::<Vec<_>>().join(", ")
        )
    })?;
    let shape = integers(take(&mut fields, "shape")?, "shape")?
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| format!("extent {d} does not fit in usize")))
        .collect::<std::result::Result<Vec<usize>, String>>()?;
    if shape.len() > MAX_NDIM {
        return Err(format!(
            "{} axes; dlbridge holds at most {MAX_NDIM}",
            shape.len()
        ));
    }
    let offsets = integers(take(&mut fields, "data_offsets")?, "data_offsets")?;
    let &[begin, end] = offsets.as_slice() else {
        return Err(format!(
            "`data_offsets` has {} values, not 2",
            offsets.len()
        ));
    };
    if begin > end {
        return Err(format!(
            "data_offsets [{begin}, {end}] end before they begin"
        ));
    }
    if end > data_len {
        return Err(format!(
            "data_offsets [{begin}, {end}] lie outside the data section of {data_len} bytes"
        ));
    }
    // The running product must fit in isize at every step, as a `Layout` requires.
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| {
            acc.checked_mul(d)
                .filter(|&n| d <= isize::MAX as usize && n <= isize::MAX as usize)
        })
        .ok_or_else(|| format!("the element count of shape {shape:?} overflows"))?;
    let expected = numel as u128 * u128::from(dtype.bits());
    if expected % 8 != 0 {
        return Err(format!(
            "shape {shape:?} of {dtype_name} does not fill whole bytes ({expected} bits)"
        ));
    }
    let expected = expected / 8;
    if u128::from(end - begin) != expected {
        return Err(format!(
            "data_offsets [{begin}, {end}] hold {} bytes but shape {shape:?} of {dtype_name} \
             needs {expected}",
            end - begin
        ));
    }
    Ok(TensorInfo {
        dtype,
        shape,
        numel,
        data_offsets: begin..end,
        data_start,
    })
}

/// A required field of a tensor entry (unknown fields are ignored, as other readers do).
fn take(fields: &mut Map<String, Value>, key: &str) -> std::result::Result<Value, String> {
    fields
        .remove(key)
        .ok_or_else(|| format!("the entry has no `{key}`"))
}

/// An array of non-negative integers.
fn integers(value: Value, what: &str) -> std::result::Result<Vec<u64>, String> {
    let Value::Array(items) = value else {
        return Err(format!("`{what}` is {}, not an array", json_kind(&value)));
    };
    items
        .iter()
        .map(|item| {
            item.as_u64()
                .ok_or_else(|| format!("`{what}` holds {item}, not a non-negative integer"))
        })
        .collect()
}

/// Fails unless the tensors tile the data section of `data_len` bytes: sorted by their byte
/// ranges, each begins where the one before it ended, the first at 0, and the last ends at
/// `data_len` (an empty tensor lies where one ends and the next begins). Every end is inside the
/// section already.
fn check_tiling(
    tensors: &BTreeMap<String, TensorInfo>,
    data_len: u64,
) -> std::result::Result<(), String> {
    let mut spans: Vec<(&Range<u64>, &str)> = tensors
        .iter()
        .map(|(name, info)| (&info.data_offsets, name.as_str()))
        .collect();
    spans.sort_by_key(|&(range, name)| (range.start, range.end, name));
    let mut end = 0;
    let mut before: Option<(&Range<u64>, &str)> = None;
    for (range, name) in spans {
        let span = |(r, n): (&Range<u64>, &str)| format!("`{n}` [{}, {}]", r.start, r.end);
        if range.start < end {
            // `before` is set: only a tensor that ends past 0 moves `end`.
            let other = before.map_or_else(String::new, span);
            return Err(format!(
                "tensor {} begins inside {other}: tensors may not overlap",
                span((range, name))
            ));
        }
        if range.start > end {
            let after = before.map_or_else(|| "the start of the data section".into(), span);
            return Err(format!(
                "bytes [{end}, {}) of the data section, between {after} and {}, belong to no \
                 tensor: the format allows no gaps between tensors",
                range.start,
                span((range, name))
            ));
        }
        end = range.end;
        before = Some((range, name));
    }
    if end != data_len {
        return Err(format!(
            "the data section is {data_len} bytes but its tensors end at byte {end}: the format \
             allows no bytes after the last tensor"
        ));
    }
    Ok(())
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(super) fn too_short(path: &Path, len: u64) -> Error {
    not_safetensors(
        path,
        format!("{len} bytes is shorter than the {PREFIX_LEN}-byte header length prefix"),
    )
}

/// The [`Error::InvalidFile`] of bytes that cannot be a safetensors file at all.
fn not_safetensors(path: &Path, reason: String) -> Error {
    invalid_file(path, format!("not a safetensors file: {reason}"))
}

/// Up to the first 8 of `bytes` as a Rust byte string (`b"PK\x03\x04..."`), for errors.
fn quoted(bytes: &[u8]) -> String {
    let shown = &bytes[..bytes.len().min(8)];
    let more = if bytes.len() > shown.len() { "..." } else { "" };
    format!("b\"{}{more}\"", shown.escape_ascii())
}

/// What a file whose first bytes are `bytes` likely is, where they are the signature of a format
/// checkpoints are commonly kept in.
fn known_format(bytes: &[u8]) -> Option<&'static str> {
    const SIGNATURES: [(&[u8], &str); 5] = [
        (b"PK\x03\x04", "a ZIP archive (as `torch.save` writes)"),
        (b"\x80", "a Python pickle (as older `torch.save` writes)"),
        (b"GGUF", "a GGUF file"),
        (b"\x93NUMPY", "a NumPy .npy file"),
        (b"\x89HDF", "an HDF5 file"),
    ];
    SIGNATURES
        .iter()
        .find(|(magic, _)| bytes.starts_with(magic))
        .map(|&(_, kind)| kind)
}

/// Parses JSON text, rejecting duplicate object keys at any depth.
pub(super) fn parse_strict_json(text: &str) -> serde_json::Result<Value> {
    serde_json::from_str::<Strict>(text).map(|Strict(value)| value)
}

/// A JSON value read with duplicate object keys rejected, at every depth (`serde_json`'s own
/// maps keep the last of two equal keys silently). Nesting depth is bounded by `serde_json`'s
/// recursion limit.
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate key `{key}`")));
            }
            let Strict(value) = map.next_value()?;
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}
