//! The Rust roles (`kvbridge_roles`) for sglang's transfer-backend
//! contract: the classes `kvbridge.sglang_backend`'s `KVManager`,
//! `KVSender`, `KVReceiver` and `KVBootstrapServer` are thin shells over.
//!
//! * [`prefill::PyPrefillManager`] / [`prefill::PyKvSender`],
//!   [`decode::PyDecodeManager`] / [`decode::PyKvReceiver`],
//!   [`bootstrap::PyBootstrapServer`]: one Python object per Rust role;
//!   every call that can block (start-up, HTTP, zmq sends, teardown)
//!   releases the GIL, and `poll` reads state the roles' threads keep.
//! * [`args`]: sglang's `KVArgs` + parallel layout → [`kvbridge_roles::KvArgs`];
//!   [`config`]: the shell's settings → the roles' configurations; both
//!   pure and unit-tested, refusing what cannot work at start.
//! * [`indices`]: index arrays read in place; [`inputs`]: what a manager
//!   starts from (exceptions: `crate::errors`).
//!
//! **Never:** plans, moves bytes or keeps room state in Python objects (the
//! roles do), or holds the GIL while a role blocks.

pub mod args;
pub mod bootstrap;
pub mod config;
pub mod decode;
pub mod indices;
pub mod inputs;
pub mod prefill;

use pyo3::prelude::*;

/// Adds the role classes to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<prefill::PyPrefillManager>()?;
    m.add_class::<prefill::PyKvSender>()?;
    m.add_class::<decode::PyDecodeManager>()?;
    m.add_class::<decode::PyKvReceiver>()?;
    m.add_class::<bootstrap::PyBootstrapServer>()?;
    Ok(())
}
