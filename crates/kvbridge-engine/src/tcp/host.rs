//! [`EngineHost`]: the serving side of the engine wire, on its own port.
//!
//! A host binds the listening port, plugs its connection handler into the
//! session layer's accept loop, and holds what a peer may ask of it: the
//! authenticated handshake (cluster secret, incarnation, fences), the
//! registered regions, and the control protocol (`Exports`, `Lease`,
//! `Release`, `Revoke`). The TCP engine starts one with its data plane
//! (`Check`, `Write` and their run forms) and adds its sending lanes; the
//! CUDA IPC engine starts one without, so its port answers the control
//! protocol alone and refuses every data request as malformed.
//!
//! **Never:** sends data to a peer (that is the TCP engine's lanes), or
//! serves a data request when started without the data plane.

use std::collections::HashMap;
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use kvbridge_mem::{MemError, Region, RegionRegistry};
use parking_lot::{Mutex, RwLock};

use super::stats::Stats;
use super::{EngineStats, Inner, conn, fence};
use crate::session::{self, holds, resolve, shutdown_error};
use crate::{EngineConfig, TransferError};

/// Purpose label of the engine handshake's key (the TCP and CUDA IPC engines).
pub(super) const HANDSHAKE_KEY: &str = "engine-handshake";

/// The engine handshake's HMAC key: derived for this channel alone, never
/// the raw secret (docs/security.md: each channel derives its own key).
fn handshake_key(secret: &str) -> Vec<u8> {
    crate::secret::derive_key(secret.as_bytes(), HANDSHAKE_KEY).to_vec()
}

/// The serving side of the engine wire (see the module docs). Dropping it
/// (or [`EngineHost::shutdown`]) closes its port and every connection.
#[derive(Debug)]
pub(crate) struct EngineHost {
    pub(super) inner: Arc<Inner>,
    listener: TcpListener,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl EngineHost {
    /// Binds the port of `cfg` and starts accepting; `data_plane` says
    /// whether `Check` and `Write` requests are served.
    pub(crate) fn start(cfg: EngineConfig, data_plane: bool) -> std::io::Result<Self> {
        let listener = TcpListener::bind((cfg.listen_host.as_str(), cfg.port))?;
        let local = listener.local_addr()?;
        let session = session::session_id(&cfg, local.port())?;
        let secret = cfg.secret.as_deref().map(handshake_key);
        let inner = Arc::new(Inner {
            cfg,
            session,
            incarnation: rand::random::<u64>() | 1,
            secret,
            regions: RwLock::new(RegionRegistry::new()),
            shutdown: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            freeze_after: AtomicU64::new(u64::MAX),
            peers: Mutex::new(HashMap::new()),
            accepted: Mutex::new(HashMap::new()),
            pending: Mutex::new(std::collections::VecDeque::new()),
            exports: RwLock::new(Vec::new()),
            holds: holds::Holds::default(),
            fences: fence::Fences::default(),
            next_id: AtomicU64::new(1),
            stats: Stats::default(),
            data_plane,
        });
        let l2 = listener.try_clone()?;
        let i2 = inner.clone();
        let accept = std::thread::Builder::new()
            .name("kvb-tcp-accept".into())
            .spawn(move || session::server::accept_loop(i2, l2))?;
        tracing::info!(
            session = %inner.session,
            data_plane,
            "engine host listening"
        );
        Ok(Self {
            inner,
            listener,
            accept: Mutex::new(Some(accept)),
        })
    }

    /// Closes the port and every connection (accepted ones and the lanes'
    /// own); idempotent. Later calls fail with `Shutdown`.
    pub(crate) fn shutdown(&self) {
        if self.inner.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: shutting down our own listening socket's fd, which stays
        // open (owned by `self.listener`); this only wakes the accept thread.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for s in self.inner.accepted.lock().values() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let peers: Vec<_> = self.inner.peers.lock().drain().map(|(_, p)| p).collect();
        for p in &peers {
            for s in p.info.live.lock().values() {
                // Batches still in flight fail with `Shutdown`: what they
                // had queued must not reach the peer afterwards.
                session::io::reset_on_close(s.as_raw_fd());
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        drop(peers);
        if let Some(h) = self.accept.lock().take() {
            let _ = h.join();
        }
        // Wait until no thread touches registered memory any more: each
        // step of a receive or send runs under the registry's read lock and
        // checks the shutdown flag first, so none starts after this.
        drop(self.inner.regions.write());
        tracing::info!(session = %self.inner.session, "engine host shut down");
    }

    /// The host's counters.
    pub(crate) fn stats(&self) -> EngineStats {
        self.inner.stats.snapshot()
    }

    /// The session id peers dial (`host:port`).
    pub(crate) fn session_id(&self) -> &str {
        &self.inner.session
    }

    /// This process's incarnation, announced in every handshake.
    pub(crate) fn incarnation(&self) -> u64 {
        self.inner.incarnation
    }

    /// Registers regions peers may write into (or lease).
    ///
    /// # Safety
    /// Each region must stay valid memory until it is deregistered.
    pub(crate) unsafe fn register(&self, regions: &[(u64, u64)]) -> Result<(), MemError> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.regions.write().register(regions) }.map(|_| ())
    }

    /// Removes regions, then revokes peers' holds on them and waits until
    /// their copies into them finished (a peer that does not release in
    /// time loses its connection).
    pub(crate) fn deregister(&self, addrs: &[u64]) -> Result<(), MemError> {
        let (removed, r) = {
            let mut regions = self.inner.regions.write();
            let removed: Vec<(u64, u64)> = regions
                .regions()
                .filter(|r| addrs.contains(&r.addr))
                .map(|r| (r.addr, r.len))
                .collect();
            (removed, regions.deregister(addrs))
        };
        let stuck = self
            .inner
            .holds
            .revoke_and_wait(&removed, self.inner.cfg.io_timeout());
        if !stuck.is_empty() {
            tracing::warn!(
                connections = stuck.len(),
                "a peer did not release a revoked hold in time; dropping its connection"
            );
            let accepted = self.inner.accepted.lock();
            for id in stuck {
                if let Some(s) = accepted.get(&id) {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
                self.inner.holds.release(id);
            }
        }
        r
    }

    /// Refuses the peer announcing `session` from now on; returns once its
    /// request in progress (if any) finished or was aborted (past
    /// `min(io_timeout, request_timeout)`), its connections closed.
    pub(crate) fn fence(&self, session: &str) {
        let cfg = &self.inner.cfg;
        let grace = cfg.io_timeout().min(cfg.request_timeout());
        let ids = self.inner.fences.fence(session, grace);
        let accepted = self.inner.accepted.lock();
        for id in &ids {
            if let Some(s) = accepted.get(id) {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        drop(accepted);
        tracing::info!(%session, connections = ids.len(), "peer fenced");
    }

    /// Accepts the peer announcing `session` again.
    pub(crate) fn unfence(&self, session: &str) {
        self.inner.fences.unfence(session);
        tracing::info!(%session, "peer unfenced");
    }

    /// Handshakes with `session` and pings it; its incarnation.
    pub(crate) fn ping(&self, session: &str) -> Result<u64, TransferError> {
        if self.inner.is_shutdown() {
            return Err(shutdown_error(session));
        }
        let addr = resolve(session)?;
        conn::ping(&self.inner, session, addr)
    }

    /// The registered regions.
    pub(crate) fn registered_regions(&self) -> Vec<Region> {
        self.inner.regions.read().regions().copied().collect()
    }

    /// Reads registered memory of this process.
    pub(crate) fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.inner.regions.read_recursive().read_bytes(addr, out)
    }

    /// Writes registered memory of this process.
    pub(crate) fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        self.inner.regions.read_recursive().write_bytes(addr, data)
    }
}

#[cfg(feature = "cuda")]
impl session::control::ControlHost for EngineHost {
    fn control(&self, session: &str) -> Result<session::control::Control, TransferError> {
        if self.inner.is_shutdown() {
            return Err(shutdown_error(session));
        }
        let addr = resolve(session)?;
        let (stream, incarnation) = conn::connect(&self.inner, session, addr)?.into_parts();
        Ok(session::control::Control::new(session, stream, incarnation))
    }

    fn set_exports(&self, table: Vec<u8>) {
        *self.inner.exports.write() = table;
    }

    fn registry(&self) -> &RwLock<RegionRegistry> {
        &self.inner.regions
    }
}

impl Drop for EngineHost {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests unwrap what they construct
mod tests {
    use super::*;
    use crate::{ErrorKind, TcpEngine, TransferEngine};

    fn cfg() -> EngineConfig {
        EngineConfig {
            port: 0,
            secret: Some("a-cluster-secret-of-some-length".into()),
            ..EngineConfig::default()
        }
    }

    #[test]
    fn a_control_only_host_answers_pings_and_refuses_every_write() {
        let host = EngineHost::start(cfg(), false).unwrap();
        let mut target = vec![7u8; 4096];
        // SAFETY: `target` outlives the host (dropped after it below).
        unsafe { host.register(&[(target.as_mut_ptr() as u64, 4096)]) }.unwrap();
        let client = TcpEngine::new(cfg()).unwrap();
        // The handshake and a ping work: the port is a member's.
        client.probe(host.session_id()).unwrap();
        let dst = target.as_ptr() as u64;
        let err = client
            .debug_raw_write(host.session_id(), &[(dst, &[1u8; 64])])
            .unwrap_err();
        // Refused by its ack, or the connection reset as the host closes it
        // with the write's bytes unread.
        assert!(
            matches!(err.kind, ErrorKind::Refused | ErrorKind::PeerClosed),
            "{err}"
        );
        assert!(target.iter().all(|b| *b == 7), "a refused write wrote");
        assert_eq!(host.stats().bad_frames, 1);
        // A host with the data plane takes the same write.
        let data = EngineHost::start(cfg(), true).unwrap();
        let mut other = vec![7u8; 4096];
        // SAFETY: `other` outlives `data` (dropped after it below).
        unsafe { data.register(&[(other.as_mut_ptr() as u64, 4096)]) }.unwrap();
        client
            .debug_raw_write(data.session_id(), &[(other.as_ptr() as u64, &[1u8; 64])])
            .unwrap();
        drop(data);
        assert!(other[..64].iter().all(|b| *b == 1));
        drop(host);
    }
}
