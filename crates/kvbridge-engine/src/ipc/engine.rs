//! [`IpcEngine`]: the engine handle, per-session state and completion threads.
//!
//! A batch is prepared and launched in the submitting thread (under the
//! session's lock): connect, check, translate and pack (one pass, on the
//! preparation threads for large batches, each slice uploaded as soon as
//! it is packed), hold what it writes, launch; `submit` returns while
//! the copy runs. The session's completion thread waits for each batch's
//! event in order, recycles its descriptor slot and completes its handle.
//!
//! Holds: a session keeps the peer's regions it copied into *held*
//! (`Lease`, one round trip the first time) across batches; the peer
//! revokes a hold when it deregisters the region, and the session answers
//! (`Release`) once its copies in flight finished: checked before every
//! launch, and every few milliseconds by the completion thread while the
//! session is idle. An idle session releases its holds after a while.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use kvbridge_mem::cuda::{self, IpcHandle};
use kvbridge_mem::{MemError, MemoryKind, Region};
use parking_lot::Mutex;

use super::peer::PeerState;
use super::pipe::{Counters, InFlight, Pipe, Shared};
use super::schedule::CopyTuning;
use super::table::{self, Export};
use crate::session::control::ControlHost;
use crate::tcp::EngineHost;
use crate::{Batch, BatchHandle, EngineConfig, ErrorKind, Target, TransferEngine, TransferError};

/// How often an idle session holding regions looks for revokes.
const IDLE_TICK: Duration = Duration::from_millis(2);
/// A peer session: its state, its completion thread's queue, its pipe.
#[derive(Debug)]
struct Session {
    state: Arc<Mutex<PeerState>>,
    tx: Sender<InFlight>,
    pipe: Arc<Pipe>,
}

/// The CUDA IPC transfer engine. See the module docs.
#[derive(Debug)]
pub struct IpcEngine {
    shared: Arc<Shared>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl IpcEngine {
    /// Start the engine (control port from `cfg`); fails cleanly without CUDA.
    pub fn new(cfg: EngineConfig, tuning: CopyTuning) -> std::io::Result<Self> {
        if !cuda::available() {
            return Err(std::io::Error::other(format!(
                "the ipc engine needs a GPU: no CUDA ({})",
                cuda::unavailable_reason().unwrap_or("unknown")
            )));
        }
        let host = EngineHost::start(cfg, false)?;
        // Until something is registered, peers read an empty table (not a
        // missing one, which they would refuse as malformed).
        host.set_exports(table::encode(&[]));
        Ok(Self {
            shared: Arc::new(Shared {
                host,
                tuning,
                counters: Counters::default(),
            }),
            sessions: Mutex::new(HashMap::new()),
            workers: Mutex::new(Vec::new()),
        })
    }

    /// IPC mappings opened and closed so far (for tests and logs).
    pub fn mapping_counts(&self) -> (u64, u64) {
        let c = &self.shared.counters;
        (
            c.mappings_opened.load(Ordering::Relaxed),
            c.mappings_closed.load(Ordering::Relaxed),
        )
    }

    /// Descriptor slots allocated so far, all sessions together (for tests
    /// and logs): after the first batches only a deeper or larger burst
    /// than any before allocates more.
    pub fn slots_made(&self) -> u64 {
        self.sessions
            .lock()
            .values()
            .map(|s| s.pipe.slots_made.load(Ordering::Relaxed))
            .sum()
    }

    /// Bytes copied into peers.
    pub fn bytes_sent(&self) -> u64 {
        self.shared.counters.bytes_sent.load(Ordering::Relaxed)
    }

    /// Close every connection and mapping; idempotent.
    pub fn shutdown(&self) {
        let sessions: Vec<Arc<Session>> = self.sessions.lock().drain().map(|(_, s)| s).collect();
        for s in &sessions {
            s.state.lock().reset(&self.shared);
        }
        drop(sessions);
        for w in self.workers.lock().drain(..) {
            let _ = w.join();
        }
        self.shared.host.shutdown();
    }

    /// Recompute the export table after a registration change.
    fn publish(&self) -> Result<(), MemError> {
        let regions = self.shared.host.registered_regions();
        let mut entries = Vec::with_capacity(regions.len());
        for r in regions {
            let h = IpcHandle::export(r.addr)?;
            entries.push(Export {
                start: r.addr,
                len: r.len,
                base: h.base,
                size: h.size,
                handle: h.bytes,
            });
        }
        self.shared.host.set_exports(table::encode(&entries));
        Ok(())
    }

    fn session(&self, session: &str) -> Result<Arc<Session>, TransferError> {
        let mut sessions = self.sessions.lock();
        if let Some(s) = sessions.get(session) {
            return Ok(s.clone());
        }
        let (tx, rx) = crossbeam_channel::unbounded::<InFlight>();
        let state = Arc::new(Mutex::new(PeerState::new(session)));
        let pipe = Arc::new(Pipe::default());
        let (shared, st, p) = (self.shared.clone(), state.clone(), pipe.clone());
        let spawned = std::thread::Builder::new()
            .name("kvb-ipc-done".into())
            .spawn({
                let session = session.to_owned();
                move || complete_loop(&session, &rx, &st, &p, &shared)
            });
        match spawned {
            Ok(h) => self.workers.lock().push(h),
            Err(e) => {
                return Err(TransferError::new(
                    session,
                    None,
                    ErrorKind::Io,
                    format!("cannot spawn an ipc completion thread: {e}"),
                ));
            }
        }
        let s = Arc::new(Session { state, tx, pipe });
        sessions.insert(session.to_owned(), s.clone());
        Ok(s)
    }

    /// Check, translate and launch one batch (see the module docs).
    fn submit_batch(&self, session: &str, expected: u64, batch: Batch<'_>) -> BatchHandle {
        if batch.moves_nothing() {
            return BatchHandle::ready(Ok(()));
        }
        let s = match self.session(session) {
            Ok(s) => s,
            Err(e) => return BatchHandle::ready(Err(e)),
        };
        let mut st = s.state.lock();
        match st.submit(&self.shared, &s.pipe, batch, expected) {
            Ok((slot, bytes)) => {
                let (handle, done) = BatchHandle::pending();
                s.pipe.in_flight.fetch_add(1, Ordering::AcqRel);
                if let Err(e) = s.tx.send(InFlight { slot, bytes, done }) {
                    // The completion thread is gone (shutdown): wait here.
                    let InFlight { slot, done, .. } = e.0;
                    s.pipe.in_flight.fetch_sub(1, Ordering::AcqRel);
                    let r = slot.wait().map_err(|e| st.io(&e));
                    done.complete(r);
                }
                handle
            }
            Err(e) => BatchHandle::ready(Err(e)),
        }
    }

    /// Wait until every copy launched so far (every session) has finished.
    fn drain(&self) {
        let sessions: Vec<Arc<Session>> = self.sessions.lock().values().cloned().collect();
        for s in sessions {
            s.state.lock().sync();
        }
    }
}

/// The completion thread of one session.
fn complete_loop(
    session: &str,
    rx: &Receiver<InFlight>,
    state: &Mutex<PeerState>,
    pipe: &Pipe,
    shared: &Shared,
) {
    loop {
        let item = if pipe.holding.load(Ordering::Acquire) {
            match rx.recv_timeout(IDLE_TICK) {
                Ok(item) => item,
                Err(RecvTimeoutError::Timeout) => {
                    if pipe.in_flight.load(Ordering::Acquire) == 0
                        && let Some(mut st) = state.try_lock()
                    {
                        st.service_idle(shared, pipe);
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(item) => item,
                Err(_) => return,
            }
        };
        let InFlight { slot, bytes, done } = item;
        let waited = slot.wait();
        pipe.in_flight.fetch_sub(1, Ordering::AcqRel);
        pipe.free.lock().give_back(slot);
        match waited {
            Ok(()) => {
                shared
                    .counters
                    .bytes_sent
                    .fetch_add(bytes, Ordering::Relaxed);
                done.complete(Ok(()));
            }
            Err(e) => done.complete(Err(TransferError::new(
                session,
                None,
                ErrorKind::Io,
                e.to_string(),
            ))),
        }
    }
}

impl Drop for IpcEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl TransferEngine for IpcEngine {
    fn session_id(&self) -> &str {
        self.shared.host.session_id()
    }

    unsafe fn batch_register(&self, regions: &[(u64, u64)]) -> Result<(), MemError> {
        for &(addr, _) in regions {
            let kind = kvbridge_mem::probe_kind(addr);
            if !matches!(kind, MemoryKind::Device { .. }) {
                return Err(MemError::Unsupported { kind });
            }
        }
        // SAFETY: forwarded caller contract.
        unsafe { self.shared.host.register(regions) }?;
        if let Err(e) = self.publish() {
            let addrs: Vec<u64> = regions.iter().map(|r| r.0).collect();
            let _ = self.shared.host.deregister(&addrs);
            let _ = self.publish();
            return Err(e);
        }
        Ok(())
    }

    fn batch_deregister(&self, addrs: &[u64]) -> Result<(), MemError> {
        // Removes the regions (waiting for batches being prepared), then
        // revokes peers' holds on them and waits for their copies.
        let r = self.shared.host.deregister(addrs);
        if let Err(e) = self.publish() {
            tracing::warn!(error = %e, "republishing IPC exports failed");
        }
        // Our own copies out of these regions may still run.
        self.drain();
        r
    }

    fn incarnation(&self) -> u64 {
        self.shared.host.incarnation()
    }

    fn submit(&self, target: Target<'_>, batch: Batch<'_>) -> BatchHandle {
        if let Some(i) = batch.first_malformed() {
            return BatchHandle::ready(Err(crate::malformed_run(target.session, i)));
        }
        self.submit_batch(target.session, target.incarnation.unwrap_or(0), batch)
    }

    fn copies_runs(&self) -> bool {
        true
    }

    fn probe(&self, session: &str) -> Result<(), TransferError> {
        self.shared.host.ping(session).map(|_| ())
    }

    fn registered_regions(&self) -> Vec<Region> {
        self.shared.host.registered_regions()
    }

    fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.shared.host.read_local(addr, out)
    }

    fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        self.shared.host.write_local(addr, data)
    }

    fn moves_host_memory(&self) -> bool {
        false
    }
}
