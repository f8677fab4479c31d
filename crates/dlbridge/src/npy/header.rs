//! The header of a NumPy `.npy` file: parsed once from bytes, validated completely, then trusted.
//!
//! Layout of a file: the magic `\x93NUMPY`, a major and a minor version byte, the header's length
//! (a little-endian `u16` in version 1.0, a `u32` in 2.0 and 3.0), the header, then the data. The
//! header is a Python dict literal, `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`,
//! in Latin-1 (UTF-8 in version 3.0), padded with spaces and ended by a newline.

use std::path::Path;

use crate::dtype::DType;
use crate::error::{Result, invalid_file};
use crate::layout::{Layout, MAX_NDIM};

/// The first six bytes of every `.npy` file.
pub const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// The largest header accepted, in bytes: `numpy.load`'s default `max_header_size`, past which it
/// refuses a header as possibly hostile (a header this long describes no array dlbridge reads).
pub const MAX_HEADER_LEN: usize = 10_000;

/// How deep the header's literal may nest (a structured dtype's fields nest; the arrays dlbridge
/// reads need two levels).
const MAX_DEPTH: usize = 16;

/// The order of the bytes of each element in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteOrder {
    /// Least significant byte first (`<`, and `=` or none on the little-endian hosts dlbridge
    /// runs on).
    Little,
    /// Most significant byte first (`>`): swapped on load.
    Big,
    /// Single-byte elements (`|`), which have no order.
    NotApplicable,
}

/// A parsed and validated `.npy` header: the array's element type, byte order, shape and memory
/// order, and where its data begins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpyHeader {
    dtype: DType,
    byte_order: ByteOrder,
    fortran_order: bool,
    shape: Vec<usize>,
    data_offset: u64,
    nbytes: u64,
}

impl NpyHeader {
    /// Parses the header at the start of `bytes` (the file's first bytes, at least through the
    /// header; the data may follow), named `path` in errors.
    ///
    /// Errors are [`Error::InvalidFile`](crate::Error::InvalidFile): no magic, an unknown version, a header past
    /// [`MAX_HEADER_LEN`] or past the end of `bytes`, a header that is not a dict of exactly
    /// `descr`, `fortran_order` and `shape`, a shape that is not a tuple of non-negative
    /// integers, more than [`MAX_NDIM`] axes, an array whose byte count overflows, and an element
    /// type dlbridge has no type for (objects, which need pickle; structured, string, date and
    /// void types; `float128`), as `numpy.load` without pickle refuses objects. A `descr` of raw void
    /// bytes is how `np.save` writes ml_dtypes' `bfloat16` and float8 arrays: it cannot be told
    /// from any other void type, and the error says so.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<NpyHeader> {
        let invalid = |reason: String| invalid_file(path, reason);
        if bytes.len() < 8 && MAGIC.starts_with(&bytes[..bytes.len().min(6)]) {
            return Err(invalid(too_short(bytes.len(), 8)));
        }
        if !bytes.starts_with(MAGIC) {
            let shown = &bytes[..bytes.len().min(8)];
            let hint = if bytes.starts_with(b"PK\x03\x04") {
                " (a ZIP archive: an .npz file is read with load_npz)"
            } else {
                ""
            };
            return Err(invalid(format!(
                "not a .npy file: it begins b\"{}\", not the magic b\"\\x93NUMPY\"{hint}",
                shown.escape_ascii()
            )));
        }
        let (major, minor) = match bytes.get(6..8) {
            Some(&[major, minor]) => (major, minor),
            _ => return Err(invalid(too_short(bytes.len(), 8))),
        };
        let len_bytes = match (major, minor) {
            (1, 0) => 2,
            (2, 0) | (3, 0) => 4,
            _ => {
                return Err(invalid(format!(
                    "format version {major}.{minor} is not one of 1.0, 2.0 and 3.0"
                )));
            }
        };
        let start = 8 + len_bytes;
        let Some(len_field) = bytes.get(8..start) else {
            return Err(invalid(too_short(bytes.len(), start)));
        };
        let header_len = len_field
            .iter()
            .rev()
            .fold(0usize, |n, &b| (n << 8) | usize::from(b));
        if header_len > MAX_HEADER_LEN {
            return Err(invalid(format!(
                "the header is {header_len} bytes, over the limit of {MAX_HEADER_LEN} \
                 (numpy.load's max_header_size)"
            )));
        }
        let end = start + header_len;
        let Some(raw) = bytes.get(start..end) else {
            return Err(invalid(format!(
                "the file ends at byte {} inside its {header_len}-byte header (truncated?)",
                bytes.len()
            )));
        };
        // Latin-1 is a byte per character; the literal's syntax is ASCII, so only its strings
        // can hold other characters, and a dtype name never does.
        let text: String = if major == 3 {
            std::str::from_utf8(raw)
                .map_err(|e| {
                    invalid(format!(
                        "the version 3.0 header is not UTF-8 (invalid byte at header offset {})",
                        e.valid_up_to()
                    ))
                })?
                .to_owned()
        } else {
            raw.iter().map(|&b| char::from(b)).collect()
        };
        let fields = parse_dict(&text).map_err(|e| invalid(format!("the header {e}")))?;
        NpyHeader::from_fields(fields, end as u64).map_err(invalid)
    }

    fn from_fields(
        fields: Vec<(Value, Value)>,
        data_offset: u64,
    ) -> std::result::Result<Self, String> {
        let invalid = |s: String| s;
        let (mut descr, mut fortran, mut shape) = (None, None, None);
        for (key, value) in fields {
            let Value::Str(key) = key else {
                return Err(invalid(format!(
                    "the header has a key that is not a string ({})",
                    key.kind()
                )));
            };
            let slot = match key.as_str() {
                "descr" => &mut descr,
                "fortran_order" => &mut fortran,
                "shape" => &mut shape,
                other => {
                    return Err(invalid(format!(
                        "the header has the key {other:?}: a .npy header has exactly 'descr', \
                         'fortran_order' and 'shape'"
                    )));
                }
            };
            if slot.replace(value).is_some() {
                return Err(invalid(format!("the header gives the key {key:?} twice")));
            }
        }
        let missing = |key: &str| invalid(format!("the header has no {key:?} key"));
        let descr = descr.ok_or_else(|| missing("descr"))?;
        let fortran_order = match fortran.ok_or_else(|| missing("fortran_order"))? {
            Value::Bool(b) => b,
            other => {
                return Err(invalid(format!(
                    "'fortran_order' is {}, not True or False",
                    other.kind()
                )));
            }
        };
        let shape = match shape.ok_or_else(|| missing("shape"))? {
            Value::Tuple(items) => items,
            other => return Err(invalid(format!("'shape' is {}, not a tuple", other.kind()))),
        };
        if shape.len() > MAX_NDIM {
            return Err(invalid(format!(
                "'shape' has {} axes, more than the {MAX_NDIM} dlbridge holds",
                shape.len()
            )));
        }
        let shape: Vec<usize> = shape
            .into_iter()
            .enumerate()
            .map(|(axis, v)| match v {
                Value::Int(n) if n >= 0 && n <= isize::MAX as i128 => Ok(n as usize),
                other => Err(invalid(format!(
                    "axis {axis} of 'shape' is {}, not a non-negative integer up to {}",
                    other.describe(),
                    isize::MAX
                ))),
            })
            .collect::<std::result::Result<_, _>>()?;
        let (dtype, byte_order) = match descr {
            Value::Str(s) => parse_descr(&s)?,
            Value::List(_) => {
                return Err(
                    "'descr' is a structured dtype (a list of fields), which dlbridge has no \
                     type for"
                        .into(),
                );
            }
            other => {
                return Err(invalid(format!(
                    "'descr' is {}, not a string",
                    other.kind()
                )));
            }
        };
        let numel = shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .ok_or_else(|| invalid(format!("the shape {shape:?} overflows")))?;
        let nbytes = numel
            .checked_mul(dtype.itemsize() as u64)
            .filter(|&n| n <= isize::MAX as u64)
            .ok_or_else(|| {
                invalid(format!(
                    "an array of shape {shape:?} of {dtype} overflows memory"
                ))
            })?;
        Ok(NpyHeader {
            dtype,
            byte_order,
            fortran_order,
            shape,
            data_offset,
            nbytes,
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The order of each element's bytes in the file.
    pub fn byte_order(&self) -> ByteOrder {
        self.byte_order
    }

    /// Whether the data is in column-major (Fortran) order.
    pub fn fortran_order(&self) -> bool {
        self.fortran_order
    }

    /// Extents (empty for a 0-d array).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Where the data begins, counted from the file's (or the `.npz` member's) first byte.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Length of the data: the element count times the item size.
    pub fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// The array's layout over its data (byte offset 0): row-major, or column-major strides for
    /// a Fortran-ordered array.
    pub fn layout(&self) -> Result<Layout> {
        if !self.fortran_order {
            return Layout::contiguous(&self.shape);
        }
        let mut strides = Vec::with_capacity(self.shape.len());
        let mut stride = 1usize;
        for &n in &self.shape {
            strides.push(stride as isize);
            // Bounded by the element count, which fits (checked when parsing).
            stride = stride.saturating_mul(n.max(1));
        }
        Layout::new(&self.shape, &strides, 0)
    }
}

/// The element type and byte order a `descr` string names (`'<f4'`, `'|b1'`, `'>i8'`, ...).
fn parse_descr(descr: &str) -> std::result::Result<(DType, ByteOrder), String> {
    let unsupported =
        |what: &str| format!("descr {descr:?} is {what}, which dlbridge has no type for");
    let (order, rest) = match descr.as_bytes().first() {
        Some(b'<') => (Some(ByteOrder::Little), &descr[1..]),
        Some(b'>') => (Some(ByteOrder::Big), &descr[1..]),
        Some(b'|') => (None, &descr[1..]),
        // Native order: little on every host dlbridge builds for.
        Some(b'=') => (Some(ByteOrder::Little), &descr[1..]),
        _ => (Some(ByteOrder::Little), descr),
    };
    let mut chars = rest.chars();
    let kind = chars.next().unwrap_or(' ');
    let size: Option<usize> = chars.as_str().parse().ok();
    let dtype = match (kind, size) {
        ('b', Some(1)) => DType::BOOL,
        ('i', Some(1)) => DType::I8,
        ('i', Some(2)) => DType::I16,
        ('i', Some(4)) => DType::I32,
        ('i', Some(8)) => DType::I64,
        ('u', Some(1)) => DType::U8,
        ('u', Some(2)) => DType::U16,
        ('u', Some(4)) => DType::U32,
        ('u', Some(8)) => DType::U64,
        ('f', Some(2)) => DType::F16,
        ('f', Some(4)) => DType::F32,
        ('f', Some(8)) => DType::F64,
        ('c', Some(8)) => DType::C64,
        ('c', Some(16)) => DType::C128,
        ('f', Some(_)) | ('c', Some(_)) => return Err(unsupported("an extended-precision float")),
        ('O', _) => {
            return Err(format!(
                "descr {descr:?} is Python objects, which only pickle can read (numpy.load \
                 refuses them too without allow_pickle=True)"
            ));
        }
        ('V', _) => {
            return Err(format!(
                "descr {descr:?} is raw void bytes, which dlbridge has no type for; np.save \
                 writes ml_dtypes' bfloat16 and float8 arrays so, and they cannot be told from \
                 other void data: save them with dlbridge.save_file (safetensors) instead"
            ));
        }
        ('S' | 'a' | 'U', _) => return Err(unsupported("a string type")),
        ('M' | 'm', _) => return Err(unsupported("a date or time type")),
        _ => {
            return Err(format!(
                "descr {descr:?} is not a NumPy type string (such as '<f4')"
            ));
        }
    };
    let order = match order {
        _ if dtype.itemsize() == 1 => ByteOrder::NotApplicable,
        Some(order) => order,
        // '|' on a multi-byte type: numpy writes '<' or '>' there, never '|'.
        None => {
            return Err(format!(
                "descr {descr:?} gives no byte order for {}-byte elements",
                dtype.itemsize()
            ));
        }
    };
    Ok((dtype, order))
}

/// A value of the header's Python literal.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::Str(_) => "a string",
            Value::Int(_) => "an integer",
            Value::Bool(_) => "a boolean",
            Value::None => "None",
            Value::Tuple(_) => "a tuple",
            Value::List(_) => "a list",
            Value::Dict(_) => "a dict",
        }
    }

    fn describe(&self) -> String {
        match self {
            Value::Int(n) => n.to_string(),
            other => other.kind().to_owned(),
        }
    }
}

/// The fields of the dict literal `text` holds (after optional whitespace, and nothing but
/// whitespace after it), or why it is not one.
fn parse_dict(text: &str) -> std::result::Result<Vec<(Value, Value)>, String> {
    let mut parser = Parser {
        bytes: text.as_bytes(),
        text,
        at: 0,
    };
    let value = parser.value(0)?;
    parser.skip_space();
    if parser.at != parser.bytes.len() {
        return Err(format!(
            "has more after its literal, at header offset {}",
            parser.at
        ));
    }
    match value {
        Value::Dict(fields) => Ok(fields),
        other => Err(format!("is {}, not a dict", other.kind())),
    }
}

/// A recursive-descent reader of the Python literals `.npy` headers are made of: dicts, tuples,
/// lists, strings, integers, `True`, `False` and `None`, nested at most [`MAX_DEPTH`] deep.
struct Parser<'a> {
    bytes: &'a [u8],
    text: &'a str,
    at: usize,
}

impl Parser<'_> {
    fn skip_space(&mut self) {
        while self
            .bytes
            .get(self.at)
            .is_some_and(|b| b.is_ascii_whitespace())
        {
            self.at += 1;
        }
    }

    fn error<T>(&self, what: &str) -> std::result::Result<T, String> {
        Err(format!(
            "is not a Python literal: {what} at header offset {}",
            self.at
        ))
    }

    fn value(&mut self, depth: usize) -> std::result::Result<Value, String> {
        if depth > MAX_DEPTH {
            return self.error(&format!("nesting deeper than {MAX_DEPTH}"));
        }
        self.skip_space();
        match self.bytes.get(self.at) {
            None => self.error("the end"),
            Some(b'{') => {
                self.at += 1;
                let mut fields = Vec::new();
                self.items(b'}', |p| {
                    let key = p.value(depth + 1)?;
                    p.skip_space();
                    if p.bytes.get(p.at) != Some(&b':') {
                        return p.error("no ':' after a key");
                    }
                    p.at += 1;
                    fields.push((key, p.value(depth + 1)?));
                    Ok(())
                })?;
                Ok(Value::Dict(fields))
            }
            Some(&open @ (b'(' | b'[')) => {
                self.at += 1;
                let close = if open == b'(' { b')' } else { b']' };
                let mut items = Vec::new();
                let commas = self.items(close, |p| {
                    items.push(p.value(depth + 1)?);
                    Ok(())
                })?;
                if open == b'[' {
                    Ok(Value::List(items))
                } else if items.len() == 1 && commas == 0 {
                    // `(x)` is `x`; `(x,)` is a tuple.
                    Ok(items.pop().unwrap_or(Value::None))
                } else {
                    Ok(Value::Tuple(items))
                }
            }
            Some(&quote @ (b'\'' | b'"')) => self.string(quote),
            Some(b) if b.is_ascii_digit() || *b == b'-' || *b == b'+' => self.integer(),
            Some(_) => {
                for (word, value) in [
                    ("True", Value::Bool(true)),
                    ("False", Value::Bool(false)),
                    ("None", Value::None),
                ] {
                    if self.bytes[self.at..].starts_with(word.as_bytes())
                        && !self
                            .bytes
                            .get(self.at + word.len())
                            .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
                    {
                        self.at += word.len();
                        return Ok(value);
                    }
                }
                self.error("an unexpected character")
            }
        }
    }

    /// Items separated by commas up to `close` (a trailing comma allowed), each read by `item`;
    /// the number of commas.
    fn items(
        &mut self,
        close: u8,
        mut item: impl FnMut(&mut Self) -> std::result::Result<(), String>,
    ) -> std::result::Result<usize, String> {
        let mut commas = 0;
        loop {
            self.skip_space();
            if self.bytes.get(self.at) == Some(&close) {
                self.at += 1;
                return Ok(commas);
            }
            item(self)?;
            self.skip_space();
            match self.bytes.get(self.at) {
                Some(b',') => {
                    self.at += 1;
                    commas += 1;
                }
                Some(&b) if b == close => {}
                _ => return self.error("no ',' between items"),
            }
        }
    }

    fn string(&mut self, quote: u8) -> std::result::Result<Value, String> {
        self.at += 1;
        let mut out = String::new();
        loop {
            let Some(c) = self.text[self.at..].chars().next() else {
                return self.error("an unterminated string");
            };
            self.at += c.len_utf8();
            match c {
                _ if c as u32 == u32::from(quote) => return Ok(Value::Str(out)),
                '\\' => {
                    let Some(escaped) = self.text[self.at..].chars().next() else {
                        return self.error("an unterminated string");
                    };
                    self.at += escaped.len_utf8();
                    match escaped {
                        '\\' | '\'' | '"' => out.push(escaped),
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        // Other escapes never occur in a dtype name: kept as written.
                        other => {
                            out.push('\\');
                            out.push(other);
                        }
                    }
                }
                '\n' => return self.error("a newline inside a string"),
                c => out.push(c),
            }
        }
    }

    fn integer(&mut self) -> std::result::Result<Value, String> {
        let start = self.at;
        if matches!(self.bytes.get(self.at), Some(b'-' | b'+')) {
            self.at += 1;
        }
        let digits = self.at;
        while self.bytes.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        if self.at == digits {
            return self.error("a sign without digits");
        }
        let text = &self.text[start..self.at];
        // Python 2's long suffix, which version 1.0 headers written by it carry (`(3L, 4L)`).
        if matches!(self.bytes.get(self.at), Some(b'L' | b'l')) {
            self.at += 1;
        }
        // Past i128's range is past any extent too.
        let n = text.parse::<i128>().unwrap_or(i128::MAX);
        Ok(Value::Int(n))
    }
}

fn too_short(len: usize, needed: usize) -> String {
    format!("the file is {len} bytes, shorter than the {needed} bytes of the magic and version")
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::error::Error;

    /// A version-1.0 file's bytes around `dict` (padded as numpy pads), then `data`.
    pub(in crate::npy) fn npy(dict: &str, data: &[u8]) -> Vec<u8> {
        let mut header = dict.to_owned();
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&[1, 0]);
        bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        bytes
    }

    fn parse(bytes: &[u8]) -> Result<NpyHeader> {
        NpyHeader::parse(bytes, Path::new("t.npy"))
    }

    fn reason(bytes: &[u8]) -> String {
        parse(bytes).unwrap_err().to_string()
    }

    #[test]
    fn numpy_s_headers_parse() {
        let bytes = npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            &[0; 24],
        );
        let h = parse(&bytes).unwrap();
        assert_eq!(
            (h.dtype(), h.byte_order(), h.fortran_order(), h.shape()),
            (DType::F32, ByteOrder::Little, false, &[2usize, 3][..])
        );
        assert_eq!((h.data_offset(), h.nbytes()), (bytes.len() as u64 - 24, 24));
        assert_eq!(h.data_offset() % 64, 0);
        assert_eq!(h.layout().unwrap().strides(), [3, 1]);
        let f = parse(&npy(
            "{'descr': '>i8', 'fortran_order': True, 'shape': (2, 3, 4), }",
            &[],
        ))
        .unwrap();
        assert_eq!((f.dtype(), f.byte_order()), (DType::I64, ByteOrder::Big));
        assert_eq!(f.layout().unwrap().strides(), [1, 2, 6]);
        for (dict, shape) in [
            (
                "{'descr': '|b1', 'fortran_order': False, 'shape': (), }",
                vec![],
            ),
            (
                "{'shape': (5,), 'fortran_order': False, 'descr': '|u1'}",
                vec![5],
            ),
            (
                "{\"descr\": \"<c16\", \"fortran_order\": False, \"shape\": (0, 7)}",
                vec![0, 7],
            ),
            (
                "{'descr': '<f2', 'fortran_order': False, 'shape': (3L, 4L), }",
                vec![3, 4],
            ),
            (
                "{'descr': 'f8', 'fortran_order': False, 'shape': (1,) }",
                vec![1],
            ),
        ] {
            let h = parse(&npy(dict, &[])).unwrap();
            assert_eq!(h.shape(), &shape[..], "{dict}");
        }
        // One-byte types have no byte order, whatever the descr says.
        let b = parse(&npy(
            "{'descr': '>u1', 'fortran_order': False, 'shape': (1,)}",
            &[],
        ));
        assert_eq!(b.unwrap().byte_order(), ByteOrder::NotApplicable);
    }

    #[test]
    fn versions_two_and_three() {
        let dict = "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }\n";
        for major in [2u8, 3] {
            let mut bytes = MAGIC.to_vec();
            bytes.extend_from_slice(&[major, 0]);
            bytes.extend_from_slice(&(dict.len() as u32).to_le_bytes());
            bytes.extend_from_slice(dict.as_bytes());
            let h = parse(&bytes).unwrap();
            assert_eq!(h.data_offset(), 12 + dict.len() as u64);
            assert_eq!(h.dtype(), DType::I32);
        }
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&[3, 0, 2, 0, 0, 0, b'\xff', b' ']);
        assert!(reason(&bytes).contains("not UTF-8"), "{}", reason(&bytes));
    }

    #[test]
    fn malformed_headers_are_errors() {
        let cases: [(Vec<u8>, &str); 18] = [
            (b"".to_vec(), "shorter"),
            (b"PK\x03\x04".to_vec(), "read with load_npz"),
            (b"\x93NUMPY".to_vec(), "shorter"),
            (b"\x93NUMPY\x04\x00\x00\x00".to_vec(), "version 4.0"),
            (b"\x93NUMPY\x01\x00\x10".to_vec(), "shorter"),
            (b"\x93NUMPY\x01\x00\x40\x00{'descr'".to_vec(), "truncated"),
            (
                b"\x93NUMPY\x02\x00\xff\xff\xff\xff".to_vec(),
                "over the limit",
            ),
            (
                npy("{'descr': '<f4', 'fortran_order': False}", &[]),
                "no \"shape\"",
            ),
            (
                npy("{'descr': '<f4', 'fortran_order': 0, 'shape': ()}", &[]),
                "not True or False",
            ),
            (
                npy(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': [2]}",
                    &[],
                ),
                "not a tuple",
            ),
            (
                npy(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}",
                    &[],
                ),
                "non-negative",
            ),
            (
                npy(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999999999999999999999,)}",
                    &[],
                ),
                "non-negative",
            ),
            (
                npy(
                    "{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904, 4)}",
                    &[],
                ),
                "overflow",
            ),
            (
                npy(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (), 'x': 1}",
                    &[],
                ),
                "has the key \"x\"",
            ),
            (
                npy(
                    "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': ()}",
                    &[],
                ),
                "twice",
            ),
            (
                npy(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': ()} x",
                    &[],
                ),
                "more after",
            ),
            (
                npy("{'descr': 'q9', 'fortran_order': False, 'shape': ()}", &[]),
                "not a NumPy type",
            ),
            (
                npy(
                    &format!(
                        "{{'descr': '<f4', 'fortran_order': False, 'shape': {}}}",
                        "(".repeat(40)
                    ),
                    &[],
                ),
                "nesting",
            ),
        ];
        for (bytes, expected) in cases {
            let e = reason(&bytes);
            assert!(e.contains(expected), "{expected:?} in {e:?}");
        }
        let many = format!(
            "{{'descr': '<f4', 'fortran_order': False, 'shape': ({})}}",
            "1,".repeat(MAX_NDIM + 1)
        );
        assert!(reason(&npy(&many, &[])).contains("axes"));
    }

    #[test]
    fn types_without_a_dlbridge_type_are_refused_as_such() {
        for (descr, expected) in [
            ("'|O'", "pickle"),
            ("'<V2'", "ml_dtypes"),
            ("'<U3'", "string"),
            ("'|S4'", "string"),
            ("'<M8[ns]'", "date"),
            ("'<f16'", "extended"),
            ("[('a', '<f4'), ('b', '<i4')]", "structured"),
        ] {
            let dict = format!("{{'descr': {descr}, 'fortran_order': False, 'shape': (2,)}}");
            let e = parse(&npy(&dict, &[])).unwrap_err();
            assert!(matches!(e, Error::InvalidFile { .. }), "{descr}: {e}");
            assert!(e.to_string().contains(expected), "{descr}: {e}");
        }
    }

    /// Every prefix of a valid file, and every single-byte change of its header, gives a
    /// header or an error, never a panic.
    #[test]
    fn prefixes_and_byte_flips_never_panic() {
        let bytes = npy(
            "{'descr': '<c8', 'fortran_order': True, 'shape': (3, 2), }",
            &[0; 48],
        );
        for end in 0..bytes.len() {
            let _ = parse(&bytes[..end]);
        }
        for i in 0..64 {
            for b in [0u8, b'(', b')', b'\'', b'\\', 0xff, b'9', b','] {
                let mut changed = bytes.clone();
                changed[i] = b;
                let _ = parse(&changed);
            }
        }
    }
}
