//! `kvbridge.TransferEngine`: the surface of Mooncake's
//! `mooncake.engine.TransferEngine` that sglang's connector calls, with
//! Mooncake's arguments and return conventions, over a kvbridge engine.
//!
//! Conventions (as Mooncake): runtime failures — a peer unreachable or
//! refusing, memory not registered, an engine that fails to start — are
//! return codes (0 ok, [`ERR`] on failure, the Rust error logged); misuse —
//! a call before `initialize`, lists of different lengths, a pointer that
//! is no integer — raises (`RuntimeError`, `ValueError`, `TypeError`).
//! Every call that registers, transfers or probes releases the GIL.
//!
//! **Never:** plans, retries or interprets transfers (that is the engine's
//! and sglang's job), or keeps a Python object beyond a call.

use std::error::Error as StdError;
use std::sync::{Arc, OnceLock};

use kvbridge_engine::factory::{self, Transport};
use kvbridge_engine::secret::{self, ClusterSecret};
use kvbridge_engine::{Block, TransferEngine as Engine};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::options::{self, InitError};
use crate::ptrs;

/// The code Mooncake returns for a failed call; kvbridge returns it for
/// every runtime failure (the reason goes to the log).
pub const ERR: i32 = -1;

/// A started engine.
#[derive(Debug)]
struct Started {
    engine: Arc<dyn Engine>,
    transport: Transport,
}

/// A transfer engine with Mooncake's Python API (`from kvbridge import
/// TransferEngine`); one per process, like sglang's.
#[pyclass(frozen, module = "kvbridge._kvbridge", name = "TransferEngine")]
#[derive(Debug, Default)]
pub struct PyTransferEngine {
    started: OnceLock<Started>,
}

impl PyTransferEngine {
    /// The started engine, shared with the role managers built over it
    /// (`kvbridge.sglang_backend`): one engine per process, as sglang's.
    pub(crate) fn shared_engine(&self) -> PyResult<Arc<dyn Engine>> {
        self.engine().cloned()
    }

    fn engine(&self) -> PyResult<&Arc<dyn Engine>> {
        self.started
            .get()
            .map(|s| &s.engine)
            .ok_or_else(|| PyRuntimeError::new_err("TransferEngine is not initialized"))
    }
}

#[pymethods]
impl PyTransferEngine {
    /// An engine that does nothing until `initialize`.
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Start the engine: listen on `local_hostname` (a port in it, else
    /// `KVBRIDGE_ENGINE_PORT`, else a free one) with the transport for
    /// `protocol` (`tcp`; `rdma` → UCX; `nvlink`/`nvlink_intra` → CUDA IPC;
    /// `MC_FORCE_TCP=1` → tcp). 0 on success, -1 when it cannot start.
    #[pyo3(signature = (local_hostname, metadata_server = "P2PHANDSHAKE", protocol = "tcp", device_name = ""))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> PyResult<i32> {
        if self.started.get().is_some() {
            return Err(PyRuntimeError::new_err(
                "TransferEngine is already initialized",
            ));
        }
        let started = py.detach(|| -> Result<Started, InitError> {
            let secret = ClusterSecret::from_env()?;
            let env = |k: &str| std::env::var(k).ok();
            let plan = options::plan_engine(
                local_hostname,
                metadata_server,
                protocol,
                device_name,
                &env,
                secret.as_ref(),
            )?;
            if secret.is_none() {
                secret::warn_open_mode("python TransferEngine");
            }
            let engine = factory::build(plan.transport, &plan.config)?;
            tracing::info!(
                session = engine.session_id(),
                transport = %plan.transport,
                protocol,
                "transfer engine started"
            );
            Ok(Started {
                engine,
                transport: plan.transport,
            })
        });
        match started {
            Ok(s) => match self.started.set(s) {
                Ok(()) => Ok(0),
                Err(_) => Err(PyRuntimeError::new_err(
                    "TransferEngine is already initialized",
                )),
            },
            Err(e) => Ok(fail(py, "initialize", &e)),
        }
    }

    /// The port peers reach this engine on (the session id is
    /// `f"{hostname}:{port}"`, IPv6 bracketed).
    fn get_rpc_port(&self) -> PyResult<u16> {
        let session = self.engine()?.session_id();
        session
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .ok_or_else(|| PyRuntimeError::new_err(format!("session id {session:?} has no port")))
    }

    /// This engine's session id, `"host:port"`.
    fn get_session_id(&self) -> PyResult<String> {
        Ok(self.engine()?.session_id().to_owned())
    }

    /// The kvbridge transport running (`"tcp"`, `"ucx"` or `"ipc"`).
    #[getter]
    fn transport(&self) -> PyResult<&'static str> {
        let s = self.started.get();
        s.map(|s| s.transport.name())
            .ok_or_else(|| PyRuntimeError::new_err("TransferEngine is not initialized"))
    }

    /// Register one region (see `batch_register_memory`). 0 or -1.
    #[pyo3(signature = (buffer_addr, capacity))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: &Bound<'_, PyAny>,
        capacity: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let region = (
            ptrs::address(buffer_addr, "buffer_addr")?,
            ptrs::length(capacity, "capacity")?,
        );
        self.register(py, vec![region])
    }

    /// Deregister the region starting at `buffer_addr`. 0 or -1.
    #[pyo3(signature = (buffer_addr))]
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: &Bound<'_, PyAny>) -> PyResult<i32> {
        let addr = ptrs::address(buffer_addr, "buffer_addr")?;
        self.deregister(py, vec![addr])
    }

    /// Register `(buffer_addresses[i], capacities[i])` regions, all or
    /// none, so peers may write into them and local transfers read from
    /// them. 0 or -1. The caller keeps the memory alive until it is
    /// unregistered (as with Mooncake). On the CUDA IPC transport, regions
    /// in host memory are left out with a warning naming them (the device
    /// ones are registered) and the call returns -1.
    #[pyo3(signature = (buffer_addresses, capacities))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
        capacities: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let addrs = ptrs::addresses(buffer_addresses, "buffer_addresses")?;
        let lens = ptrs::lengths(capacities, "capacities")?;
        same_len(&[
            ("buffer_addresses", addrs.len()),
            ("capacities", lens.len()),
        ])?;
        self.register(py, addrs.into_iter().zip(lens).collect())
    }

    /// Deregister the regions starting at `buffer_addresses`; returns once
    /// no transfer touches them. 0 or -1.
    #[pyo3(signature = (buffer_addresses))]
    fn batch_unregister_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let addrs = ptrs::addresses(buffer_addresses, "buffer_addresses")?;
        self.deregister(py, addrs)
    }

    /// Copy `length` bytes from local `buffer` to `peer_buffer_address` at
    /// session `target_hostname`. 0, or -1 on failure.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let block = Block::new(
            ptrs::address(buffer, "buffer")?,
            ptrs::address(peer_buffer_address, "peer_buffer_address")?,
            ptrs::length(length, "length")?,
        );
        self.transfer(py, target_hostname, &[block])
    }

    /// Copy `lengths[i]` bytes from local `buffers[i]` to
    /// `peer_buffer_addresses[i]` at session `target_hostname`; returns when
    /// every byte is in the peer's memory (0) or on the first failure (-1).
    /// Safe to call from several threads at once.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let srcs = ptrs::addresses(buffers, "buffers")?;
        let dsts = ptrs::addresses(peer_buffer_addresses, "peer_buffer_addresses")?;
        let lens = ptrs::lengths(lengths, "lengths")?;
        same_len(&[
            ("buffers", srcs.len()),
            ("peer_buffer_addresses", dsts.len()),
            ("lengths", lens.len()),
        ])?;
        let blocks: Vec<Block> = srcs
            .into_iter()
            .zip(dsts)
            .zip(lens)
            .map(|((s, d), l)| Block::new(s, d, l))
            .collect();
        self.transfer(py, target_hostname, &blocks)
    }

    /// Whether `peer_session_id` answers now (fresh connection and
    /// handshake): 0 if it does, -1 if not.
    #[pyo3(signature = (peer_session_id))]
    fn send_probe(&self, py: Python<'_>, peer_session_id: &str) -> PyResult<i32> {
        let engine = self.engine()?;
        let result = py.detach(|| engine.probe(peer_session_id));
        Ok(code(py, "send_probe", result))
    }

    fn __repr__(&self) -> String {
        match self.started.get() {
            Some(s) => format!(
                "kvbridge.TransferEngine(session={:?}, transport={:?})",
                s.engine.session_id(),
                s.transport.name()
            ),
            None => "kvbridge.TransferEngine(<not initialized>)".into(),
        }
    }
}

impl PyTransferEngine {
    fn register(&self, py: Python<'_>, regions: Vec<(u64, u64)>) -> PyResult<i32> {
        let engine = self.engine()?;
        let (regions, left_out) = split_device(engine.moves_host_memory(), regions, |r| r.0);
        if !left_out.is_empty() {
            let shown: Vec<String> = left_out
                .iter()
                .take(4)
                .map(|(a, l)| format!("{a:#x}+{l}"))
                .collect();
            let msg = format!(
                "batch_register_memory: {} region(s) not registered ({}{}): the CUDA IPC transport \
                 moves device memory only, so peers cannot write into them and transfers from \
                 them fail; the device regions are registered. Under sglang's Mooncake connector \
                 set SGLANG_MOONCAKE_SEND_AUX_TCP=1 (aux rows live in host memory).",
                left_out.len(),
                shown.join(", "),
                if left_out.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                },
            );
            tracing::warn!("{msg}");
            crate::log::to_python(py, &msg);
        }
        if regions.is_empty() {
            return Ok(ERR);
        }
        // SAFETY: Mooncake's contract, which sglang (the caller) keeps: the
        // regions it registers are live buffers (its KV, aux and state
        // pools) that stay allocated until it unregisters them, and it does
        // not write the bytes of a transfer while the transfer runs. This
        // binding cannot check either from a pointer; docs/python.md states
        // the contract for every caller.
        let result = py.detach(|| unsafe { engine.batch_register(&regions) });
        match code(py, "batch_register_memory", result) {
            0 if !left_out.is_empty() => Ok(ERR),
            c => Ok(c),
        }
    }

    fn deregister(&self, py: Python<'_>, addrs: Vec<u64>) -> PyResult<i32> {
        let engine = self.engine()?;
        // What `register` left out was never registered: not an error.
        let (addrs, _) = split_device(engine.moves_host_memory(), addrs, |a| *a);
        if addrs.is_empty() {
            return Ok(0);
        }
        let result = py.detach(|| engine.batch_deregister(&addrs));
        Ok(code(py, "batch_unregister_memory", result))
    }

    fn transfer(&self, py: Python<'_>, session: &str, blocks: &[Block]) -> PyResult<i32> {
        let engine = self.engine()?;
        let result = py.detach(|| engine.batch_transfer_sync(session, blocks));
        Ok(code(py, "batch_transfer_sync_write", result))
    }
}

/// On a transport that moves device memory only (`moves_host_memory` false):
/// the items whose address is device memory, and the rest; otherwise all.
fn split_device<T>(moves_host: bool, items: Vec<T>, addr: impl Fn(&T) -> u64) -> (Vec<T>, Vec<T>) {
    if moves_host {
        return (items, Vec::new());
    }
    items.into_iter().partition(|i| {
        matches!(
            kvbridge_mem::probe_kind(addr(i)),
            kvbridge_mem::MemoryKind::Device { .. }
        )
    })
}

/// `ValueError` unless every named list has the first one's length.
fn same_len(lists: &[(&str, usize)]) -> PyResult<()> {
    match lists.split_first() {
        Some((&(first, n), rest)) => match rest.iter().find(|(_, m)| *m != n) {
            Some(&(other, m)) => Err(PyValueError::new_err(format!(
                "{first} has {n} entries but {other} has {m}"
            ))),
            None => Ok(()),
        },
        None => Ok(()),
    }
}

/// 0 for `Ok`, else [`fail`].
fn code<E: StdError>(py: Python<'_>, call: &str, result: Result<(), E>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => fail(py, call, &e),
    }
}

/// Logs `err` (with its causes) and returns [`ERR`].
fn fail(py: Python<'_>, call: &str, err: &dyn StdError) -> i32 {
    let msg = crate::log::chain(err);
    tracing::warn!(call, "{msg}");
    crate::log::to_python(py, &format!("{call} failed: {msg}"));
    ERR
}
