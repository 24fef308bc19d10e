//! # kvbridge-py
//!
//! The Python bindings (`import kvbridge`, built by maturin as the
//! extension module `kvbridge._kvbridge`): a thin shell over the Rust
//! crates for Python programs, chiefly sglang.
//!
//! * [`engine::PyTransferEngine`] (`kvbridge.TransferEngine`): Mooncake's
//!   `TransferEngine` API as sglang's Mooncake connector calls it (same
//!   arguments, return codes and session-id form) over a kvbridge engine
//!   built by `kvbridge_engine::factory` (`protocol` picks it: see
//!   [`options`]).
//! * [`plan::plan`] (`kvbridge.plan`): the planner on one scenario of the
//!   `kvbridge plan` format, blocks returned as a numpy array.
//! * [`roles`]: the Rust prefill/decode roles and bootstrap server behind
//!   sglang's transfer-backend classes (`kvbridge.sglang_backend`).
//! * [`errors`]: the exceptions, and the one mapping of Rust errors to them.
//!
//! **Owns:** turning Python arguments into Rust values (pointers, lists,
//! scenario JSON), Mooncake's conventions (codes vs. exceptions), the
//! `initialize` → engine configuration mapping, releasing the GIL around
//! every engine call, and log routing for the extension.
//!
//! **Never:** moves bytes, plans or checks memory itself (the engine and
//! planner crates do), panics on a Python argument, holds the GIL while an
//! engine call blocks, or enables pyo3's `extension-module` feature from
//! Cargo (maturin does, so `cargo test` links libpython).

pub mod engine;
pub mod errors;
pub mod log;
pub mod options;
pub mod plan;
pub mod ptrs;
pub mod roles;

use pyo3::prelude::*;

/// The extension module `kvbridge._kvbridge` (re-exported by `kvbridge`).
#[pymodule]
fn _kvbridge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    log::init();
    let py = m.py();
    m.add_class::<engine::PyTransferEngine>()?;
    m.add_function(wrap_pyfunction!(plan::plan, m)?)?;
    roles::register(m)?;
    m.add("PlanError", py.get_type::<errors::PlanError>())?;
    m.add("ScenarioError", py.get_type::<errors::ScenarioError>())?;
    m.add("KvArgsError", py.get_type::<errors::KvArgsError>())?;
    m.add("RoleStartError", py.get_type::<errors::RoleStartError>())?;
    m.add("KvSendError", py.get_type::<errors::KvSendError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
