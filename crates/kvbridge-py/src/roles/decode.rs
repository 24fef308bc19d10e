//! `kvbridge._kvbridge.DecodeManager` / `KvReceiver`: the decode role
//! (`kvbridge_roles::DecodeManager`) behind sglang's `KVManager` and
//! `KVReceiver` in DECODE mode. Status, aux and state messages, heartbeats
//! and abort ACKs are handled on the manager's Rust threads; a receiver's
//! `poll` reads the room state they keep current.

use std::sync::{Arc, Mutex};

use kvbridge_roles::{DecodeManager, KvReceiver};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::indices::{Indices, state_lists_i32};
use super::inputs::role_inputs;
use super::prefill::{lock, poll_code};
use crate::engine::PyTransferEngine;
use crate::errors::ToPyErr;

/// A running decode role over this process's `kvbridge.TransferEngine`.
#[derive(Debug)]
#[pyclass(frozen, module = "kvbridge._kvbridge", name = "DecodeManager")]
pub struct PyDecodeManager {
    inner: Mutex<Option<Arc<DecodeManager>>>,
}

impl PyDecodeManager {
    fn manager(&self) -> PyResult<Arc<DecodeManager>> {
        lock(&self.inner)
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the decode manager was torn down"))
    }
}

#[pymethods]
impl PyDecodeManager {
    /// Registers the buffers `spec` (the role description JSON) names with
    /// `engine`, binds the control socket and starts the receive and
    /// heartbeat threads. `config` is the decode configuration JSON.
    #[new]
    fn new(
        py: Python<'_>,
        engine: &Bound<'_, PyTransferEngine>,
        spec: &str,
        config: &str,
    ) -> PyResult<Self> {
        let inputs = role_inputs(spec, super::args::Side::Decode)?;
        let mut config =
            super::config::decode_config(config, inputs.secret).map_err(ToPyErr::to_py_err)?;
        config.kv_layout = inputs
            .spec
            .kv_layout_with(config.kv_layout.take())
            .map_err(ToPyErr::to_py_err)?;
        let kv_args = inputs.kv_args;
        let engine = engine.get().shared_engine()?;
        let manager = py
            .detach(|| {
                // SAFETY: the Python caller (`kvbridge.sglang_backend.KVManager`,
                // built by sglang's scheduler) registers sglang's KV, aux and
                // state pools, which sglang allocates once and keeps alive
                // for the whole process, as Mooncake's `batch_register_memory`
                // requires too; prefill ranks write into them only within
                // the registered regions (the engine checks every write),
                // and the manager deregisters them when torn down or dropped.
                unsafe { DecodeManager::start(config, kv_args, engine) }
            })
            .map_err(ToPyErr::to_py_err)?;
        tracing::info!(
            session = manager.session_id(),
            rank_port = manager.rank_port(),
            "kvbridge decode manager started"
        );
        Ok(Self {
            inner: Mutex::new(Some(Arc::new(manager))),
        })
    }

    /// The port of this rank's zmq control socket.
    #[getter]
    fn rank_port(&self) -> PyResult<u16> {
        Ok(self.manager()?.rank_port())
    }

    /// The transfer engine's session id (`host:port`).
    #[getter]
    fn session_id(&self) -> PyResult<String> {
        Ok(self.manager()?.session_id().to_owned())
    }

    /// One attempt to resolve the prefill server at `bootstrap_addr` (HTTP,
    /// GIL released): True once resolved, False while it is not (yet)
    /// registered. A topology that can never pair with ours is logged as
    /// an error and answers False (sglang then gives up on its requests).
    fn try_ensure_parallel_info(&self, py: Python<'_>, bootstrap_addr: &str) -> PyResult<bool> {
        let m = self.manager()?;
        Ok(
            match py.detach(|| m.try_ensure_parallel_info(bootstrap_addr)) {
                Ok(ready) => ready,
                Err(reason) => {
                    tracing::error!(%bootstrap_addr, %reason, "cannot pair with this prefill server");
                    crate::log::to_python(py, &format!("{bootstrap_addr}: {reason}"));
                    false
                }
            },
        )
    }

    /// `(dp_size, follow_bootstrap_room)` of a resolved prefill server, or None.
    fn prefill_summary(&self, bootstrap_addr: &str) -> PyResult<Option<(u64, bool)>> {
        Ok(self
            .manager()?
            .prefill_summary(bootstrap_addr)
            .map(|s| (s.dp_size, s.follow_bootstrap_room)))
    }

    /// Hands over the KV head counts sglang sets on `KVArgs` after creating
    /// the manager (`kv_head_num`: heads on this rank; `total_kv_head_num`:
    /// the model's, None or 0 if unknown), which staging needs. Raises
    /// `KvArgsError` for counts that cannot be right.
    #[pyo3(signature = (kv_head_num, total_kv_head_num = None))]
    fn set_kv_heads(&self, kv_head_num: u64, total_kv_head_num: Option<u64>) -> PyResult<()> {
        self.manager()?
            .set_kv_heads(kv_head_num, total_kv_head_num.unwrap_or(0))
            .map_err(ToPyErr::to_py_err)
    }

    /// `(address, length)` of the staging ring when staging is on, else None.
    fn staging_ring(&self) -> PyResult<Option<(u64, u64)>> {
        Ok(self.manager()?.staging_ring())
    }

    /// Staging ring allocations held (None without a ring).
    fn staging_allocations(&self) -> PyResult<Option<usize>> {
        Ok(self.manager()?.staging_allocations())
    }

    /// The role's Prometheus metrics, as text.
    fn render_metrics(&self) -> PyResult<String> {
        Ok(self.manager()?.metrics().render())
    }

    /// A receiver for `room`, whose KV comes from the prefill server whose
    /// bootstrap server is `bootstrap_addr` (the room becomes `Bootstrapping`).
    fn receiver(&self, bootstrap_addr: &str, room: u64) -> PyResult<PyKvReceiver> {
        let receiver = self.manager()?.receiver(bootstrap_addr, room);
        Ok(PyKvReceiver {
            inner: Mutex::new(receiver),
        })
    }

    /// Stops every thread, closes every socket and deregisters the memory
    /// (GIL released). Idempotent; receivers report Failed afterwards.
    fn teardown(&self, py: Python<'_>) {
        let manager = lock(&self.inner).take();
        if let Some(m) = manager {
            py.detach(move || match Arc::try_unwrap(m) {
                Ok(m) => m.teardown(),
                Err(shared) => drop(shared),
            });
        }
    }
}

/// One room's receiving side (`kvbridge_roles::KvReceiver`).
#[derive(Debug)]
#[pyclass(frozen, module = "kvbridge._kvbridge", name = "KvReceiver")]
pub struct PyKvReceiver {
    inner: Mutex<KvReceiver>,
}

#[pymethods]
impl PyKvReceiver {
    /// The room.
    #[getter]
    fn room(&self) -> u64 {
        lock(&self.inner).room()
    }

    /// Resolves the room's prefill ranks (HTTP, GIL released; cached per
    /// prefill server) and registers this rank's buffers with them once.
    /// Returns the room's state (`KVPoll` int).
    fn init(&self, py: Python<'_>, prefill_dp_rank: u64) -> i32 {
        poll_code(py.detach(|| lock(&self.inner).init(prefill_dp_rank)))
    }

    /// `(ip, port)` of every prefill rank the room talks to (empty until `init`).
    fn bootstrap_infos(&self) -> Vec<(String, u16)> {
        lock(&self.inner)
            .bootstrap_infos()
            .map(|infos| {
                infos
                    .iter()
                    .map(|i| (i.rank_ip.clone(), i.rank_port))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Tells every prefill rank where the room's KV goes: `kv_indices` (a
    /// 1-D int32 array, read in place), the aux row and per-component state
    /// indices (zmq sends, GIL released). Returns the room's state.
    ///
    /// A HiSparse decode of a compressed-MLA pool also passes
    /// `device_kv_indices`: then `kv_indices` are the host pages of its C4
    /// KV buffers and `device_kv_indices` its pages in every other KV
    /// buffer. On a pool without compression ratios the room fails, with
    /// the reason.
    #[pyo3(signature = (
        kv_indices, aux_index, state_indices = None, decode_prefix_len = None,
        device_kv_indices = None
    ))]
    fn send_metadata(
        &self,
        py: Python<'_>,
        kv_indices: &Bound<'_, PyAny>,
        aux_index: u64,
        state_indices: Option<&Bound<'_, PyAny>>,
        decode_prefix_len: Option<u64>,
        device_kv_indices: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i32> {
        let indices = Indices::extract(kv_indices, "kv_indices")?;
        let pages = indices.as_i32()?;
        let device = device_kv_indices
            .map(|d| Indices::extract(d, "device_kv_indices"))
            .transpose()?;
        let device_pages = device.as_ref().map(Indices::as_i32).transpose()?;
        let states = state_lists_i32(state_indices)?;
        Ok(poll_code(py.detach(|| {
            let mut rx = lock(&self.inner);
            match &device_pages {
                None => rx.send_metadata(&pages, aux_index, &states, decode_prefix_len),
                Some(device) => {
                    rx.send_metadata_hisparse(&pages, device, aux_index, &states, decode_prefix_len)
                }
            }
        })))
    }

    /// The room's state (`KVPoll` int); a room waiting past its timeout
    /// fails here, and a failed room tells its prefill ranks to stop.
    fn poll(&self, py: Python<'_>) -> i32 {
        poll_code(py.detach(|| lock(&self.inner).poll()))
    }

    /// Aborts the room here and tells every prefill rank (GIL released).
    fn abort(&self, py: Python<'_>) {
        py.detach(|| lock(&self.inner).abort());
    }

    /// Whether the prefill ranks were told to stop writing the room's pages.
    #[getter]
    fn abort_notified(&self) -> bool {
        lock(&self.inner).abort_notified()
    }

    /// Tells the room's prefill ranks to stop writing its pages, once.
    fn notify_abort(&self, py: Python<'_>) {
        py.detach(|| lock(&self.inner).notify_abort());
    }

    /// Whether every prefill rank that could write the room's pages has
    /// acknowledged the abort (or was fenced): only then may they be reused.
    fn abort_acknowledged(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.inner).abort_acknowledged())
    }

    /// `(reason, is_from_another_rank)` of the room's failure; the room
    /// stays known (its abort ACKs still count) until `clear`.
    fn failure(&self) -> (String, bool) {
        let e = lock(&self.inner).take_failure();
        (e.reason, e.is_from_another_rank)
    }

    /// Forgets the room.
    fn clear(&self) {
        lock(&self.inner).clear();
    }
}
