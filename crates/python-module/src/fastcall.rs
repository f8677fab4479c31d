//! Hand-written vectorcall entry points for the calls whose cost per call is a promise of this
//! package: `dlbridge.from_dlpack`, `dlbridge.empty` and `Array.__dlpack__`.
//!
//! The wheel targets the stable ABI of CPython 3.9, where PyO3 registers every function as
//! `METH_VARARGS | METH_KEYWORDS`: each call with keywords then builds an argument tuple and a
//! keyword dict, which costs more than an export does. These three functions are registered here
//! as `METH_FASTCALL | METH_KEYWORDS` instead, and parse their arguments straight from the
//! vector CPython passes. That calling convention has been in CPython since 3.7 and is part of
//! the stable ABI since 3.10 (the flag's value and the function's signature are the same in
//! every version), so it is sound on every interpreter the wheel loads on.
//!
//! What it buys, measured: each of the three is kept here because a benchmark in the tree shows
//! the difference. A/B of two wheels (this parser, and the same functions as plain
//! `#[pyfunction]`/`#[pymethods]` with the same argument conversions), run alternately on one
//! machine (x86_64, 2 vCPUs, CPython 3.11, release build, 2026-11-27), median of 5 runs of
//! `python bench/bench_cpu.py` and of `python bench/bench_pool.py --devices cpu` (1 KiB arrays;
//! the 1 GiB columns agree):
//!
//! | call (benchmark case) | fastcall (µs) | PyO3 (µs) |
//! | --- | ---: | ---: |
//! | `a.__dlpack__(max_version=(1, 3))` | 0.140 | 0.261 |
//! | `numpy.from_dlpack(a)` (calls `__dlpack__` with keywords) | 0.259 | 0.486 |
//! | `torch.from_dlpack(a)` | 1.20 | 1.33 |
//! | `dlbridge.empty(n, dlbridge.uint8)` + `del` (pool hit) | 0.214 | 0.272 |
//! | `dlbridge.from_dlpack(torch_tensor)` | 0.537 | 0.581 |
//! | `dlbridge.from_dlpack(numpy_array)` | 0.509 | 0.527 (within noise) |
//!
//! Every other function is PyO3's: none of them has a per-call cost the benchmarks promise, and
//! a new entry point here needs such a figure first.
//!
//! Keyword names are matched by pointer against interned copies first (names written in Python
//! source are interned, so this is the common case) and by value otherwise. Errors read as
//! CPython's own (`TypeError` for a missing, repeated or unexpected argument).

use std::ffi::{CStr, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::panic::PanicException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCFunction, PyInt, PyString, PyTuple};

/// `METH_FASTCALL`, which pyo3-ffi spells only for the stable ABI of 3.10 and later; its value is
/// the same in every CPython since 3.7.
const METH_FASTCALL: c_int = 0x0080;

/// `PY_VECTORCALL_ARGUMENTS_OFFSET`: the flag CPython sets in a vectorcall's argument count
/// when the callee may use the slot before the vector (the top bit of the count).
const VECTORCALL_ARGUMENTS_OFFSET: usize = 1 << (usize::BITS - 1);

/// The C signature of a `METH_FASTCALL | METH_KEYWORDS` function: `self` (the module or the
/// instance), the argument vector, its length (with `PY_VECTORCALL_ARGUMENTS_OFFSET` possibly
/// set) and the tuple of keyword names (NULL when there are none); the keyword values follow the
/// positional ones in the vector.
pub(crate) type FastcallFn = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

/// A method definition CPython keeps a pointer to for the life of the process.
pub(crate) struct MethodDef {
    name: &'static str,
    def: ffi::PyMethodDef,
}

// SAFETY: the definition is immutable after construction (CPython only reads it) and its pointers
// are to `'static` C strings and a function.
unsafe impl Sync for MethodDef {}

impl MethodDef {
    /// A `METH_FASTCALL | METH_KEYWORDS` definition. `doc` starts with the text signature
    /// (`name(args)\n--\n\n`), which gives `inspect.signature` the parameters.
    pub(crate) const fn new(name: &'static CStr, doc: &'static CStr, f: FastcallFn) -> Self {
        let Ok(name_str) = name.to_str() else {
            panic!("a method name is ASCII");
        };
        MethodDef {
            name: name_str,
            def: ffi::PyMethodDef {
                ml_name: name.as_ptr(),
                ml_meth: ffi::PyMethodDefPointer {
                    // SAFETY: CPython calls `ml_meth` with the signature its flags name, here
                    // `METH_FASTCALL | METH_KEYWORDS`, which is `FastcallFn`; the union field only
                    // carries the pointer.
                    PyCFunctionWithKeywords: unsafe {
                        std::mem::transmute::<FastcallFn, ffi::PyCFunctionWithKeywords>(f)
                    },
                },
                ml_flags: METH_FASTCALL | ffi::METH_KEYWORDS,
                ml_doc: doc.as_ptr(),
            },
        }
    }

    fn as_ptr(&'static self) -> *mut ffi::PyMethodDef {
        ptr::from_ref(&self.def).cast_mut()
    }

    /// Adds the function to module `m`.
    pub(crate) fn add_to_module(&'static self, m: &Bound<'_, PyModule>) -> PyResult<()> {
        let py = m.py();
        let name = m.name()?;
        // SAFETY: the definition lives for the whole process; `m` and `name` are live objects the
        // call only takes new references to.
        let raw = unsafe { ffi::PyCFunction_NewEx(self.as_ptr(), m.as_ptr(), name.as_ptr()) };
        // SAFETY: `raw` is a new reference or NULL with an exception set.
        let f = unsafe { Bound::from_owned_ptr_or_err(py, raw)? };
        m.add(self.name, f.cast_into::<PyCFunction>()?)
    }

    /// Installs the function as a method of the class `T` (replacing any attribute of its name).
    pub(crate) fn add_to_class<T: pyo3::PyTypeInfo>(&'static self, py: Python<'_>) -> PyResult<()> {
        let ty = py.get_type::<T>();
        // SAFETY: the type object is live; the definition lives for the whole process. A method
        // descriptor checks that `self` is an instance of `ty` before it calls the function.
        let raw = unsafe { ffi::PyDescr_NewMethod(ty.as_ptr().cast(), self.as_ptr()) };
        // SAFETY: `raw` is a new reference or NULL with an exception set.
        let descr = unsafe { Bound::from_owned_ptr_or_err(py, raw)? };
        ty.setattr(self.name, descr)
    }
}

/// How an entry point's body runs with respect to PyO3's count of attachments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Attach {
    /// Inside the count ([`Python::attach`]). For bodies that may drop the last reference to a
    /// Python object: PyO3 releases a `Py<T>` dropped while its count is zero only at its next
    /// attachment, which for a foreign producer means its deleter would run late.
    Counted,
    /// Outside it, with a token from `Python::assume_attached`: from a bare C entry point the
    /// count costs a `PyGILState_Ensure`/`Release` pair (about 40 ns, a third of an export). Only
    /// for bodies that release no Python object whose deletion matters now: a `Py<T>` dropped
    /// outside the count (an error object, at worst) is released at PyO3's next attachment
    /// instead of at once.
    Assumed,
}

/// Runs an entry point's body with a Rust panic turned into `PanicException` and an error raised
/// (never unwound into CPython).
fn run<'py>(
    py: Python<'py>,
    body: impl FnOnce(Python<'py>) -> PyResult<Bound<'py, PyAny>>,
) -> *mut ffi::PyObject {
    match catch_unwind(AssertUnwindSafe(|| body(py))) {
        Ok(Ok(obj)) => obj.into_ptr(),
        Ok(Err(err)) => {
            err.restore(py);
            ptr::null_mut()
        }
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with no message".to_owned());
            PanicException::new_err(msg).restore(py);
            ptr::null_mut()
        }
    }
}

/// The arguments CPython passed to one fast call that is running now: the argument vector, its
/// count (with `PY_VECTORCALL_ARGUMENTS_OFFSET` possibly set) and the tuple of keyword names (NULL
/// when there are none).
#[derive(Clone, Copy)]
pub(crate) struct FastArgs {
    args: *const *mut ffi::PyObject,
    nargsf: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
}

impl FastArgs {
    /// # Safety
    /// `args`, `nargsf` and `kwnames` are what CPython passed to the `METH_FASTCALL |
    /// METH_KEYWORDS` function running now on this thread (so the thread is attached), and the
    /// value is used only during that call.
    pub(crate) unsafe fn new(
        args: *const *mut ffi::PyObject,
        nargsf: ffi::Py_ssize_t,
        kwnames: *mut ffi::PyObject,
    ) -> Self {
        FastArgs {
            args,
            nargsf,
            kwnames,
        }
    }

    /// The number of positional arguments (the offset flag is the top bit of `nargsf`).
    fn nargs(self) -> usize {
        self.nargsf as usize & !VECTORCALL_ARGUMENTS_OFFSET
    }

    /// The first `n` entries of the argument vector (none, without reading it, when `n` is 0).
    ///
    /// # Safety
    /// The vector holds at least `n` entries: `nargs()` positional values, then one per keyword
    /// name.
    unsafe fn values<'a>(self, n: usize) -> &'a [*mut ffi::PyObject] {
        if n == 0 {
            &[]
        } else {
            // SAFETY: CPython's vector of live objects, borrowed for the call (`FastArgs::new`),
            // with at least `n` entries (the caller).
            unsafe { std::slice::from_raw_parts(self.args, n) }
        }
    }
}

/// The parameters of a function with `N` parameters, in order: the first `positional_only` can
/// be given only by position, the first `positional` by position, the rest only by keyword, and
/// the first `required` must be given.
pub(crate) struct Signature<const N: usize> {
    function: &'static str,
    /// The parameter names, each with its index.
    params: InternedNames<usize, N>,
    positional_only: usize,
    positional: usize,
    required: usize,
}

impl<const N: usize> Signature<N> {
    pub(crate) const fn new(
        function: &'static str,
        params: [&'static str; N],
        positional_only: usize,
        positional: usize,
        required: usize,
    ) -> Self {
        assert!(positional_only <= positional && positional <= N && required <= positional);
        let mut indexed = [("", 0); N];
        let mut i = 0;
        while i < N {
            indexed[i] = (params[i], i);
            i += 1;
        }
        Signature {
            function,
            params: InternedNames::new(indexed),
            positional_only,
            positional,
            required,
        }
    }

    /// An entry point's whole body: `body` over the call's arguments ([`Signature::parse`]),
    /// attached as `attach` says, with a panic raised as `PanicException` ([`run`]).
    pub(crate) fn call(
        &self,
        args: FastArgs,
        attach: Attach,
        body: impl for<'a, 'py> FnOnce(
            Python<'py>,
            [Option<&'a Bound<'py, PyAny>>; N],
        ) -> PyResult<Bound<'py, PyAny>>,
    ) -> *mut ffi::PyObject {
        match attach {
            Attach::Counted => Python::attach(|py| run(py, |py| body(py, self.parse(py, args)?))),
            Attach::Assumed => {
                // SAFETY: CPython is running the call `args` came with, so the thread is attached
                // (`FastArgs::new`).
                let py = unsafe { Python::assume_attached() };
                run(py, |py| body(py, self.parse(py, args)?))
            }
        }
    }

    /// The name of parameter `i`.
    fn param(&self, i: usize) -> &'static str {
        self.params.entries[i].0
    }

    /// The arguments of one call, by parameter (`None`: not given; an explicit `None` argument is
    /// `Some` of Python's `None`, which the callers treat as not given where the signature's
    /// default is `None`). The references are used only during the call (`FastArgs::new`).
    #[inline(always)]
    fn parse<'a, 'py>(
        &self,
        py: Python<'py>,
        args: FastArgs,
    ) -> PyResult<[Option<&'a Bound<'py, PyAny>>; N]> {
        let nargs = args.nargs();
        if nargs > self.positional {
            return Err(self.too_many_positional(nargs));
        }
        let mut out: [Option<&'a Bound<'py, PyAny>>; N] = [None; N];
        // SAFETY: CPython's vector starts with the `nargs` positional values.
        let positional = unsafe { args.values(nargs) };
        for (slot, value) in out.iter_mut().zip(positional) {
            // SAFETY: a live object borrowed for the call.
            *slot = Some(unsafe { Bound::ref_from_ptr(py, value) });
        }
        if !args.kwnames.is_null() {
            self.parse_keywords(py, args, &mut out)?;
        }
        if let Some(missing) = out[..self.required].iter().position(Option::is_none) {
            return Err(self.missing(missing));
        }
        Ok(out)
    }

    /// The keyword part of [`Signature::parse`] (`args` has keyword names): the values after the
    /// positional ones, by the names in `kwnames`, into `out`.
    fn parse_keywords<'py>(
        &self,
        py: Python<'py>,
        args: FastArgs,
        out: &mut [Option<&Bound<'py, PyAny>>; N],
    ) -> PyResult<()> {
        let nargs = args.nargs();
        // SAFETY: CPython passes a live object, borrowed for the call ...
        let kwnames = unsafe { Bound::ref_from_ptr(py, &args.kwnames) };
        // SAFETY: ... and it is a tuple of str.
        let kwnames = unsafe { kwnames.cast_unchecked::<PyTuple>() };
        // SAFETY: a value follows the positional ones for every keyword name.
        let values = unsafe { args.values(nargs + kwnames.len()) };
        for k in 0..kwnames.len() {
            let name = kwnames.get_borrowed_item(k)?;
            let name = name.cast::<PyString>()?;
            let index = match self.params.lookup(&name)? {
                Some(&i) if i >= self.positional_only => i,
                Some(_) | None => {
                    return Err(PyTypeError::new_err(format!(
                        "{}() got an unexpected keyword argument {}",
                        self.function,
                        name.repr()?
                    )));
                }
            };
            if out[index].is_some() {
                return Err(PyTypeError::new_err(format!(
                    "{}() got multiple values for argument '{}'",
                    self.function,
                    self.param(index)
                )));
            }
            // SAFETY: a live object borrowed for the call.
            out[index] = Some(unsafe { Bound::ref_from_ptr(py, &values[nargs + k]) });
        }
        Ok(())
    }

    #[cold]
    fn too_many_positional(&self, nargs: usize) -> PyErr {
        PyTypeError::new_err(format!(
            "{}() takes at most {} positional argument{} ({nargs} given)",
            self.function,
            self.positional,
            if self.positional == 1 { "" } else { "s" }
        ))
    }

    #[cold]
    fn missing(&self, index: usize) -> PyErr {
        PyTypeError::new_err(format!(
            "{}() missing required argument '{}' (pos {})",
            self.function,
            self.param(index),
            index + 1
        ))
    }
}

/// An optional argument whose default is `None`: `None` when not given or given as `None`.
pub(crate) fn opt<'a, 'py>(arg: Option<&'a Bound<'py, PyAny>>) -> Option<&'a Bound<'py, PyAny>> {
    arg.filter(|a| !a.is_none())
}

/// `TypeError`: argument `name` must be `expected` or None, not the type of `a`.
fn wrong_type(name: &str, expected: &str, a: &Bound<'_, PyAny>) -> PyErr {
    let ty = a
        .get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string());
    PyTypeError::new_err(format!(
        "argument '{name}' must be {expected} or None, not {ty}"
    ))
}

/// An optional `bool` argument (`None` when not given or `None`), named `name` in errors.
pub(crate) fn opt_bool(arg: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<bool>> {
    opt(arg)
        .map(|a| {
            a.extract::<bool>()
                .map_err(|_| wrong_type(name, "a bool", a))
        })
        .transpose()
}

/// An optional `str` argument (`None` when not given or `None`), named `name` in errors.
pub(crate) fn opt_str<'a>(
    arg: Option<&'a Bound<'_, PyAny>>,
    name: &str,
) -> PyResult<Option<std::borrow::Cow<'a, str>>> {
    opt(arg)
        .map(|a| {
            a.cast::<PyString>()
                .map_err(|_| wrong_type(name, "a str", a))?
                .to_cow()
        })
        .transpose()
}

/// A `(major, minor)` version argument (`None` when not given or `None`), named `name` in errors.
pub(crate) fn opt_version(
    arg: Option<&Bound<'_, PyAny>>,
    name: &str,
) -> PyResult<Option<(u32, u32)>> {
    let Some(a) = opt(arg) else {
        return Ok(None);
    };
    let bad = || {
        PyTypeError::new_err(format!(
            "argument '{name}' must be a (major, minor) tuple of non-negative ints, not {}",
            a.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    };
    let t = a.cast::<PyTuple>().map_err(|_| bad())?;
    if t.len() != 2 {
        return Err(bad());
    }
    let part = |i: usize| {
        let item = t.get_borrowed_item(i)?;
        // Exact ints only (as `operator.index` would take, minus bools): the common `(1, 3)`
        // costs two C calls this way.
        if !item.is_exact_instance_of::<PyInt>() {
            return Err(bad());
        }
        // SAFETY: `item` is a live int.
        let v = unsafe { ffi::PyLong_AsLong(item.as_ptr()) };
        if v == -1 {
            if let Some(err) = PyErr::take(t.py()) {
                drop(err);
                return Err(bad());
            }
        }
        u32::try_from(v).map_err(|_| bad())
    };
    Ok(Some((part(0)?, part(1)?)))
}

/// Values named by strings, looked up by the identity of the string object: a string written in
/// Python source as an identifier-like literal (`"float32"`, `"cpu"`) is interned, so it is the
/// very object this table holds and the lookup is a few pointer comparisons. On the stable ABI of
/// 3.9 the alternative, reading the text, copies it into a new bytes object first.
pub(crate) struct InternedNames<T: 'static, const N: usize> {
    entries: [(&'static str, T); N],
    objects: PyOnceLock<[Py<PyString>; N]>,
}

impl<T: 'static, const N: usize> InternedNames<T, N> {
    pub(crate) const fn new(entries: [(&'static str, T); N]) -> Self {
        InternedNames {
            entries,
            objects: PyOnceLock::new(),
        }
    }

    /// The value named by `s` when `s` is the interned copy of one of the names; `None` does not
    /// mean that no name matches (compare the text for that).
    pub(crate) fn get(&self, s: &Bound<'_, PyString>) -> Option<&T> {
        let py = s.py();
        let objects = self.objects.get_or_init(py, || {
            self.entries
                .each_ref()
                .map(|(name, _)| PyString::intern(py, name).unbind())
        });
        let i = objects.iter().position(|o| o.as_ptr() == s.as_ptr())?;
        Some(&self.entries[i].1)
    }

    /// The value named by `s`: by identity (see [`InternedNames::get`]), else by its text.
    pub(crate) fn lookup(&self, s: &Bound<'_, PyString>) -> PyResult<Option<&T>> {
        match self.get(s) {
            Some(v) => Ok(Some(v)),
            None => Ok(self.by_text(&s.to_cow()?)),
        }
    }

    /// The value named by the text `name`.
    pub(crate) fn by_text(&self, name: &str) -> Option<&T> {
        self.entries
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
    }
}
