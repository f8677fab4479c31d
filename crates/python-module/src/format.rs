//! `repr` and `str` of `dlbridge.Array` as NumPy prints its arrays (`numpy/_core/arrayprint.py`,
//! NumPy 2.x, `legacy=False`), with NumPy's current print options: each float type in its own
//! shortest digits (a `float32` 0.1 prints `0.1`), rows wrapped at `linewidth`, arrays of more
//! than `threshold` elements summarised to `edgeitems` per edge with `...` (only those elements
//! are copied from a device), and `repr`'s extras: `shape=` where NumPy gives it, `dtype=` unless
//! NumPy's defaults imply it (`float64`, `int64`, `bool`, `complex128`), and `device='cuda:0'`
//! for arrays off the CPU:
//!
//! ```text
//! Array([[0.1, 0.2],
//!        [0.3, 0.4]], dtype=float32, device='cuda:0')
//! ```
//!
//! `bfloat16` and the minifloats print with the same rules in their own shortest digits (NumPy
//! with `ml_dtypes` prints their scalars' `repr` instead).

use dlbridge::{DType, DTypeCode, Device, Layout, Tensor};
use pyo3::prelude::*;

use crate::errors::IntoPyResult;
use crate::npcompat::PrintOptions;

/// How trailing zeros are trimmed (NumPy's `trim`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Trim {
    /// `'k'`: keep them and the point.
    Keep,
    /// `'.'`: drop them, keep the point.
    Point,
    /// `'0'`: drop them but one.
    Zero,
    /// `'-'`: drop them and the point.
    Minus,
}

/// A float type, for its shortest digits and its precision.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct FloatKind(DType);

impl FloatKind {
    /// `v` (exactly a value of this type) rounded into the type and back.
    fn round(self, v: f64) -> f64 {
        match self.0 {
            DType::F64 => v,
            DType::F32 => v as f32 as f64,
            DType::F16 => half::f16::from_f64(v).to_f64(),
            DType::BF16 => half::bf16::from_f64(v).to_f64(),
            d => dlbridge::dtype::f64_to_minifloat(d, v)
                .and_then(|c| dlbridge::dtype::minifloat_to_f64(d, c))
                .unwrap_or(f64::NAN),
        }
    }

    /// NumPy's `finfo(dtype).precision`: the decimal digits the type holds.
    fn precision(self) -> i32 {
        match self.0 {
            DType::F64 => 15,
            DType::F32 => 6,
            DType::F16 => 3,
            DType::BF16 => 2,
            _ => 1,
        }
    }
}

/// A decimal: `digits[0].digits[1..] × 10^exp` (`digits` is `[0]` for zero).
struct Decimal {
    digits: Vec<u8>,
    exp: i32,
}

/// Parses Rust's `{:e}` form (`1.2345e-7`, `-0e0`) of a non-negative value.
fn parse_sci(s: &str) -> Decimal {
    let (mantissa, exp) = s.split_once('e').unwrap_or((s, "0"));
    let digits: Vec<u8> = mantissa
        .bytes()
        .filter(u8::is_ascii_digit)
        .map(|b| b - b'0')
        .collect();
    Decimal {
        digits,
        exp: exp.parse().unwrap_or(0),
    }
}

/// The shortest digits that identify `|v|` among the values of `kind` (Dragon4's `unique`).
fn shortest(v: f64, kind: FloatKind) -> Decimal {
    let a = v.abs();
    let s = match kind.0 {
        DType::F64 => format!("{a:e}"),
        DType::F32 => format!("{:e}", a as f32),
        _ => {
            // The narrow types: the fewest significant digits that round back to the value.
            (0..17)
                .map(|p| format!("{a:.p$e}"))
                .find(|s| s.parse::<f64>().is_ok_and(|c| kind.round(c) == a))
                .unwrap_or_else(|| format!("{a:e}"))
        }
    };
    let mut d = parse_sci(&s);
    while d.digits.len() > 1 && d.digits.last() == Some(&0) {
        d.digits.pop();
    }
    d
}

/// `|v|` rounded to `frac` digits after the point (exact, ties to even): integer and fraction
/// digits.
fn exact_positional(v: f64, frac: usize) -> (String, String) {
    let s = format!("{:.frac$}", v.abs());
    match s.split_once('.') {
        Some((i, f)) => (i.to_string(), f.to_string()),
        None => (s, String::new()),
    }
}

/// `|v|` rounded to `frac + 1` significant digits (exact, ties to even).
fn exact_scientific(v: f64, frac: usize) -> Decimal {
    parse_sci(&format!("{:.frac$e}", v.abs()))
}

/// Trims the fraction digits `frac`; whether the point stays.
fn trim_fraction(frac: &mut String, trim: Trim) -> bool {
    if trim != Trim::Keep {
        while frac.ends_with('0') {
            frac.pop();
        }
    }
    match trim {
        Trim::Keep | Trim::Point => true,
        Trim::Zero => {
            if frac.is_empty() {
                frac.push('0');
            }
            true
        }
        Trim::Minus => !frac.is_empty(),
    }
}

/// The parts of a digit-generation request (NumPy's `dragon4_*` arguments).
#[derive(Clone, Copy, Debug)]
struct Digits {
    precision: Option<usize>,
    min_digits: usize,
    unique: bool,
    trim: Trim,
    sign: bool,
}

fn sign_of(v: f64, plus: bool) -> &'static str {
    if v.is_sign_negative() {
        "-"
    } else if plus {
        "+"
    } else {
        ""
    }
}

/// NumPy's `dragon4_positional` (`fractional=True`) of a finite `v`.
fn positional(v: f64, kind: FloatKind, d: Digits, pad_left: usize, pad_right: usize) -> String {
    let (int_part, mut frac) = if d.unique {
        let s = shortest(v, kind);
        let frac_len = (s.digits.len() as i32 - 1 - s.exp).max(0) as usize;
        if d.precision.is_some_and(|p| frac_len > p) {
            exact_positional(v, d.precision.unwrap_or(0))
        } else if frac_len < d.min_digits {
            exact_positional(v, d.min_digits)
        } else {
            // The shortest digits placed around the point.
            let point = s.exp + 1;
            let text: String = s.digits.iter().map(|&x| char::from(b'0' + x)).collect();
            if point <= 0 {
                let zeros = "0".repeat((-point) as usize);
                ("0".to_string(), format!("{zeros}{text}"))
            } else if point as usize >= text.len() {
                let zeros = "0".repeat(point as usize - text.len());
                (format!("{text}{zeros}"), String::new())
            } else {
                let (i, f) = text.split_at(point as usize);
                (i.to_string(), f.to_string())
            }
        }
    } else {
        exact_positional(v, d.precision.unwrap_or(0))
    };
    let point = trim_fraction(&mut frac, d.trim);
    let head = format!("{}{int_part}", sign_of(v, d.sign));
    let mut out = format!("{head:>pad_left$}");
    if point {
        out.push('.');
        out.push_str(&frac);
        out.push_str(&" ".repeat(pad_right.saturating_sub(frac.len())));
    }
    out
}

/// NumPy's `dragon4_scientific` of a finite `v` (`exp_digits`: at least that many exponent
/// digits, 2 when `None`).
fn scientific(
    v: f64,
    kind: FloatKind,
    d: Digits,
    pad_left: usize,
    exp_digits: Option<usize>,
) -> String {
    let dec = if d.unique {
        let s = shortest(v, kind);
        let frac_len = s.digits.len() - 1;
        if d.precision.is_some_and(|p| frac_len > p) {
            exact_scientific(v, d.precision.unwrap_or(0))
        } else if frac_len < d.min_digits {
            exact_scientific(v, d.min_digits)
        } else {
            s
        }
    } else {
        exact_scientific(v, d.precision.unwrap_or(0))
    };
    let mut frac: String = dec.digits[1..]
        .iter()
        .map(|&x| char::from(b'0' + x))
        .collect();
    let point = trim_fraction(&mut frac, d.trim);
    let head = format!("{}{}", sign_of(v, d.sign), dec.digits[0]);
    let mut out = format!("{head:>pad_left$}");
    if point {
        out.push('.');
        out.push_str(&frac);
    }
    let digits = exp_digits.unwrap_or(2).max(1);
    let e = dec.exp;
    out.push_str(&format!(
        "e{}{:0digits$}",
        if e < 0 { '-' } else { '+' },
        e.unsigned_abs()
    ));
    out
}

/// NumPy's `FloatingFormat`: one layout for all the values printed.
struct FloatFormat {
    kind: FloatKind,
    exp_format: bool,
    digits: Digits,
    pad_left: usize,
    pad_right: usize,
    exp_size: Option<usize>,
    nanstr: String,
    infstr: String,
    sign: char,
}

impl FloatFormat {
    fn new(data: &[f64], kind: FloatKind, o: &PrintOptions, sign: char) -> FloatFormat {
        let finite: Vec<f64> = data.iter().copied().filter(|v| v.is_finite()).collect();
        let nonzero: Vec<f64> = finite
            .iter()
            .filter(|&&v| v != 0.0)
            .map(|v| v.abs())
            .collect();
        let mut exp_format = false;
        if !nonzero.is_empty() {
            let max = nonzero.iter().copied().fold(f64::MIN, f64::max);
            let min = nonzero.iter().copied().fold(f64::MAX, f64::min);
            let cutoff = 10f64.powi(kind.precision().min(8));
            exp_format = max >= cutoff || (!o.suppress && (min < 1e-4 || max / min > 1000.0));
        }
        let fixed = o.floatmode == "fixed";
        let mut f = FloatFormat {
            kind,
            exp_format,
            digits: Digits {
                precision: (o.floatmode != "unique").then_some(o.precision),
                min_digits: 0,
                unique: !fixed,
                trim: if fixed { Trim::Keep } else { Trim::Point },
                sign: sign == '+',
            },
            pad_left: 0,
            pad_right: 0,
            exp_size: None,
            nanstr: o.nanstr.clone(),
            infstr: o.infstr.clone(),
            sign,
        };
        if finite.is_empty() {
            f.digits.trim = Trim::Point;
            f.digits.unique = true;
        } else if exp_format {
            let strs: Vec<String> = finite
                .iter()
                .map(|&v| scientific(v, kind, f.digits, 0, None))
                .collect();
            let mut precision = 0;
            let mut exp_size = 0;
            for s in &strs {
                let (mantissa, exp) = s.split_once('e').unwrap_or((s, ""));
                let (int_part, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
                precision = precision.max(frac.len());
                exp_size = exp_size.max(exp.len().saturating_sub(1));
                f.pad_left = f.pad_left.max(int_part.len());
            }
            f.exp_size = Some(exp_size);
            f.digits.trim = Trim::Keep;
            f.digits.precision = Some(precision);
            f.digits.min_digits = precision;
            f.pad_right = exp_size + 2 + precision;
        } else {
            for &v in &finite {
                let s = positional(v, kind, f.digits, 0, 0);
                let (int_part, frac) = s.split_once('.').unwrap_or((&s, ""));
                f.pad_left = f.pad_left.max(int_part.len());
                f.pad_right = f.pad_right.max(frac.len());
            }
            if matches!(o.floatmode.as_str(), "fixed" | "maxprec_equal") {
                f.digits.precision = Some(f.pad_right);
                f.digits.min_digits = f.pad_right;
                f.digits.trim = Trim::Keep;
            } else {
                f.digits.trim = Trim::Point;
                f.digits.min_digits = 0;
            }
        }
        if sign == ' ' && !finite.iter().any(|v| v.is_sign_negative()) {
            f.pad_left += 1;
        }
        if data.len() != finite.len() {
            let neginf = sign != '-' || data.contains(&f64::NEG_INFINITY);
            let offset = f.pad_right as isize + 1;
            let nan = f.nanstr.chars().count() as isize - offset;
            let inf = f.infstr.chars().count() as isize + isize::from(neginf) - offset;
            f.pad_left = (f.pad_left as isize).max(nan).max(inf) as usize;
        }
        f
    }

    fn format(&self, v: f64) -> String {
        if !v.is_finite() {
            let ret = if v.is_nan() {
                format!("{}{}", if self.sign == '+' { "+" } else { "" }, self.nanstr)
            } else {
                let s = if v < 0.0 {
                    "-"
                } else if self.sign == '+' {
                    "+"
                } else {
                    ""
                };
                format!("{s}{}", self.infstr)
            };
            let width = self.pad_left + self.pad_right + 1;
            let pad = width.saturating_sub(ret.chars().count());
            return format!("{}{ret}", " ".repeat(pad));
        }
        if self.exp_format {
            scientific(v, self.kind, self.digits, self.pad_left, self.exp_size)
        } else {
            positional(v, self.kind, self.digits, self.pad_left, self.pad_right)
        }
    }
}

/// The elements printed, as read from the host.
enum Values {
    Bool(Vec<bool>),
    Int(Vec<i128>),
    Float(Vec<f64>, FloatKind),
    /// Real and imaginary parts, each of `FloatKind`.
    Complex(Vec<(f64, f64)>, FloatKind),
}

/// The formatter of one array's elements.
enum Formatter {
    Bool { scalar: bool },
    Int { width: usize, sign: char },
    Float(FloatFormat),
    Complex(FloatFormat, FloatFormat),
}

impl Formatter {
    fn new(values: &Values, o: &PrintOptions, scalar: bool) -> Formatter {
        match values {
            Values::Bool(_) => Formatter::Bool { scalar },
            Values::Int(v) => {
                let mut sign = o.sign;
                let width = match (v.iter().max(), v.iter().min()) {
                    (Some(&max), Some(&min)) => {
                        if sign == ' ' && min < 0 {
                            sign = '-';
                        }
                        let plus = usize::from(max >= 0 && sign != '-');
                        (max.to_string().len() + plus).max(min.to_string().len())
                    }
                    _ => 0,
                };
                Formatter::Int { width, sign }
            }
            Values::Float(v, kind) => Formatter::Float(FloatFormat::new(v, *kind, o, o.sign)),
            Values::Complex(v, kind) => {
                let re: Vec<f64> = v.iter().map(|c| c.0).collect();
                let im: Vec<f64> = v.iter().map(|c| c.1).collect();
                Formatter::Complex(
                    FloatFormat::new(&re, *kind, o, o.sign),
                    FloatFormat::new(&im, *kind, o, '+'),
                )
            }
        }
    }

    fn format(&self, values: &Values, i: usize) -> String {
        match (self, values) {
            (Formatter::Bool { scalar }, Values::Bool(v)) => match (v[i], scalar) {
                (true, false) => " True".into(),
                (true, true) => "True".into(),
                (false, _) => "False".into(),
            },
            (Formatter::Int { width, sign }, Values::Int(v)) => {
                let x = v[i];
                let s = match sign {
                    '+' if x >= 0 => format!("+{x}"),
                    ' ' if x >= 0 => format!(" {x}"),
                    _ => x.to_string(),
                };
                format!("{s:>width$}")
            }
            (Formatter::Float(f), Values::Float(v, _)) => f.format(v[i]),
            (Formatter::Complex(re, im), Values::Complex(v, _)) => {
                let r = re.format(v[i].0);
                let j = im.format(v[i].1);
                let end = j.trim_end().len();
                format!("{r}{}j{}", &j[..end], &j[end..])
            }
            _ => String::new(),
        }
    }
}

/// The printed elements of `t` on the host: all of them, or, when `edge` is given, the leading
/// and trailing `edge` of every axis longer than `2 * edge` (NumPy's `_leading_trailing`).
fn host_corners(t: &Tensor, edge: Option<usize>) -> dlbridge::Result<Tensor> {
    let t = if t.is_packed() {
        t.unpacked()?
    } else {
        t.clone()
    };
    let Some(e) = edge else {
        return t.copy_to(Device::CPU);
    };
    let shape: Vec<usize> = t
        .shape()
        .iter()
        .map(|&n| if n > 2 * e { 2 * e } else { n })
        .collect();
    let out = Tensor::empty(&shape, t.dtype(), Device::CPU)?;
    let mut pairs = vec![(t.clone(), out.clone())];
    for (axis, &n) in t.shape().iter().enumerate() {
        if n <= 2 * e {
            continue;
        }
        let part = |x: &Tensor, a: usize, b: usize| {
            x.slice(
                axis as isize,
                dlbridge::SliceArg::range(a as isize, b as isize),
            )
        };
        pairs = pairs
            .into_iter()
            .map(|(src, dst)| {
                Ok([
                    (part(&src, 0, e)?, part(&dst, 0, e)?),
                    (part(&src, n - e, n)?, part(&dst, e, 2 * e)?),
                ])
            })
            .collect::<dlbridge::Result<Vec<_>>>()?
            .into_iter()
            .flatten()
            .collect();
    }
    for (src, dst) in pairs {
        // SAFETY: `out` is new host memory only this function references.
        unsafe { dst.copy_from_unchecked(&src)? };
    }
    Ok(out)
}

/// The elements of a compact host tensor, in the form the formatters take; `None` for dtypes
/// printed otherwise (vectors of lanes).
fn read_values(host: &Tensor) -> dlbridge::Result<Option<Values>> {
    let dtype = host.dtype();
    if dtype.lanes() != 1 {
        return Ok(None);
    }
    let cast = |d: DType| dlbridge::compute::cast(host, d);
    Ok(Some(match dtype.code() {
        DTypeCode::Bool => Values::Bool(
            cast(DType::U8)?
                .to_vec::<u8>()?
                .into_iter()
                .map(|b| b != 0)
                .collect(),
        ),
        DTypeCode::Int => Values::Int(
            cast(DType::I64)?
                .to_vec::<i64>()?
                .into_iter()
                .map(i128::from)
                .collect(),
        ),
        DTypeCode::UInt => Values::Int(
            cast(DType::U64)?
                .to_vec::<u64>()?
                .into_iter()
                .map(i128::from)
                .collect(),
        ),
        DTypeCode::Complex => {
            let part = if dtype.bits() == 64 {
                DType::F32
            } else {
                DType::F64
            };
            let mut shape = host.shape().to_vec();
            shape.push(2);
            let parts = Tensor::new(
                host.buffer().clone(),
                part,
                Layout::contiguous_at(&shape, host.byte_offset())?,
            )?;
            let v = dlbridge::compute::cast(&parts, DType::F64)?.to_vec::<f64>()?;
            Values::Complex(
                v.chunks_exact(2).map(|c| (c[0], c[1])).collect(),
                FloatKind(part),
            )
        }
        _ if dtype.is_floating() => {
            Values::Float(cast(DType::F64)?.to_vec::<f64>()?, FloatKind(dtype))
        }
        _ => return Ok(None),
    }))
}

/// NumPy's `_formatArray` over an array of `shape` whose printed elements are `values` (laid out
/// row-major over the corners' shape when `summary`).
struct Layouter<'a> {
    shape: &'a [usize],
    /// The corners' row-major strides.
    strides: Vec<usize>,
    values: &'a Values,
    formatter: &'a Formatter,
    separator: &'a str,
    edge: usize,
    summary: bool,
}

/// NumPy's `_extendLine`.
fn extend_line(s: &mut String, line: &mut String, word: &str, width: usize, prefix: &str) {
    let len = |x: &str| x.chars().count();
    let wrap = len(line) + len(word) > width && len(line) > len(prefix);
    if wrap {
        s.push_str(line.trim_end());
        s.push('\n');
        *line = prefix.to_string();
    }
    line.push_str(word);
}

impl Layouter<'_> {
    /// The position in the corners of element `i` of axis `axis`.
    fn place(&self, axis: usize, i: usize) -> usize {
        let n = self.shape[axis];
        if self.summary && n > 2 * self.edge && i >= self.edge {
            i - (n - 2 * self.edge)
        } else {
            i
        }
    }

    fn recurse(&self, axis: usize, offset: usize, hanging: &str, width: usize) -> String {
        let ndim = self.shape.len();
        if axis == ndim {
            return self.formatter.format(self.values, offset);
        }
        let axes_left = ndim - axis;
        let next_hanging = format!("{hanging} ");
        let next_width = width.saturating_sub(1);
        let n = self.shape[axis];
        let show_summary = self.summary && 2 * self.edge < n;
        let (leading, trailing) = if show_summary {
            (self.edge, self.edge)
        } else {
            (0, n)
        };
        let at = |i: usize| offset + self.place(axis, i) * self.strides[axis];
        let sep = self.separator;
        let mut s = String::new();
        if axes_left == 1 {
            let elem_width = width.saturating_sub(sep.trim_end().len().max(1));
            let mut line = hanging.to_string();
            for i in 0..leading {
                let word = self.recurse(axis + 1, at(i), &next_hanging, next_width);
                extend_line(&mut s, &mut line, &word, elem_width, hanging);
                line.push_str(sep);
            }
            if show_summary {
                extend_line(&mut s, &mut line, "...", elem_width, hanging);
                line.push_str(sep);
            }
            for k in (2..=trailing).rev() {
                let word = self.recurse(axis + 1, at(n - k), &next_hanging, next_width);
                extend_line(&mut s, &mut line, &word, elem_width, hanging);
                line.push_str(sep);
            }
            let word = self.recurse(axis + 1, at(n - 1), &next_hanging, next_width);
            extend_line(&mut s, &mut line, &word, elem_width, hanging);
            s.push_str(&line);
        } else {
            let line_sep = format!("{}{}", sep.trim_end(), "\n".repeat(axes_left - 1));
            for i in 0..leading {
                let nested = self.recurse(axis + 1, at(i), &next_hanging, next_width);
                s.push_str(&format!("{hanging}{nested}{line_sep}"));
            }
            if show_summary {
                s.push_str(&format!("{hanging}...{line_sep}"));
            }
            for k in (2..=trailing).rev() {
                let nested = self.recurse(axis + 1, at(n - k), &next_hanging, next_width);
                s.push_str(&format!("{hanging}{nested}{line_sep}"));
            }
            let nested = self.recurse(axis + 1, at(n - 1), &next_hanging, next_width);
            s.push_str(&format!("{hanging}{nested}"));
        }
        let body: String = s.chars().skip(hanging.chars().count()).collect();
        format!("[{body}]")
    }
}

/// NumPy's `array2string` of `t` with `separator` and a first line prefixed by `prefix` (its
/// width indents the next lines), in `width` columns (the suffix's taken out).
fn array2string(
    t: &Tensor,
    o: &PrintOptions,
    separator: &str,
    prefix: &str,
    width: usize,
) -> dlbridge::Result<Option<String>> {
    if t.numel() == 0 {
        return Ok(Some("[]".into()));
    }
    let summary = t.numel() > o.threshold;
    let host = host_corners(t, summary.then_some(o.edgeitems))?;
    let Some(values) = read_values(&host)? else {
        return Ok(None);
    };
    let formatter = Formatter::new(&values, o, t.ndim() == 0);
    let mut strides = vec![1usize; host.ndim()];
    for a in (0..host.ndim().saturating_sub(1)).rev() {
        strides[a] = strides[a + 1] * host.shape()[a + 1];
    }
    let layouter = Layouter {
        shape: t.shape(),
        strides,
        values: &values,
        formatter: &formatter,
        separator,
        edge: o.edgeitems,
        summary,
    };
    let hanging = format!(" {}", " ".repeat(prefix.chars().count()));
    Ok(Some(layouter.recurse(0, 0, &hanging, width)))
}

/// Whether NumPy leaves the dtype out of a repr (its default types for Python values).
fn dtype_is_implied(dtype: DType) -> bool {
    [DType::F64, DType::I64, DType::BOOL, DType::C128].contains(&dtype)
}

/// `repr(a)`: NumPy's `array_repr` with prefix `Array(` and dlbridge's `device=` extra.
pub(crate) fn repr(py: Python<'_>, t: &Tensor) -> PyResult<String> {
    let o = PrintOptions::current(py);
    let prefix = "Array(";
    let Some(lst) = py
        .detach(|| array2string(t, &o, ", ", prefix, o.linewidth.saturating_sub(1)))
        .py()?
    else {
        return Ok(format!(
            "Array(shape={}, dtype={}{})",
            shape_tuple(t.shape()),
            t.dtype(),
            device_extra(t)
        ));
    };
    let mut extras = Vec::new();
    if (t.numel() == 0 && t.shape() != [0]) || t.numel() > o.threshold {
        extras.push(format!("shape={}", shape_tuple(t.shape())));
    }
    if !dtype_is_implied(t.dtype()) || t.numel() == 0 {
        extras.push(format!("dtype={}", t.dtype()));
    }
    if !t.device().is_cpu() {
        extras.push(format!("device='{}'", t.device()));
    }
    if extras.is_empty() {
        return Ok(format!("{prefix}{lst})"));
    }
    let head = format!("{prefix}{lst},");
    let extra = format!("{})", extras.join(", "));
    let last = head.rsplit('\n').next().unwrap_or(&head).chars().count();
    let spacer = if last + extra.chars().count() + 1 > o.linewidth {
        format!("\n{}", " ".repeat(prefix.len()))
    } else {
        " ".to_string()
    };
    Ok(format!("{head}{spacer}{extra}"))
}

/// `str(a)`: NumPy's `array_str` (a 0-d array prints as its scalar).
pub(crate) fn str(py: Python<'_>, t: &Tensor) -> PyResult<String> {
    let o = PrintOptions::current(py);
    if t.ndim() == 0 {
        let host = py.detach(|| host_corners(t, None)).py()?;
        if let Some(values) = read_values(&host).py()? {
            return Ok(scalar_str(&values));
        }
    }
    match py
        .detach(|| array2string(t, &o, " ", "", o.linewidth))
        .py()?
    {
        Some(s) => Ok(s),
        None => repr(py, t),
    }
}

/// A NumPy scalar's `str`: floats positional from 1e-4 up to 1e16 (one zero kept after the
/// point), else scientific without trailing zeros; complex as Python writes it.
fn scalar_str(values: &Values) -> String {
    let float = |v: f64, kind: FloatKind, trim_zero: bool| -> String {
        if v.is_nan() {
            return "nan".into();
        }
        if v.is_infinite() {
            return if v < 0.0 { "-inf".into() } else { "inf".into() };
        }
        let d = Digits {
            precision: None,
            min_digits: 0,
            unique: true,
            trim: if trim_zero { Trim::Zero } else { Trim::Minus },
            sign: false,
        };
        let a = v.abs();
        if a == 0.0 || (1e-4..1e16).contains(&a) {
            positional(v, kind, d, 0, 0)
        } else {
            scientific(
                v,
                kind,
                Digits {
                    trim: Trim::Minus,
                    ..d
                },
                0,
                None,
            )
        }
    };
    match values {
        Values::Bool(v) => if v[0] { "True" } else { "False" }.into(),
        Values::Int(v) => v[0].to_string(),
        Values::Float(v, kind) => float(v[0], *kind, true),
        Values::Complex(v, kind) => {
            let (re, im) = v[0];
            let imag = float(im, *kind, false);
            if re == 0.0 && !re.is_sign_negative() {
                format!("{imag}j")
            } else {
                let sign = if im.is_sign_negative() { "" } else { "+" };
                format!("({}{sign}{imag}j)", float(re, *kind, false))
            }
        }
    }
}

/// A shape as Python writes a tuple: `(2, 3)`, `(4,)`, `()`.
fn shape_tuple(shape: &[usize]) -> String {
    match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn device_extra(t: &Tensor) -> String {
    if t.device().is_cpu() {
        String::new()
    } else {
        format!(", device='{}'", t.device())
    }
}
