//! `kvbridge._kvbridge.PrefillManager` / `KvSender`: the prefill role
//! (`kvbridge_roles::PrefillManager`) behind sglang's `KVManager` and
//! `KVSender` in PREFILL mode. Planning, transfers, probes and abort ACKs
//! run on the manager's Rust threads; a sender's `poll` reads the room
//! state those threads keep current.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvbridge_roles::{KvPoll, KvSender, PrefillManager};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::indices::{Indices, state_lists};
use super::inputs::role_inputs;
use crate::engine::PyTransferEngine;
use crate::errors::ToPyErr;

/// How often `status_changes` looks for a change while it waits.
const CHANGE_POLL: Duration = Duration::from_millis(1);

/// A running prefill role over this process's `kvbridge.TransferEngine`.
#[derive(Debug)]
#[pyclass(frozen, module = "kvbridge._kvbridge", name = "PrefillManager")]
pub struct PyPrefillManager {
    inner: Mutex<Option<Arc<PrefillManager>>>,
    kv_item_lens_sum: u64,
}

impl PyPrefillManager {
    fn manager(&self) -> PyResult<Arc<PrefillManager>> {
        lock(&self.inner)
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the prefill manager was torn down"))
    }
}

/// Locks `m`, recovering from a panic elsewhere (the data stays usable).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[pymethods]
impl PyPrefillManager {
    /// Registers the buffers `spec` (the role description JSON) names with
    /// `engine`, binds the control socket, registers with the bootstrap
    /// server and starts the role's threads. `config` is the prefill
    /// configuration JSON. Raises `KvArgsError` (the buffers or ranks do
    /// not fit together, or a feature is not supported) or `RoleStartError`.
    #[new]
    fn new(
        py: Python<'_>,
        engine: &Bound<'_, PyTransferEngine>,
        spec: &str,
        config: &str,
    ) -> PyResult<Self> {
        let inputs = role_inputs(spec, super::args::Side::Prefill)?;
        let mut config =
            super::config::prefill_config(config, inputs.secret).map_err(ToPyErr::to_py_err)?;
        config.kv_layout = inputs
            .spec
            .kv_layout_with(config.kv_layout.take())
            .map_err(ToPyErr::to_py_err)?;
        let kv_args = inputs.kv_args;
        let engine = engine.get().shared_engine()?;
        let kv_item_lens_sum = kv_args.layout.kv_item_lens.iter().sum();
        let manager = py
            .detach(|| {
                // SAFETY: the Python caller (`kvbridge.sglang_backend.KVManager`,
                // built by sglang's scheduler) registers sglang's KV, aux and
                // state pools, which sglang allocates once and keeps alive
                // for the whole process (as with Mooncake's
                // `batch_register_memory`, whose contract is the same); the
                // manager deregisters them when torn down or dropped, and
                // the shell tears it down before sglang may free them
                // (role switch, `teardown`). No pointer is dereferenced
                // here: the engine checks every transfer against the
                // registered regions.
                unsafe { PrefillManager::start(config, kv_args, engine) }
            })
            .map_err(ToPyErr::to_py_err)?;
        tracing::info!(
            session = manager.session_id(),
            rank_port = manager.rank_port(),
            "kvbridge prefill manager started"
        );
        Ok(Self {
            inner: Mutex::new(Some(Arc::new(manager))),
            kv_item_lens_sum,
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

    /// `(is_dummy_cp_rank, enable_all_cp_ranks_for_transfer)` of this rank.
    #[getter]
    fn cp_transfer(&self) -> PyResult<(bool, bool)> {
        Ok(self.manager()?.cp_transfer())
    }

    /// Sum of the KV buffers' bytes per page (sglang's `kv_item_lens_sum`).
    #[getter]
    fn kv_item_lens_sum(&self) -> u64 {
        self.kv_item_lens_sum
    }

    /// Whether transfers to `session` currently fail fast (blacklisted).
    fn is_blacklisted(&self, session: &str) -> PyResult<bool> {
        Ok(self.manager()?.is_blacklisted(session))
    }

    /// The room's state as an int (`KVPoll`), or None when unknown.
    fn room_status(&self, room: u64) -> PyResult<Option<i32>> {
        Ok(self.manager()?.room_status(room).map(poll_code))
    }

    /// Starts journaling room state changes (for `status_changes`).
    fn watch_statuses(&self) -> PyResult<()> {
        self.manager()?.watch_statuses();
        Ok(())
    }

    /// `[(room, KVPoll int or None when cleared)]` for the rooms whose state
    /// changed since the last call; waits (GIL released) up to `timeout_s`
    /// for a first change. Empty unless `watch_statuses` was called.
    fn status_changes(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Vec<(u64, Option<i32>)>> {
        let manager = self.manager()?;
        let wait = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::ZERO);
        let changes = py.detach(move || {
            let deadline = Instant::now() + wait;
            loop {
                let changes = manager.take_status_changes();
                if !changes.is_empty() || Instant::now() >= deadline {
                    return changes;
                }
                std::thread::sleep(CHANGE_POLL);
            }
        });
        Ok(changes
            .into_iter()
            .map(|(room, state)| (room, state.map(poll_code)))
            .collect())
    }

    /// The role's Prometheus metrics, as text.
    fn render_metrics(&self) -> PyResult<String> {
        Ok(self.manager()?.metrics().render())
    }

    /// A sender for `room` (the room becomes `Bootstrapping`).
    #[pyo3(signature = (room, dp_hinted = false))]
    fn sender(&self, room: u64, dp_hinted: bool) -> PyResult<PyKvSender> {
        let manager = self.manager()?;
        let sender = if dp_hinted {
            manager.sender_dp_hinted(room)
        } else {
            manager.sender(room)
        };
        Ok(PyKvSender {
            inner: Mutex::new(SenderState {
                sender,
                first_send: None,
                latency_s: None,
                bytes: None,
            }),
        })
    }

    /// Stops every thread, closes every socket and deregisters the memory
    /// (waits for them, GIL released). Idempotent; senders fail afterwards.
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

/// The `KVPoll` int of a state.
pub(crate) fn poll_code(p: KvPoll) -> i32 {
    match p {
        KvPoll::Failed => 0,
        KvPoll::Bootstrapping => 1,
        KvPoll::WaitingForInput => 2,
        KvPoll::Transferring => 3,
        KvPoll::Success => 4,
    }
}

#[derive(Debug)]
struct SenderState {
    sender: KvSender,
    /// When the first chunk with pages was queued.
    first_send: Option<Instant>,
    /// First chunk to `Success`, once seen.
    latency_s: Option<f64>,
    /// Payload bytes, snapshot once concluded or cleared.
    bytes: Option<u64>,
}

impl SenderState {
    fn snapshot(&mut self) {
        if self.bytes.is_none() {
            self.bytes = Some(self.sender.payload_bytes());
        }
    }
}

/// One room's sending side (`kvbridge_roles::KvSender`).
#[derive(Debug)]
#[pyclass(frozen, module = "kvbridge._kvbridge", name = "KvSender")]
pub struct PyKvSender {
    inner: Mutex<SenderState>,
}

#[pymethods]
impl PyKvSender {
    /// The room.
    #[getter]
    fn room(&self) -> u64 {
        lock(&self.inner).sender.room()
    }

    /// Announces the room's page count and aux row.
    #[pyo3(signature = (num_kv_indices, aux_index = None))]
    fn init(&self, num_kv_indices: u64, aux_index: Option<u64>) {
        lock(&self.inner).sender.init(num_kv_indices, aux_index);
    }

    /// Queues the next chunk of page indices (a 1-D int32 or int64 numpy
    /// array, read in place, or a list); the chunk completing the announced
    /// count is the last and also carries `state_indices` and aux.
    #[pyo3(signature = (kv_indices, state_indices = None, num_kv_tokens = None))]
    fn send(
        &self,
        py: Python<'_>,
        kv_indices: &Bound<'_, PyAny>,
        state_indices: Option<&Bound<'_, PyAny>>,
        num_kv_tokens: Option<u64>,
    ) -> PyResult<()> {
        let indices = Indices::extract(kv_indices, "kv_indices")?;
        let states = state_indices.map(state_lists).transpose()?;
        let pages = indices.as_i32()?;
        py.detach(|| {
            let mut st = lock(&self.inner);
            if st.first_send.is_none() && (!pages.is_empty() || states.is_some()) {
                st.first_send = Some(Instant::now());
            }
            st.sender.send(&pages, states, num_kv_tokens)
        })
        .map_err(ToPyErr::to_py_err)
    }

    /// The room's state as an int (`KVPoll`); a room stuck bootstrapping
    /// past its timeout fails here.
    fn poll(&self) -> i32 {
        let mut st = lock(&self.inner);
        let state = st.sender.poll();
        if state.is_terminal() {
            if state == KvPoll::Success && st.latency_s.is_none() {
                st.latency_s = st.first_send.map(|t| t.elapsed().as_secs_f64());
            }
            st.snapshot();
        }
        poll_code(state)
    }

    /// Tokens the decode already holds (consumed once).
    fn pop_decode_prefix_len(&self) -> u64 {
        lock(&self.inner).sender.pop_decode_prefix_len()
    }

    /// `(transfer_latency_s or None, transfer_total_bytes)`: first chunk to
    /// `Success`, and the KV and state bytes written for the room.
    fn transfer_metric(&self) -> (Option<f64>, u64) {
        let st = lock(&self.inner);
        let bytes = st.bytes.unwrap_or_else(|| st.sender.payload_bytes());
        (st.latency_s, bytes)
    }

    /// Fails the room with `reason` (a pipeline stage that never reported).
    fn fail(&self, reason: &str) {
        let mut st = lock(&self.inner);
        st.snapshot();
        st.sender.fail(reason);
    }

    /// Seconds since the sender was created.
    #[getter]
    fn age_s(&self) -> f64 {
        lock(&self.inner).sender.age().as_secs_f64()
    }

    /// Aborts the room from the prefill side.
    fn abort(&self) {
        let mut st = lock(&self.inner);
        st.snapshot();
        st.sender.abort();
    }

    /// Clears the room and returns `(reason, is_from_another_rank)` of its failure.
    fn failure(&self) -> (String, bool) {
        let mut st = lock(&self.inner);
        st.snapshot();
        let e = st.sender.failure_exception();
        (e.reason, e.is_from_another_rank)
    }

    /// Forgets the room (a pending abort ACK still goes out when it drains).
    fn clear(&self) {
        let mut st = lock(&self.inner);
        st.snapshot();
        st.sender.clear();
    }
}
