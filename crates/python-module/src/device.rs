//! `dlbridge.Device`: where memory lives.

use std::sync::Mutex;

use dlbridge::{Device, StorageMode};
use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use crate::dtype::Comparison;
use crate::errors::IntoPyResult;
use crate::fastcall::InternedNames;

/// A device: `cpu`, `cuda:N`, `cuda_host:N`, `cuda_managed:N`, `metal:N`, or another DLPack device
/// held opaquely. Compares equal to its string form.
#[pyclass(frozen, module = "dlbridge", name = "Device")]
#[derive(Clone, Copy)]
pub(crate) struct PyDevice(pub(crate) Device);

#[pymethods]
impl PyDevice {
    #[new]
    fn py_new(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        parse(obj).map(PyDevice)
    }

    /// The kind of device (`cpu`, `cuda`, `cuda_host`, `cuda_managed`, `metal`, ...).
    #[getter]
    fn r#type(&self) -> String {
        self.0.kind().name()
    }

    /// The device ordinal.
    #[getter]
    fn index(&self) -> u32 {
        self.0.index()
    }

    /// The DLPack `(device_type, device_id)` pair.
    fn __dlpack_device__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let dl = self.0.to_dlpack();
        PyTuple::new(py, [dl.device_type, dl.device_id])
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }

    fn __repr__(&self) -> String {
        format!("dlbridge.Device('{}')", self.0)
    }

    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        PyString::new(py, &self.0.to_string()).hash()
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> Comparison {
        let equal = parse(other).is_ok_and(|d| d == self.0);
        match op {
            CompareOp::Eq => Comparison::Bool(equal),
            CompareOp::Ne => Comparison::Bool(!equal),
            _ => Comparison::NotImplemented,
        }
    }
}

/// `"cpu"`, for a parse of the commonest device without reading the text.
static CPU_NAME: InternedNames<Device, 1> = InternedNames::new([("cpu", Device::CPU)]);

/// Device strings parsed before, by object. A program usually passes one constant string object
/// on every call (`device="cuda:0"`), which this finds by pointer without reading its text (on
/// the stable ABI of 3.9, reading copies the text into a new bytes object). The cache holds its
/// strings, so no other string can take a listed address; it keeps the last few.
struct ParsedStrings {
    entries: Vec<(Py<PyString>, Device)>,
    next: usize,
}

/// How many device strings [`PARSED`] remembers.
const PARSED_CAPACITY: usize = 8;

static PARSED: Mutex<ParsedStrings> = Mutex::new(ParsedStrings {
    entries: Vec::new(),
    next: 0,
});

fn parse_str(s: &Bound<'_, PyString>) -> PyResult<Device> {
    if let Some(&d) = CPU_NAME.get(s) {
        return Ok(d);
    }
    let mut parsed = PARSED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, d)) = parsed
        .entries
        .iter()
        .find(|(o, _)| o.as_ptr() == s.as_ptr())
    {
        return Ok(*d);
    }
    let device = s.to_cow()?.parse::<Device>().py()?;
    let entry = (s.clone().unbind(), device);
    if parsed.entries.len() < PARSED_CAPACITY {
        parsed.entries.push(entry);
    } else {
        let slot = parsed.next;
        parsed.next = (slot + 1) % PARSED_CAPACITY;
        // The string replaced is released after the lock (its release runs no Python code,
        // but nothing is gained by holding the lock for it).
        let old = std::mem::replace(&mut parsed.entries[slot], entry);
        drop(parsed);
        drop(old);
    }
    Ok(device)
}

/// Reads a device from a `Device`, a string (`"cpu"`, `"cuda:1"`, `"metal"`), a DLPack
/// `(device_type, device_id)` tuple, or an object with `type` and `index` (a `torch.device`).
pub(crate) fn parse(obj: &Bound<'_, PyAny>) -> PyResult<Device> {
    if let Ok(d) = obj.cast::<PyDevice>() {
        return Ok(d.get().0);
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return parse_str(s);
    }
    if let Ok((device_type, device_id)) = obj.extract::<(i32, i32)>() {
        if device_type == dlbridge::dlpack::ffi::K_DL_CPU && device_id != 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "({device_type}, {device_id}) names CPU device {device_id}, but DLPack's CPU is \
                 always device 0"
            )));
        }
        return Device::from_dlpack(dlbridge::dlpack::ffi::DLDevice {
            device_type,
            device_id,
        })
        .map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "({device_type}, {device_id}) is not a DLPack device"
            ))
        });
    }
    let py = obj.py();
    if let (Ok(kind), Ok(index)) = (
        obj.getattr(pyo3::intern!(py, "type")),
        obj.getattr(pyo3::intern!(py, "index")),
    ) {
        if let Ok(kind) = kind.extract::<String>() {
            let text = match index.extract::<Option<u32>>() {
                Ok(Some(i)) => format!("{kind}:{i}"),
                _ => kind,
            };
            return text.parse::<Device>().py();
        }
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "{} is not a device (expected 'cpu', 'cuda:N', 'metal:N', a dlbridge.Device or a \
         (device_type, device_id) tuple)",
        obj.repr()?
    )))
}

/// Reads an optional device argument (`None` and Python's `None` both mean "not given").
pub(crate) fn parse_opt(device: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Device>> {
    match device {
        Some(d) if !d.is_none() => Ok(Some(parse(d)?)),
        _ => Ok(None),
    }
}

/// Reads a storage mode: `private` (alias `device`), `shared` (alias `pinned`) or `managed`.
pub(crate) fn parse_storage(storage: Option<&str>) -> PyResult<Option<StorageMode>> {
    let Some(name) = storage else {
        return Ok(None);
    };
    let mode = match name.trim().to_ascii_lowercase().as_str() {
        "device" => StorageMode::Private,
        "pinned" => StorageMode::Shared,
        other => other.parse::<StorageMode>().map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "unknown storage {name:?}: expected 'private' (or 'device'), 'shared' (or \
                 'pinned') or 'managed'"
            ))
        })?,
    };
    Ok(Some(mode))
}
