//! The exceptions the extension raises and the one mapping from the Rust
//! crates' errors to them ([`ToPyErr`]): every Rust error that crosses into
//! Python goes through here, carrying the error's text with its causes.
//!
//! Misused arguments (a pointer that is no int, lists of unequal length)
//! raise Python's own `TypeError` / `ValueError` where they are read; an
//! engine's runtime failures are Mooncake's return codes, not exceptions.
//!
//! **Never:** turns a Rust error into a Python one anywhere else.

use kvbridge_engine::SecretError;
use kvbridge_roles::{ConfigError, SendError, StartError};
use pyo3::PyErr;
use pyo3::exceptions::{PyRuntimeError, PyValueError};

use kvbridge_plan::PlanError as RustPlanError;
use kvbridge_plan::scenario::ScenarioError as RustScenarioError;

pyo3::create_exception!(
    kvbridge,
    ScenarioError,
    PyValueError,
    "The scenario is not in the `kvbridge plan` format (bad JSON, unknown key, out-of-format value)."
);
pyo3::create_exception!(
    kvbridge,
    PlanError,
    PyValueError,
    "The planner rejected the scenario (what `kvbridge plan` prints as {\"error\": ...})."
);
pyo3::create_exception!(
    kvbridge,
    KvArgsError,
    PyValueError,
    "sglang's KVArgs, parallel layout or settings cannot work with the kvbridge backend (inconsistent lists, ranks out of range, an unsupported feature, an unknown setting)."
);
pyo3::create_exception!(
    kvbridge,
    RoleStartError,
    PyRuntimeError,
    "A kvbridge role could not start (memory registration, control socket, bootstrap registration, threads)."
);
pyo3::create_exception!(
    kvbridge,
    KvSendError,
    PyRuntimeError,
    "A chunk was refused (send before init, more pages than announced, no aux index, manager stopped)."
);

/// Why `plan::plan_text` returned no blocks.
#[derive(Debug, thiserror::Error)]
pub enum PlanFailure {
    /// The scenario cannot be read (`kvbridge plan` exits 2).
    #[error(transparent)]
    Unreadable(#[from] RustScenarioError),
    /// The planner rejected it (`kvbridge plan` prints `{"error": ...}`).
    #[error(transparent)]
    Rejected(#[from] RustPlanError),
}

/// A Rust error as the Python exception it raises.
pub trait ToPyErr {
    /// The exception, with the error's text and causes.
    fn to_py_err(self) -> PyErr;
}

impl ToPyErr for PlanFailure {
    fn to_py_err(self) -> PyErr {
        match self {
            PlanFailure::Unreadable(e) => ScenarioError::new_err(e.to_string()),
            PlanFailure::Rejected(e) => PlanError::new_err(e.to_string()),
        }
    }
}

impl ToPyErr for ConfigError {
    fn to_py_err(self) -> PyErr {
        KvArgsError::new_err(crate::log::chain(&self))
    }
}

impl ToPyErr for StartError {
    fn to_py_err(self) -> PyErr {
        match self {
            StartError::Config(c) => c.to_py_err(),
            other => RoleStartError::new_err(crate::log::chain(&other)),
        }
    }
}

impl ToPyErr for SendError {
    fn to_py_err(self) -> PyErr {
        KvSendError::new_err(crate::log::chain(&self))
    }
}

impl ToPyErr for SecretError {
    fn to_py_err(self) -> PyErr {
        RoleStartError::new_err(format!(
            "loading the cluster secret: {}",
            crate::log::chain(&self)
        ))
    }
}

/// A role that could not start for a reason outside the Rust crates' error
/// types (`what` names the step, `e` says why).
pub fn role_start(what: impl std::fmt::Display, e: impl std::fmt::Display) -> PyErr {
    RoleStartError::new_err(format!("{what}: {e}"))
}
