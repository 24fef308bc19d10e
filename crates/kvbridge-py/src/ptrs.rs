//! Addresses and lengths from Python arguments: ints (`tensor.data_ptr()`,
//! `ndarray.ctypes.data`), objects with `data_ptr()` (torch tensors) or
//! `__array_interface__` (numpy arrays), lists of those, and 1-D integer
//! numpy arrays (e.g. a column of [`crate::plan`]'s output).
//!
//! **Never:** dereferences an address (they are only numbers here), or
//! accepts a negative or non-integer value: a wrong type is a `TypeError`,
//! an int outside `0..2**64` a `ValueError`.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArray};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyString};

/// One address: an int; a numpy array's (`__array_interface__`) or a
/// tensor's (`data_ptr()`) start address; an integer-like (`__index__`,
/// such as `numpy.uint64`); another object with `__array_interface__`.
/// Arrays and tensors come before `__index__`, which a one-element array
/// or tensor also has (its value, not its address).
pub fn address(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let int = |v: &Bound<'_, PyAny>, source: &str| {
        int_value(v, what)?
            .ok_or_else(|| PyTypeError::new_err(format!("{what}: {source} is no int")))
    };
    if obj.is_instance_of::<PyInt>() {
        return int(obj, "the value");
    }
    if obj.is_instance_of::<PyUntypedArray>() {
        return int(&array_data(obj)?, "__array_interface__['data'][0]");
    }
    if obj.hasattr("data_ptr")? {
        return int(&obj.call_method0("data_ptr")?, "data_ptr()");
    }
    if let Some(v) = int_value(obj, what)? {
        return Ok(v);
    }
    if obj.hasattr("__array_interface__")? {
        return int(&array_data(obj)?, "__array_interface__['data'][0]");
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be an int address (or have data_ptr() or __array_interface__), not {}",
        type_name(obj)
    )))
}

/// `obj.__array_interface__["data"][0]`: an array's start address.
fn array_data<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    obj.getattr("__array_interface__")?
        .get_item("data")?
        .get_item(0)
}

/// One length in bytes: an int in `0..2**64`.
pub fn length(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    int_value(obj, what)?.ok_or_else(|| {
        PyTypeError::new_err(format!("{what} must be an int, not {}", type_name(obj)))
    })
}

/// Addresses from a list (or other sequence) of [`address`]es or a 1-D
/// integer numpy array.
pub fn addresses(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    sequence(obj, what, address)
}

/// Lengths from a list (or other sequence) of ints or a 1-D integer numpy array.
pub fn lengths(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    sequence(obj, what, length)
}

fn sequence(
    obj: &Bound<'_, PyAny>,
    what: &str,
    item: fn(&Bound<'_, PyAny>, &str) -> PyResult<u64>,
) -> PyResult<Vec<u64>> {
    if let Some(v) = numpy_ints(obj, what)? {
        return Ok(v);
    }
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyInt>()
    {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list, not {}",
            type_name(obj)
        )));
    }
    let iter = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!("{what} must be a list, not {}", type_name(obj)))
    })?;
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for (i, v) in iter.enumerate() {
        out.push(item(&v?, &format!("{what}[{i}]"))?);
    }
    Ok(out)
}

/// The values of a 1-D `uint64` / `int64` numpy array (negatives refused);
/// `None` for anything else (other dtypes take the generic path).
fn numpy_ints(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<Vec<u64>>> {
    if !obj.is_instance_of::<PyUntypedArray>() {
        return Ok(None);
    }
    if let Ok(a) = obj.cast::<PyArray1<u64>>() {
        return Ok(Some(a.readonly().as_array().to_vec()));
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        let ro = a.readonly();
        return ro
            .as_array()
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                u64::try_from(v)
                    .map_err(|_| PyValueError::new_err(format!("{what}[{i}] = {v} is negative")))
            })
            .collect::<PyResult<Vec<u64>>>()
            .map(Some);
    }
    Ok(None)
}

/// The value of an int (or anything with `__index__`, such as a numpy
/// integer); `None` when `obj` is no integer (`bool` counts as none);
/// `ValueError` outside `0..2**64`.
fn int_value(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<u64>> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Ok(None);
    }
    match obj.extract::<u64>() {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<PyTypeError>(obj.py()) => Ok(None),
        Err(_) => Err(PyValueError::new_err(format!(
            "{what} = {} is outside 0..2**64",
            obj.str().map_or_else(|_| "?".into(), |s| s.to_string())
        ))),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}
