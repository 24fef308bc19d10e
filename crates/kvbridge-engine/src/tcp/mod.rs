//! The TCP engine: the default data plane on every machine and the
//! cross-node fallback.
//!
//! * One listening port per engine; the session id is `host:port`.
//! * Per peer, `connections_per_peer` lanes (a thread and a lazily opened,
//!   kept, re-opened-after-failure connection each) pull requests from one
//!   queue, so one large batch spreads over every connection.
//! * A batch is cut into requests of about `request_bytes`; a batch of more
//!   than one request is first validated whole by the receiver (a `Check`
//!   request carrying every destination), so a batch with one destination
//!   outside the peer's regions writes nothing. Every `Write` request is
//!   validated again, whole, before its first byte is written.
//! * Blocks shorter than `coalesce_threshold` are copied into frame buffers;
//!   longer ones travel with vectored I/O straight from / into registered
//!   memory. Memory that is not host-accessible (device, later) takes the
//!   copying path through its [`kvbridge_mem::MemoryAccess`].
//! * Optional cluster secret: mutual HMAC challenge-response at connection
//!   set-up; the client's hello announces its own session id and
//!   incarnation (covered by its proof), which [`TcpEngine::fence_peer`]
//!   keys on. Every connect, read and write has a timeout; the handshake
//!   and each request have a total deadline.
//! * Limits against hostile peers: `max_connections`, `idle_timeout_ms`,
//!   `request_timeout_ms`; refusals are counted in [`EngineStats`].
//!
//! See `docs/engines.md` for the framing and the reasoning.

mod conn;
mod fence;
mod handshake;
mod host;
mod lane;
mod receive_runs;
mod request;
mod runs;
mod scatter;
mod send;
mod server;
mod stats;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crossbeam_channel::Sender;
use kvbridge_mem::{MemError, Region, RegionRegistry};
use parking_lot::{Mutex, RwLock};

use crate::session::{holds, resolve, shutdown_error};
use crate::{
    Batch, BatchHandle, Block, EngineConfig, ErrorKind, Side, Target, TransferEngine, TransferError,
};
pub(crate) use host::EngineHost;
use request::{BatchCtx, Item, Piece, Work};
pub use stats::EngineStats;
use stats::Stats;

/// What lanes know about a peer: where it is and which incarnation answered last.
#[derive(Debug)]
struct PeerInfo {
    session: String,
    addr: SocketAddr,
    /// Incarnation id of the peer process last seen at a handshake (0 = none yet).
    incarnation: AtomicU64,
    /// Clones of the lanes' live sockets, shut down when the engine stops.
    live: Mutex<HashMap<u64, TcpStream>>,
}

#[derive(Debug)]
struct Peer {
    info: Arc<PeerInfo>,
    tx: Sender<Item>,
}

/// State shared by the engine handle, its server threads and its lanes.
#[derive(Debug)]
struct Inner {
    cfg: EngineConfig,
    session: String,
    incarnation: u64,
    secret: Option<Vec<u8>>,
    regions: RwLock<RegionRegistry>,
    shutdown: AtomicBool,
    frozen: AtomicBool,
    /// Test hook: freeze once this many payload bytes were received.
    freeze_after: AtomicU64,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    accepted: Mutex<HashMap<u64, TcpStream>>,
    /// Accepted connections still in their handshake, oldest first.
    pending: Mutex<std::collections::VecDeque<u64>>,
    /// What an `Exports` request answers (the CUDA IPC engine's handle table).
    exports: RwLock<Vec<u8>>,
    /// Regions that peers hold through `Lease` (CUDA IPC copies may be in flight).
    holds: holds::Holds,
    /// Fenced peers and the busy state of accepted connections.
    fences: fence::Fences,
    next_id: AtomicU64,
    stats: Stats,
    /// Whether `Check` and `Write` requests are served (false: a
    /// control-only host, the CUDA IPC engine's).
    data_plane: bool,
}

impl Inner {
    fn is_shutdown(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The peer for `session`, created (with its lanes) on first use.
    fn peer(self: &Arc<Self>, session: &str) -> Result<Arc<Peer>, TransferError> {
        if let Some(p) = self.peers.lock().get(session) {
            return Ok(p.clone());
        }
        let addr = resolve(session)?;
        let mut peers = self.peers.lock();
        if let Some(p) = peers.get(session) {
            return Ok(p.clone());
        }
        if self.is_shutdown() {
            return Err(shutdown_error(session));
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let info = Arc::new(PeerInfo {
            session: session.to_owned(),
            addr,
            incarnation: AtomicU64::new(0),
            live: Mutex::new(HashMap::new()),
        });
        for lane in 0..self.cfg.tcp.connections_per_peer.max(1) {
            let (inner, info, rx) = (self.clone(), info.clone(), rx.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("kvb-tcp-lane{lane}"))
                .spawn(move || lane::lane(inner, info, rx));
            if let Err(e) = spawned {
                return Err(TransferError::new(
                    session,
                    None,
                    ErrorKind::Io,
                    e.to_string(),
                ));
            }
        }
        let peer = Arc::new(Peer { info, tx });
        peers.insert(session.to_owned(), peer.clone());
        Ok(peer)
    }
}

/// The TCP transfer engine. Dropping it (or [`TcpEngine::shutdown`]) closes
/// its port and every connection; pending batches fail with `Shutdown`.
#[derive(Debug)]
pub struct TcpEngine {
    host: EngineHost,
}

/// Smallest request a batch is cut into when spread over connections.
const MIN_REQUEST_BYTES: u64 = 256 << 10;

impl TcpEngine {
    /// Bind the listening port and start serving.
    pub fn new(cfg: EngineConfig) -> std::io::Result<Self> {
        Ok(Self {
            host: EngineHost::start(cfg, true)?,
        })
    }

    /// The engine's serving state (shared with its server threads and lanes).
    fn inner(&self) -> &Arc<Inner> {
        &self.host.inner
    }

    /// Close the port and every connection; idempotent. Later calls fail with `Shutdown`.
    pub fn shutdown(&self) {
        self.host.shutdown();
    }

    /// The engine's counters.
    pub fn stats(&self) -> EngineStats {
        self.host.stats()
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.inner().cfg
    }

    /// Test hook: while frozen, the engine's server stops reading requests
    /// (connections stay open), like a hung peer process.
    #[doc(hidden)]
    pub fn debug_freeze(&self, frozen: bool) {
        self.inner().frozen.store(frozen, Ordering::Release);
    }

    /// Test hook: freeze (see [`Self::debug_freeze`]) as soon as `bytes`
    /// payload bytes in total have been received, i.e. in the middle of a batch.
    #[doc(hidden)]
    pub fn debug_freeze_after(&self, bytes: u64) {
        self.inner().freeze_after.store(bytes, Ordering::Release);
    }

    /// Test hook: send a raw `Write` request over a fresh connection (no
    /// batch-level check, no local source check) and return the ack status.
    #[doc(hidden)]
    pub fn debug_raw_write(
        &self,
        session: &str,
        dst_and_data: &[(u64, &[u8])],
    ) -> Result<(), TransferError> {
        conn::raw_write(self.inner(), session, dst_and_data)
    }
}

impl TransferEngine for TcpEngine {
    fn session_id(&self) -> &str {
        self.host.session_id()
    }

    unsafe fn batch_register(&self, regions: &[(u64, u64)]) -> Result<(), MemError> {
        // SAFETY: forwarded caller contract.
        unsafe { self.host.register(regions) }
    }

    fn batch_deregister(&self, addrs: &[u64]) -> Result<(), MemError> {
        self.host.deregister(addrs)
    }

    fn incarnation(&self) -> u64 {
        self.host.incarnation()
    }

    /// Refuse the peer announcing `session` from now on; returns once its
    /// request in progress (if any) finished — or was aborted, when it
    /// runs past `min(io_timeout, request_timeout)` — with its connections
    /// closed. Always `Ok(true)`.
    fn fence_peer(&self, session: &str) -> Result<bool, TransferError> {
        self.host.fence(session);
        Ok(true)
    }

    fn unfence_peer(&self, session: &str) {
        self.host.unfence(session);
    }

    fn submit(&self, target: Target<'_>, batch: Batch<'_>) -> BatchHandle {
        if let Batch::Runs(runs) = batch
            && self.inner().cfg.tcp.native_runs
        {
            let expected = target.incarnation.unwrap_or(0);
            return match self.plan_runs(target.session, expected, runs) {
                Ok(Some(h)) => h,
                Ok(None) => BatchHandle::ready(Ok(())),
                Err(e) => BatchHandle::ready(Err(e)),
            };
        }
        crate::submit_as_blocks(target, batch, |session, expected, blocks| {
            self.plan(session, expected, blocks)
        })
    }

    fn copies_runs(&self) -> bool {
        self.inner().cfg.tcp.native_runs
    }

    /// Host KV: strided runs cost what a gather and a scatter cost, without
    /// the ring's round trips. Device KV (or runs off): every slice would
    /// cross the host bounce path on its own, so one bulk write is faster.
    fn prefers_staging(&self, device_kv: bool) -> bool {
        device_kv || !self.inner().cfg.tcp.native_runs
    }

    fn probe(&self, session: &str) -> Result<(), TransferError> {
        let incarnation = self.host.ping(session)?;
        if let Some(p) = self.inner().peers.lock().get(session) {
            let old = p.info.incarnation.swap(incarnation, Ordering::AcqRel);
            if old != 0 && old != incarnation {
                tracing::info!(%session, "probe: peer restarted (new incarnation)");
            }
        }
        Ok(())
    }

    fn registered_regions(&self) -> Vec<Region> {
        self.host.registered_regions()
    }

    fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.host.read_local(addr, out)
    }

    fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        self.host.write_local(addr, data)
    }
}

/// Most pieces (copies) one `Write` (`WriteRuns`) request carries.
const MAX_PIECES: usize = 8192;

impl TcpEngine {
    /// Check sources, cut the batch into requests and queue them; `None` if there is nothing to move.
    fn plan(
        &self,
        session: &str,
        expected: u64,
        blocks: &[Block],
    ) -> Result<Option<BatchHandle>, TransferError> {
        if self.inner().is_shutdown() {
            return Err(shutdown_error(session));
        }
        {
            let regions = self.inner().regions.read_recursive();
            for (i, b) in blocks.iter().enumerate() {
                if b.dst.checked_add(b.len).is_none() {
                    let d = format!("destination {:#x}+{} overflows", b.dst, b.len);
                    return Err(TransferError::new(
                        session,
                        Some(i),
                        ErrorKind::InvalidArgument,
                        d,
                    ));
                }
                if b.len > 0 {
                    regions.check(b.src, b.len).map_err(|e| {
                        TransferError::new(
                            session,
                            Some(i),
                            ErrorKind::OutOfRegion(Side::Local),
                            e.to_string(),
                        )
                    })?;
                }
            }
        }
        // Requests of at most `request_bytes`, but small enough that one
        // batch spreads over all of the peer's connections.
        let total: u64 = blocks.iter().map(|b| b.len).sum();
        let lanes = self.inner().cfg.tcp.connections_per_peer.max(1) as u64;
        let cap = self.inner().cfg.tcp.request_bytes.max(1) as u64;
        let step = total.div_ceil(lanes).clamp(cap.min(MIN_REQUEST_BYTES), cap);
        let mut requests: Vec<Vec<Piece>> = Vec::new();
        let mut cur: Vec<Piece> = Vec::new();
        let mut cur_bytes = 0u64;
        for (i, b) in blocks.iter().enumerate() {
            if b.len == 0 {
                continue;
            }
            let mut off = 0;
            while off < b.len {
                let k = (b.len - off).min(step);
                cur.push(Piece::single(b.src + off, b.dst + off, k, i));
                cur_bytes += k;
                off += k;
                if cur_bytes >= step || cur.len() >= MAX_PIECES {
                    requests.push(std::mem::take(&mut cur));
                    cur_bytes = 0;
                }
            }
        }
        if !cur.is_empty() {
            requests.push(cur);
        }
        if requests.is_empty() {
            return Ok(None);
        }
        let whole = || {
            blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len > 0)
                .map(|(i, b)| Piece::single(b.src, b.dst, b.len, i))
                .collect()
        };
        self.queue(session, expected, requests, whole)
    }

    /// Queue a batch's requests: alone, or (several) behind one check of
    /// the whole batch's destinations (`whole`).
    fn queue(
        &self,
        session: &str,
        expected: u64,
        mut requests: Vec<Vec<Piece>>,
        whole: impl FnOnce() -> Vec<Piece>,
    ) -> Result<Option<BatchHandle>, TransferError> {
        let peer = self.inner().peer(session)?;
        let (handle, completer) = BatchHandle::pending();
        let ctx = BatchCtx::new(
            session,
            expected,
            completer,
            self.inner().stats.live_batches.clone(),
        );
        let first = if requests.len() == 1 {
            let pieces = requests.pop().unwrap_or_default();
            Item::new(ctx, Work::Write(pieces))
        } else {
            let deferred = requests
                .into_iter()
                .map(|p| Item::new(ctx.clone(), Work::Write(p)))
                .collect();
            ctx.defer(deferred);
            Item::new(ctx, Work::Check(whole()))
        };
        // If the lanes are gone the item is dropped, which fails the batch.
        let _ = peer.tx.send(first);
        Ok(Some(handle))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests unwrap what they construct
mod tests {
    use super::*;

    #[test]
    fn the_handshake_key_is_derived_never_the_raw_secret() {
        let text = "a-cluster-secret-of-some-length";
        let engine = TcpEngine::new(EngineConfig {
            port: 0,
            secret: Some(text.into()),
            ..EngineConfig::default()
        })
        .unwrap();
        let key = engine.inner().secret.clone().unwrap();
        assert_ne!(key, text.as_bytes());
        let secret = crate::ClusterSecret::from_text(text, "test").unwrap();
        assert_eq!(key, secret.derive(host::HANDSHAKE_KEY));
        // The UCX side channel's key is another one.
        assert_ne!(key, secret.derive("ucx-side-channel"));
    }
}
