//! The exceptions the role bindings raise, each carrying the Rust error's
//! text (with its causes).

use kvbridge_engine::ClusterSecret;
use kvbridge_roles::{ConfigError, KvArgs, SendError, StartError};

use super::args::{RoleSpec, Side};
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

/// What both managers start from, read from the role description and
/// the environment.
#[derive(Debug)]
pub struct RoleInputs {
    /// The role description, as parsed.
    pub spec: RoleSpec,
    /// Its `KvArgs` for the role's side.
    pub kv_args: KvArgs,
    /// The cluster secret from the environment.
    pub secret: Option<ClusterSecret>,
}

/// The role description's `KvArgs` for `side` and the cluster secret from
/// the environment, as Python exceptions on failure.
pub fn role_inputs(spec: &str, side: Side) -> Result<RoleInputs, PyErr> {
    let spec = RoleSpec::from_json(spec).map_err(config_error)?;
    let kv_args = spec.to_kv_args(side).map_err(config_error)?;
    let secret = ClusterSecret::from_env()
        .map_err(|e| RoleStartError::new_err(format!("loading the cluster secret: {e}")))?;
    Ok(RoleInputs {
        spec,
        kv_args,
        secret,
    })
}

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
