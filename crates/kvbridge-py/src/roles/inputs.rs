//! What both managers start from: the role description's `KvArgs` for
//! their side and the cluster secret from the environment.

use kvbridge_engine::ClusterSecret;
use kvbridge_roles::KvArgs;
use pyo3::PyErr;

use super::args::{RoleSpec, Side};
use crate::errors::ToPyErr;

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
    let spec = RoleSpec::from_json(spec).map_err(ToPyErr::to_py_err)?;
    let kv_args = spec.to_kv_args(side).map_err(ToPyErr::to_py_err)?;
    let secret = ClusterSecret::from_env().map_err(ToPyErr::to_py_err)?;
    Ok(RoleInputs {
        spec,
        kv_args,
        secret,
    })
}
