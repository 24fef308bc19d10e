//! `kvbridge._kvbridge.BootstrapServer`: kvbridge's bootstrap HTTP server
//! (`kvbridge_roles::bootstrap::BootstrapServer`, sglang's routes and JSON)
//! behind sglang's `KVBootstrapServer`, serving on a Rust thread.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

use kvbridge_roles::bootstrap::{BootstrapConfig, BootstrapServer};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::prefill::lock;
use crate::errors::{ToPyErr, role_start};

/// A running bootstrap server.
#[derive(Debug)]
#[pyclass(frozen, module = "kvbridge._kvbridge", name = "BootstrapServer")]
pub struct PyBootstrapServer {
    inner: Mutex<Option<BootstrapServer>>,
    addr: SocketAddr,
}

/// The first address `host:port` resolves to (`0.0.0.0`, `::`, names).
fn resolve(host: &str, port: u16) -> PyResult<SocketAddr> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host, port)
        .to_socket_addrs()
        .map_err(|e| role_start(format_args!("bootstrap host {host:?}"), e))?
        .next()
        .ok_or_else(|| role_start(format_args!("bootstrap host {host:?}"), "no address"))
}

#[pymethods]
impl PyBootstrapServer {
    /// Binds `host:port` and serves on a thread of its own. With a cluster
    /// secret in the environment every write must be signed; otherwise it
    /// runs in sglang-compatible open mode. `cleanup_interval_s` is the
    /// age limit of `register_dp_rank` entries (0: the default).
    #[new]
    #[pyo3(signature = (host, port, cleanup_interval_s = 0.0))]
    fn new(py: Python<'_>, host: &str, port: u16, cleanup_interval_s: f64) -> PyResult<Self> {
        let addr = resolve(host, port)?;
        let secret = kvbridge_engine::ClusterSecret::from_env().map_err(ToPyErr::to_py_err)?;
        let cleanup = Duration::try_from_secs_f64(cleanup_interval_s)
            .map_err(|e| role_start(format_args!("cleanup interval {cleanup_interval_s}"), e))?;
        let open = secret.is_none();
        let config = BootstrapConfig {
            secret,
            cleanup_interval: cleanup,
            ..BootstrapConfig::default()
        };
        let server = py
            .detach(|| BootstrapServer::start_with(addr, config))
            .map_err(|e| role_start(format_args!("bootstrap server on {addr}"), e))?;
        if open {
            kvbridge_engine::secret::warn_open_mode("bootstrap server");
        }
        let addr = server.local_addr();
        Ok(Self {
            inner: Mutex::new(Some(server)),
            addr,
        })
    }

    /// `(host, port)` the server listens on.
    #[getter]
    fn address(&self) -> (String, u16) {
        (self.addr.ip().to_string(), self.addr.port())
    }

    /// Whether every expected prefill rank has registered.
    fn is_ready(&self) -> PyResult<bool> {
        lock(&self.inner)
            .as_ref()
            .map(BootstrapServer::is_ready)
            .ok_or_else(|| PyRuntimeError::new_err("the bootstrap server was closed"))
    }

    /// Whether the server is still serving.
    fn is_alive(&self) -> bool {
        lock(&self.inner).is_some()
    }

    /// Stops serving and waits for the server thread (GIL released).
    fn close(&self, py: Python<'_>) {
        let server = lock(&self.inner).take();
        if let Some(s) = server {
            py.detach(move || s.shutdown());
        }
    }
}
