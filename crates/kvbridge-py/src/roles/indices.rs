//! Page and state indices from Python: 1-D `int32` numpy arrays (what
//! sglang passes) are read in place; `int64` arrays, other integer arrays
//! and lists are converted, each value range-checked.
//!
//! **Never:** accepts a float, a 2-D array or an index outside `i32` (a
//! `TypeError` or `ValueError` says which).

use std::borrow::Cow;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// One index list as Python handed it.
#[derive(Debug)]
pub enum Indices<'py> {
    /// An `int32` array, borrowed read-only.
    I32(PyReadonlyArray1<'py, i32>),
    /// An `int64` array, borrowed read-only.
    I64(PyReadonlyArray1<'py, i64>),
    /// Anything else that iterates over ints.
    List(Vec<i64>),
}

impl<'py> Indices<'py> {
    /// Reads `obj` (`what` names it in errors).
    pub fn extract(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if let Ok(a) = obj.cast::<PyArray1<i32>>() {
            return Ok(Self::I32(a.try_readonly()?));
        }
        if let Ok(a) = obj.cast::<PyArray1<i64>>() {
            return Ok(Self::I64(a.try_readonly()?));
        }
        if obj.is_instance_of::<PyUntypedArray>() {
            // Other integer dtypes (uint32, int16, ...) or a 0-d/2-d array:
            // take the values through `tolist()` only if it is 1-D ints.
            let list = obj.call_method0("tolist")?;
            return list
                .extract::<Vec<i64>>()
                .map(Self::List)
                .map_err(|_| PyTypeError::new_err(format!("{what} must be a 1-D integer array")));
        }
        obj.extract::<Vec<i64>>().map(Self::List).map_err(|_| {
            PyTypeError::new_err(format!(
                "{what} must be a 1-D integer array or a list of ints"
            ))
        })
    }

    /// The indices as `i32`, borrowed when they already are.
    pub fn as_i32(&self) -> PyResult<Cow<'_, [i32]>> {
        match self {
            Self::I32(a) => match a.as_slice() {
                Ok(s) => Ok(Cow::Borrowed(s)),
                Err(_) => Ok(Cow::Owned(a.as_array().iter().copied().collect())),
            },
            Self::I64(a) => to_i32(a.as_array().iter().copied()).map(Cow::Owned),
            Self::List(v) => to_i32(v.iter().copied()).map(Cow::Owned),
        }
    }

    /// The indices as `i64`.
    pub fn to_i64(&self) -> Vec<i64> {
        match self {
            Self::I32(a) => a.as_array().iter().map(|&v| i64::from(v)).collect(),
            Self::I64(a) => a.as_array().to_vec(),
            Self::List(v) => v.clone(),
        }
    }
}

fn to_i32(values: impl Iterator<Item = i64>) -> PyResult<Vec<i32>> {
    values
        .map(|v| {
            i32::try_from(v)
                .map_err(|_| PyValueError::new_err(format!("index {v} is outside int32")))
        })
        .collect()
}

/// sglang's `state_indices` for a send: one entry per state component,
/// each an index array or None.
pub fn state_lists(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Option<Vec<i64>>>> {
    let mut out = Vec::new();
    for (i, item) in obj.try_iter()?.enumerate() {
        let item = item?;
        if item.is_none() {
            out.push(None);
        } else {
            out.push(Some(
                Indices::extract(&item, &format!("state_indices[{i}]"))?.to_i64(),
            ));
        }
    }
    Ok(out)
}

/// sglang's `state_indices` for `send_metadata`: one list per component
/// (None: empty), as `i32`.
pub fn state_lists_i32(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Vec<i32>>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (i, item) in obj.try_iter()?.enumerate() {
        let item = item?;
        if item.is_none() {
            out.push(Vec::new());
        } else {
            let what = format!("state_indices[{i}]");
            out.push(Indices::extract(&item, &what)?.as_i32()?.into_owned());
        }
    }
    Ok(out)
}
