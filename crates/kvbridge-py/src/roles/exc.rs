//! The exceptions the role bindings raise, each carrying the Rust error's
//! text (with its causes).

use kvbridge_roles::{ConfigError, SendError, StartError};
use pyo3::PyErr;

pyo3::create_exception!(
    kvbridge,
    KvArgsError,
    pyo3::exceptions::PyValueError,
    "sglang's KVArgs, parallel layout or settings cannot work with the kvbridge backend (inconsistent lists, ranks out of range, an unsupported feature, an unknown setting)."
);
pyo3::create_exception!(
    kvbridge,
    RoleStartError,
    pyo3::exceptions::PyRuntimeError,
    "A kvbridge role could not start (memory registration, control socket, bootstrap registration, threads)."
);
pyo3::create_exception!(
    kvbridge,
    KvSendError,
    pyo3::exceptions::PyRuntimeError,
    "A chunk was refused (send before init, more pages than announced, no aux index, manager stopped)."
);

/// A configuration or layout error as `KvArgsError`.
pub fn config_error(e: ConfigError) -> PyErr {
    KvArgsError::new_err(crate::log::chain(&e))
}

/// A start-up failure: layout problems as `KvArgsError`, the rest as `RoleStartError`.
pub fn start_error(e: StartError) -> PyErr {
    match e {
        StartError::Config(c) => config_error(c),
        other => RoleStartError::new_err(crate::log::chain(&other)),
    }
}

/// A refused chunk as `KvSendError`.
pub fn send_error(e: SendError) -> PyErr {
    KvSendError::new_err(e.to_string())
}
