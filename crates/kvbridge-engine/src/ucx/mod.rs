//! The UCX engine: one-sided puts through UCX's UCP layer, so the same
//! binary moves KV over RDMA (verbs rc / dc / ud) where a NIC is present,
//! over shared memory (posix / sysv / cma) within a node, and over TCP
//! anywhere. UCX's own environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...) picks
//! the transports.
//!
//! * libucp is loaded at run time (`sys`); without it [`UcxEngine::new`]
//!   fails with "UCX is not available on this machine".
//! * One UCP context and worker per engine, owned by one progress thread
//!   (`progress`); callers submit over a channel and wait on
//!   [`BatchHandle`]s, so a blocked caller never stalls other sessions.
//! * Peers find each other by session id (`host:port`) through a small
//!   authenticated side channel (`side`): the target's worker address, the
//!   packed remote keys of its registered regions and its incarnation.
//! * A batch is checked whole before anything is issued (sources against our
//!   regions, destinations against the peer's published regions), then
//!   contiguous runs are merged into one put each and an endpoint flush
//!   follows: the handle completes when the bytes are in the peer's memory.
//!
//! See `docs/engines.md` and `docs/deploying.md`.

mod api;
mod progress;
pub(crate) mod side;
mod sys;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use kvbridge_mem::{MemError, Region, RegionRegistry};
use parking_lot::{Mutex, RwLock};

pub use api::UcxError;

/// Purpose label of the side channel's handshake key (derived from the
/// cluster secret; never the raw secret).
pub(crate) const HANDSHAKE_KEY_LABEL: &str = "ucx-side-channel";
use progress::{BatchCmd, Cmd, Put, Wake};
use side::{Ask, PeerInfo, Published, RemoteRegion};

use crate::session::{self, resolve, shutdown_error};
use crate::{
    Batch, BatchHandle, Block, EngineConfig, ErrorKind, Side, Target, TransferEngine, TransferError,
};

/// The version of the UCX library on this machine (`"1.13.1"`), or why
/// UCX cannot be used here.
pub fn available() -> Result<String, UcxError> {
    let lib = api::lib()?;
    let (a, b, c) = lib.version;
    Ok(format!("{a}.{b}.{c}"))
}

/// Counters of one UCX engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct UcxStats {
    /// Payload bytes of batches that completed (flushed to the peer).
    pub bytes_sent: u64,
    /// Batches that completed successfully.
    pub batches_ok: u64,
    /// Batches that failed after being issued.
    pub batches_failed: u64,
    /// Puts issued (one per merged run).
    pub puts: u64,
    /// Side-channel handshakes this engine made (peer info fetched).
    pub handshakes: u64,
    /// Side-channel requests this engine answered.
    pub served: u64,
    /// Side-channel clients refused at authentication.
    pub auth_failures: u64,
    /// Side-channel connections being answered now.
    pub side_open: u64,
    /// Side-channel connections closed at once (too many open).
    pub side_refused: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub bytes_sent: AtomicU64,
    pub batches_ok: AtomicU64,
    pub batches_failed: AtomicU64,
    pub puts: AtomicU64,
    pub handshakes: AtomicU64,
}

/// What the engine knows of one peer session (behind its own lock, so a
/// handshake with one peer never blocks submits to another).
#[derive(Debug, Default)]
struct Slot {
    info: Mutex<Option<Arc<PeerInfo>>>,
}

/// State shared by the engine handle and its progress thread.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    peers: Mutex<HashMap<String, Arc<Slot>>>,
    pub stats: Stats,
}

impl Shared {
    fn slot(&self, session: &str) -> Arc<Slot> {
        self.peers
            .lock()
            .entry(session.to_owned())
            .or_default()
            .clone()
    }

    /// Drop the cached `info` of its session (its endpoint failed), so the
    /// next batch handshakes again. Never waits for a handshake in progress.
    pub(crate) fn forget(&self, info: &Arc<PeerInfo>) {
        let slot = self.peers.lock().get(&info.session).cloned();
        if let Some(slot) = slot
            && let Some(mut g) = slot.info.try_lock()
            && g.as_ref().is_some_and(|c| Arc::ptr_eq(c, info))
        {
            *g = None;
        }
    }
}

/// The UCX transfer engine. Dropping it (or [`UcxEngine::shutdown`])
/// closes its side-channel port, every endpoint and its UCX worker.
#[derive(Debug)]
pub struct UcxEngine {
    cfg: EngineConfig,
    session: String,
    incarnation: u64,
    secret: Option<Vec<u8>>,
    regions: RwLock<RegionRegistry>,
    published: Arc<Published>,
    shared: Arc<Shared>,
    tx: Sender<Cmd>,
    wake: Arc<Wake>,
    listener: TcpListener,
    threads: Mutex<Vec<JoinHandle<()>>>,
    version: String,
}

impl UcxEngine {
    /// Start an engine: UCX configured from its environment (`UCX_TLS`,
    /// `UCX_NET_DEVICES`, ...) with `cfg.ucx.settings` over it; the side channel listens on
    /// `cfg.listen_host:cfg.port`, which is the session id.
    pub fn new(cfg: EngineConfig) -> Result<Self, UcxError> {
        Self::with_ucx_config(cfg, &[])
    }

    /// Like [`UcxEngine::new`], with UCX settings applied over the
    /// environment and `cfg.ucx.settings`: `("TLS", "tcp")` is
    /// `UCX_TLS=tcp` for this engine only.
    pub fn with_ucx_config(cfg: EngineConfig, ucx: &[(&str, &str)]) -> Result<Self, UcxError> {
        let version = available()?;
        let listener = TcpListener::bind((cfg.listen_host.as_str(), cfg.port))
            .map_err(|e| UcxError::io(format!("binding {}:{}", cfg.listen_host, cfg.port), e))?;
        let port = listener
            .local_addr()
            .map_err(|e| UcxError::io("reading the side channel's port", e))?
            .port();
        let session = session::session_id(&cfg, port)
            .map_err(|e| UcxError::io("deriving the session id", e))?;
        let shared = Arc::new(Shared::default());
        let wake = Arc::new(Wake::new().map_err(|e| UcxError::io("creating the wake-up fd", e))?);
        let (tx, rx) = crossbeam_channel::unbounded();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let overrides: Vec<(String, String)> = cfg
            .ucx
            .settings
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(ucx.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())))
            .collect();
        let (s2, w2) = (shared.clone(), wake.clone());
        let progress = std::thread::Builder::new()
            .name("kvb-ucx-progress".into())
            .spawn(move || progress::run(overrides, s2, rx, w2, ready_tx))
            .map_err(|e| UcxError::io("spawning the progress thread", e))?;
        let worker = match ready_rx.recv() {
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                let _ = progress.join();
                return Err(e);
            }
            Err(_) => {
                let _ = progress.join();
                return Err(UcxError::ProgressDied);
            }
        };
        // This channel's own key, never the raw secret.
        let secret = cfg
            .secret
            .as_deref()
            .map(|s| crate::secret::derive_key(s.as_bytes(), HANDSHAKE_KEY_LABEL).to_vec());
        let incarnation = rand::random::<u64>() | 1;
        let published = Arc::new(Published {
            secret: secret.clone(),
            incarnation,
            worker,
            regions: RwLock::new(Default::default()),
            shutdown: AtomicBool::new(false),
            io_timeout: cfg.connect_timeout(),
            served: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            gate: Default::default(),
        });
        let l2 = listener
            .try_clone()
            .map_err(|e| UcxError::io("cloning the side channel's socket", e))?;
        let p2 = published.clone();
        let engine = Self {
            cfg,
            session,
            incarnation,
            secret,
            regions: RwLock::new(RegionRegistry::new()),
            published,
            shared,
            tx,
            wake,
            listener,
            threads: Mutex::new(vec![progress]),
            version,
        };
        let accept = std::thread::Builder::new()
            .name("kvb-ucx-accept".into())
            .spawn(move || side::accept_loop(p2, l2))
            .map_err(|e| UcxError::io("spawning the side channel's thread", e))?;
        engine.threads.lock().push(accept);
        tracing::info!(session = %engine.session, ucx = %engine.version, "ucx engine listening");
        Ok(engine)
    }

    /// Close the side channel, every endpoint and the worker; idempotent.
    /// Batches still queued fail with `Shutdown`.
    pub fn shutdown(&self) {
        if self.published.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: shuts down our own listening socket's fd, which stays open
        // (owned by `self.listener`); this only wakes the accept thread.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        let _ = self.tx.send(Cmd::Shutdown);
        self.wake.wake();
        for h in self.threads.lock().drain(..) {
            let _ = h.join();
        }
        tracing::info!(session = %self.session, "ucx engine shut down");
    }

    fn is_shutdown(&self) -> bool {
        self.published.shutdown.load(Ordering::Acquire)
    }

    /// The engine's counters.
    pub fn stats(&self) -> UcxStats {
        let s = &self.shared.stats;
        UcxStats {
            bytes_sent: s.bytes_sent.load(Ordering::Relaxed),
            batches_ok: s.batches_ok.load(Ordering::Relaxed),
            batches_failed: s.batches_failed.load(Ordering::Relaxed),
            puts: s.puts.load(Ordering::Relaxed),
            handshakes: s.handshakes.load(Ordering::Relaxed),
            served: self.published.served.load(Ordering::Relaxed),
            auth_failures: self.published.auth_failures.load(Ordering::Relaxed),
            side_open: self.published.gate.open.load(Ordering::Relaxed),
            side_refused: self.published.gate.refused.load(Ordering::Relaxed),
        }
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The version of the loaded UCX library.
    pub fn ucx_version(&self) -> &str {
        &self.version
    }

    fn send(&self, cmd: Cmd) -> bool {
        let ok = self.tx.send(cmd).is_ok();
        self.wake.wake();
        ok
    }

    /// Ask the peer at `session` (`addr`) over the side channel.
    fn query(
        &self,
        session: &str,
        addr: SocketAddr,
        ask: Ask,
    ) -> Result<(u64, Option<PeerInfo>), TransferError> {
        let (secret, timeout) = (self.secret.as_deref(), self.cfg.connect_timeout());
        side::query(session, addr, secret, timeout, ask)
    }

    /// Handshake with `session` and cache what it published.
    fn fetch(&self, session: &str, addr: SocketAddr) -> Result<Arc<PeerInfo>, TransferError> {
        let (_, info) = self.query(session, addr, Ask::Info)?;
        self.shared.stats.handshakes.fetch_add(1, Ordering::Relaxed);
        info.map(Arc::new).ok_or_else(|| {
            TransferError::new(session, None, ErrorKind::Refused, "peer sent no info")
        })
    }

    /// The peer's info: cached, or fetched when absent, when `expected`
    /// names another incarnation, or when `refresh` is set. The bool says
    /// whether it was fetched just now.
    fn peer_info(
        &self,
        session: &str,
        addr: SocketAddr,
        expected: u64,
        refresh: bool,
    ) -> Result<(Arc<PeerInfo>, bool), TransferError> {
        let slot = self.shared.slot(session);
        let mut cached = slot.info.lock();
        if let Some(i) = cached.as_ref()
            && !refresh
            && (expected == 0 || i.incarnation == expected)
        {
            return Ok((i.clone(), false));
        }
        let fresh = self.fetch(session, addr)?;
        if let Some(old) = cached.as_ref()
            && old.incarnation != fresh.incarnation
        {
            tracing::info!(%session, "ucx: peer restarted (new incarnation); old keys dropped");
        }
        *cached = Some(fresh.clone());
        Ok((fresh, true))
    }

    /// Check the whole batch, merge contiguous runs and queue it.
    fn plan(&self, session: &str, expected: u64, blocks: &[Block]) -> Planned {
        if self.is_shutdown() {
            return Err(shutdown_error(session));
        }
        for (i, b) in blocks.iter().enumerate() {
            if b.dst.checked_add(b.len).is_none() || b.src.checked_add(b.len).is_none() {
                let d = format!("block {:#x}->{:#x}+{} overflows", b.src, b.dst, b.len);
                return Err(TransferError::new(
                    session,
                    Some(i),
                    ErrorKind::InvalidArgument,
                    d,
                ));
            }
        }
        if blocks.iter().all(|b| b.len == 0) {
            return Ok(None);
        }
        let addr = resolve(session)?;
        let (mut info, fresh) = self.peer_info(session, addr, expected, false)?;
        let mut dst_regions = remote_regions(&info, blocks);
        if dst_regions.is_err() && !fresh {
            // The peer may have registered more since we asked: ask again.
            info = self.peer_info(session, addr, expected, true)?.0;
            dst_regions = remote_regions(&info, blocks);
        }
        let dst_regions = dst_regions.map_err(|i| {
            let b = blocks[i];
            TransferError::new(
                session,
                Some(i),
                ErrorKind::OutOfRegion(Side::Remote),
                format!(
                    "{:#x}+{} is outside the regions the peer published",
                    b.dst, b.len
                ),
            )
        })?;
        if expected != 0 && info.incarnation != expected {
            return Err(TransferError::new(
                session,
                blocks.iter().position(|b| b.len > 0),
                ErrorKind::PeerRestarted,
                format!(
                    "planned for incarnation {expected:#x}, the peer is {:#x}",
                    info.incarnation
                ),
            ));
        }
        // Held until the batch is queued: a deregistration (write lock)
        // then queues its unmap behind this batch.
        let regions = self.regions.read_recursive();
        let mut puts: Vec<Put> = Vec::new();
        let mut bytes = 0u64;
        let mut local: Option<Region> = None;
        for ((i, b), &region) in blocks.iter().enumerate().zip(&dst_regions) {
            if b.len == 0 {
                continue;
            }
            // Blocks of a batch mostly share a region: try the last one first.
            let l = match local {
                Some(r) if r.contains(b.src, b.len) => r,
                _ => *regions.check(b.src, b.len).map_err(|e| {
                    TransferError::new(
                        session,
                        Some(i),
                        ErrorKind::OutOfRegion(Side::Local),
                        e.to_string(),
                    )
                })?,
            };
            local = Some(l);
            bytes += b.len;
            if let Some(last) = puts.last_mut()
                && last.src + last.len == b.src
                && last.dst + last.len == b.dst
                && last.region == region
                && l.contains(last.src, last.len + b.len)
            {
                last.len += b.len;
                continue;
            }
            puts.push(Put {
                src: b.src,
                dst: b.dst,
                len: b.len,
                block: i,
                region,
            });
        }
        let (handle, completer) = BatchHandle::pending();
        let cmd = Cmd::Batch(BatchCmd {
            peer: info,
            puts,
            bytes,
            completer,
            timeout: self.cfg.io_timeout(),
        });
        if !self.send(cmd) {
            return Err(shutdown_error(session));
        }
        drop(regions);
        Ok(Some(handle))
    }
}

/// A batch checked and queued (`Some`), with nothing to move (`None`), or refused.
type Planned = Result<Option<BatchHandle>, TransferError>;

/// The start of the published region holding each block's destination
/// (0 for empty blocks), or the index of the first block outside them.
fn remote_regions(info: &PeerInfo, blocks: &[Block]) -> Result<Vec<u64>, usize> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut last: Option<(u64, u64)> = None;
    for (i, b) in blocks.iter().enumerate() {
        if b.len == 0 {
            out.push(0);
            continue;
        }
        let hit = last.filter(|&(start, end)| b.dst >= start && b.dst + b.len <= end);
        let start = match hit {
            Some((start, _)) => start,
            None => {
                let (start, r) = info.region_of(b.dst, b.len).ok_or(i)?;
                last = Some((start, start + r.len));
                start
            }
        };
        out.push(start);
    }
    Ok(out)
}

impl Drop for UcxEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl TransferEngine for UcxEngine {
    fn session_id(&self) -> &str {
        &self.session
    }

    /// One UCX operation per copy: per-slice heterogeneous TP is 5–15×
    /// slower than one put per staged chunk.
    fn prefers_staging(&self, _device_kv: bool) -> bool {
        true
    }

    unsafe fn batch_register(&self, regions: &[(u64, u64)]) -> Result<(), MemError> {
        let mut reg = self.regions.write();
        let known: Vec<Region> = reg.regions().copied().collect();
        // SAFETY: forwarded caller contract.
        unsafe { reg.register(regions) }?;
        let fresh: Vec<Region> = reg
            .regions()
            .filter(|r| !known.contains(r))
            .copied()
            .collect();
        if fresh.is_empty() {
            return Ok(());
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let mapped = if self.send(Cmd::Map {
            regions: fresh.clone(),
            reply: tx,
        }) {
            rx.recv().unwrap_or(Err(UcxError::Shutdown))
        } else {
            Err(UcxError::Shutdown)
        };
        match mapped {
            Ok(keys) => {
                let mut published = self.published.regions.write();
                for (r, (addr, key)) in fresh.iter().zip(keys) {
                    debug_assert_eq!(r.addr, addr);
                    published.insert(
                        addr,
                        RemoteRegion {
                            len: r.len,
                            rkey: key.into(),
                        },
                    );
                }
                Ok(())
            }
            Err(e) => {
                let addrs: Vec<u64> = fresh.iter().map(|r| r.addr).collect();
                let _ = reg.deregister(&addrs);
                let r = fresh[0];
                Err(match e {
                    UcxError::Call { status: -22, .. } => MemError::Unsupported { kind: r.kind },
                    e => MemError::Registration {
                        addr: r.addr,
                        len: r.len,
                        reason: e.to_string(),
                    },
                })
            }
        }
    }

    fn batch_deregister(&self, addrs: &[u64]) -> Result<(), MemError> {
        let mut reg = self.regions.write();
        let known: Vec<u64> = addrs
            .iter()
            .copied()
            .filter(|a| reg.regions().any(|r| r.addr == *a))
            .collect();
        let result = reg.deregister(addrs);
        {
            let mut published = self.published.regions.write();
            for a in &known {
                published.remove(a);
            }
        }
        drop(reg);
        if !known.is_empty() {
            let (tx, rx) = crossbeam_channel::bounded(1);
            if self.send(Cmd::Unmap {
                addrs: known,
                reply: tx,
            }) {
                let _ = rx.recv();
            }
        }
        result
    }

    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    fn submit(&self, target: Target<'_>, batch: Batch<'_>) -> BatchHandle {
        crate::submit_as_blocks(target, batch, |session, expected, blocks| {
            self.plan(session, expected, blocks)
        })
    }

    fn probe(&self, session: &str) -> Result<(), TransferError> {
        if self.is_shutdown() {
            return Err(shutdown_error(session));
        }
        let addr = resolve(session)?;
        let (incarnation, _) = self.query(session, addr, Ask::Ping)?;
        let slot = self.shared.slot(session);
        let mut cached = slot.info.lock();
        if cached
            .as_ref()
            .is_some_and(|c| c.incarnation != incarnation)
        {
            tracing::info!(%session, "probe: peer restarted (new incarnation); old keys dropped");
            *cached = None;
        }
        Ok(())
    }

    fn registered_regions(&self) -> Vec<Region> {
        self.regions.read().regions().copied().collect()
    }

    fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.regions.read_recursive().read_bytes(addr, out)
    }

    fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        self.regions.read_recursive().write_bytes(addr, data)
    }
}
