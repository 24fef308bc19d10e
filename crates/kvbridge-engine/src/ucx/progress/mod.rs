//! The UCX engine's progress thread: it owns the UCP context and worker
//! (single-thread mode), and is the only thread that calls UCX.
//!
//! Callers hand it commands over a channel (and wake it through an eventfd):
//! batches of puts, memory (de)registrations, shutdown. Per batch it issues
//! one `ucp_put_nbx` per merged run and then an endpoint flush, and completes
//! the batch's handle when every request (the flush last) has completed —
//! that is, when the bytes are in the peer's memory. When a peer with work
//! in flight completes nothing for the I/O timeout, its endpoint is closed
//! forcibly, which fails everything still in flight to that peer and nothing
//! else. While work is outstanding the thread spins on `ucp_worker_progress`
//! (napping 1 ms at a time when nothing happens); when idle it sleeps on the
//! worker's armed event fd and the wake-up eventfd, so a target still
//! progresses incoming transfers (UCX's TCP transport needs the target's
//! worker to run).

mod issue;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use kvbridge_mem::Region;

use super::api::{Context, MemHandle, UcxError, Worker};
use super::side::PeerInfo;
use super::{Shared, sys};
use crate::batch::Completer;
use crate::{ErrorKind, TransferError};
use issue::{BatchState, Closing, Peer};

/// One put of a batch: a run of contiguous blocks (source and destination).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Put {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    /// Index of the run's first block in the submitted batch.
    pub block: usize,
    /// Start of the peer region that holds the destination.
    pub region: u64,
}

/// A batch, checked and merged by `submit`.
#[derive(Debug)]
pub(crate) struct BatchCmd {
    pub peer: Arc<PeerInfo>,
    pub puts: Vec<Put>,
    pub bytes: u64,
    pub completer: Completer,
    /// Fail the batch when its peer completes nothing for this long.
    pub timeout: Duration,
}

/// The answer to a [`Cmd::Map`]: each region's start and packed remote key.
pub(crate) type MapReply = Result<Vec<(u64, Vec<u8>)>, UcxError>;

/// What callers ask of the progress thread.
#[derive(Debug)]
pub(crate) enum Cmd {
    Batch(BatchCmd),
    /// `ucp_mem_map` these regions; reply with their packed keys.
    Map {
        regions: Vec<Region>,
        reply: Sender<MapReply>,
    },
    /// Unmap these regions once every batch queued before completed.
    Unmap {
        addrs: Vec<u64>,
        reply: Sender<()>,
    },
    Shutdown,
}

/// The eventfd that wakes the progress thread.
#[derive(Debug)]
pub(crate) struct Wake(pub OwnedFd);

impl Wake {
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: plain eventfd creation; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(Self(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }

    pub(crate) fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd; a full
        // counter (EAGAIN) already means "awake".
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    fn drain(&self) {
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer; non-blocking.
        unsafe { libc::read(self.0.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
    }
}

struct PendingUnmap {
    /// Runs once every batch with a smaller id completed.
    upto: u64,
    /// Unmaps only registrations older than this map generation (a region
    /// registered again meanwhile keeps its new handle).
    before_gen: u64,
    addrs: Vec<u64>,
    reply: Sender<()>,
}

/// The thread's state. Field order is drop order: keys and handles before
/// the worker, the worker before the context.
struct Progress {
    peers: HashMap<String, Peer>,
    closing: Vec<Closing>,
    /// Endpoints without peer-error mode whose peer failed: UCX cannot
    /// cancel their requests, so they (and their keys) stay until shutdown.
    abandoned: Vec<Closing>,
    /// Batches with requests in flight; a batch whose completer is gone
    /// (failed on timeout) stays until UCX completed its requests.
    batches: Vec<Rc<BatchState>>,
    unmaps: Vec<PendingUnmap>,
    /// Local registrations: start -> (length, handle, map generation).
    mems: BTreeMap<u64, (u64, MemHandle, u64)>,
    map_gen: u64,
    /// Handles replaced by a re-registration before their unmap ran: each
    /// dropped once the batches queued before the replacement completed.
    retired: Vec<(u64, MemHandle)>,
    next_batch: u64,
    stopping: bool,
    /// Connect in peer-error mode; cleared for good once the transports
    /// turn out not to support it (shared memory in UCX 1.13).
    peer_errors: bool,
    shared: Arc<Shared>,
    worker: Worker,
    ctx: Context,
}

/// Start-up result sent back to `UcxEngine::new`: the worker address.
pub(crate) type Ready = Result<Vec<u8>, UcxError>;

/// Whether a `UCX_TLS` list names only intra-node transports, none of
/// which can report a failed peer in UCX 1.13: endpoints then skip the
/// peer-error mode (which UCX would refuse) and rely on the I/O timeout.
fn shared_memory_only(tls: &str) -> bool {
    const SHM: &[&str] = &[
        "self", "sm", "shm", "mm", "posix", "sysv", "cma", "knem", "xpmem",
    ];
    !tls.starts_with('^')
        && tls
            .split(',')
            .map(str::trim)
            .all(|t| SHM.contains(&t.to_ascii_lowercase().as_str()))
}

/// Body of the progress thread.
pub(crate) fn run(
    overrides: Vec<(String, String)>,
    shared: Arc<Shared>,
    rx: Receiver<Cmd>,
    wake: Arc<Wake>,
    ready: Sender<Ready>,
) {
    let setup = || -> Result<(Context, Worker, Vec<u8>, i32), UcxError> {
        let ctx = Context::new(&overrides)?;
        let worker = Worker::new(&ctx)?;
        let addr = worker.address()?;
        let efd = worker.event_fd()?;
        Ok((ctx, worker, addr, efd))
    };
    let (ctx, worker, addr, efd) = match setup() {
        Ok(v) => v,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(addr));
    let tls = overrides
        .iter()
        .find(|(k, _)| k == "TLS")
        .map(|(_, v)| v.clone())
        .or_else(|| std::env::var("UCX_TLS").ok());
    let peer_errors = !tls.as_deref().is_some_and(shared_memory_only);
    let mut p = Progress {
        peers: HashMap::new(),
        closing: Vec::new(),
        abandoned: Vec::new(),
        batches: Vec::new(),
        unmaps: Vec::new(),
        mems: BTreeMap::new(),
        map_gen: 0,
        retired: Vec::new(),
        next_batch: 0,
        stopping: false,
        peer_errors,
        shared,
        worker,
        ctx,
    };
    p.main_loop(&rx, &wake, efd);
    p.shutdown(&rx);
}

impl Progress {
    fn main_loop(&mut self, rx: &Receiver<Cmd>, wake: &Wake, efd: i32) {
        // Empty progress rounds before sleeping: a burst of traffic is
        // followed without a sleep and wake-up per message.
        const SPINS: u32 = 256;
        let mut quiet = 0u32;
        loop {
            let mut commands = false;
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Shutdown) | Err(crossbeam_channel::TryRecvError::Disconnected) => {
                        return;
                    }
                    Ok(cmd) => {
                        self.handle(cmd);
                        commands = true;
                    }
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                }
            }
            let mut events = 0;
            loop {
                let k = self.worker.progress();
                events += k;
                if k == 0 {
                    break;
                }
            }
            // Completions only happen inside progress; timeouts are
            // looked at every few dozen empty rounds.
            if events > 0 || commands || quiet.is_multiple_of(64) {
                self.reap();
            }
            if events > 0 || commands {
                quiet = 0;
                continue;
            }
            quiet += 1;
            if quiet < SPINS {
                std::hint::spin_loop();
                continue;
            }
            quiet = 0;
            let busy = self.batches.iter().any(|b| b.is_live()) || !self.closing.is_empty();
            match self.worker.arm() {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => tracing::warn!(error = %e, "ucx: cannot arm the worker"),
            }
            let timeout = if busy { 1 } else { 1000 };
            let mut fds = [
                libc::pollfd {
                    fd: efd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: wake.0.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: polls two live descriptors described by a live array.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            wake.drain();
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Batch(b) => self.issue(b),
            Cmd::Map { regions, reply } => {
                let _ = reply.send(self.map(&regions));
            }
            Cmd::Unmap { addrs, reply } => self.unmaps.push(PendingUnmap {
                upto: self.next_batch,
                before_gen: self.map_gen,
                addrs,
                reply,
            }),
            Cmd::Shutdown => {}
        }
    }

    fn map(&mut self, regions: &[Region]) -> MapReply {
        let mut done: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut result = Ok(());
        for r in regions {
            // SAFETY: the engine registered the region in its registry first,
            // under the registration contract that keeps it valid memory of
            // `r.kind` until it is deregistered (which unmaps it here first).
            let m = unsafe { self.ctx.mem_map(r.addr, r.len, r.kind) };
            match m.and_then(|m| m.pack_rkey().map(|k| (m, k))) {
                Ok((m, k)) => {
                    self.map_gen += 1;
                    if let Some(old) = self.mems.insert(r.addr, (r.len, m, self.map_gen)) {
                        self.retired.push((self.next_batch, old.1));
                    }
                    done.push((r.addr, k));
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        match result {
            Ok(()) => Ok(done),
            Err(e) => {
                for (a, _) in done {
                    self.mems.remove(&a);
                }
                Err(e)
            }
        }
    }

    /// Time out late batches, retire failed peers, complete finished
    /// batches, finish closes and run unmaps whose batches are done.
    fn reap(&mut self) {
        let now = Instant::now();
        for b in &self.batches {
            let late = b.clock.idle(now) > b.timeout;
            if b.outstanding.get() > 0 && late && !b.timed_out.get() {
                b.timed_out.set(true);
                if let Some(p) = self.peers.get_mut(&b.session) {
                    p.timed_out = true;
                    if p.failed.get() == 0 {
                        p.failed.set(sys::UCS_ERR_TIMED_OUT);
                    }
                }
            }
        }
        let failed: Vec<String> = self
            .peers
            .iter()
            .filter(|(_, p)| p.failed.get() != 0)
            .map(|(s, _)| s.clone())
            .collect();
        for s in failed {
            if let Some(p) = self.peers.remove(&s) {
                let st = p.failed.get();
                let status = if p.timed_out {
                    sys::UCS_ERR_TIMED_OUT
                } else {
                    st
                };
                tracing::info!(session = %s, status = %self.worker.status_text(st), "ucx: peer failed; endpoint closed");
                for b in self.batches.iter().filter(|b| b.session == s) {
                    if b.peer_status.get() == 0 {
                        b.peer_status.set(status);
                    }
                }
                self.retire(p);
            }
        }
        let mut i = 0;
        while i < self.batches.len() {
            let b = &self.batches[i];
            if b.outstanding.get() == 0 {
                let b = self.batches.swap_remove(i);
                self.complete(&b);
                continue;
            }
            if b.timed_out.get() && b.is_live() {
                // Fail it now; its requests finish (or not) on their own.
                let b = b.clone();
                self.complete(&b);
            }
            i += 1;
        }
        let worker = &self.worker;
        self.closing.retain_mut(|c| {
            let Some(req) = c.req.take() else {
                return false;
            };
            if worker.request_status(&req).is_some() {
                worker.request_free(req);
                return false;
            }
            if c.since.elapsed() > Duration::from_secs(30) {
                tracing::warn!("ucx: an endpoint close has not completed in 30 s");
                c.since = Instant::now();
            }
            c.req = Some(req);
            true
        });
        // Batches of abandoned endpoints do not hold unmaps back: their peer
        // is gone and UCX may never complete (nor progress) their requests.
        let oldest = self
            .batches
            .iter()
            .filter(|b| !b.abandoned.get())
            .map(|b| b.id)
            .min()
            .unwrap_or(u64::MAX);
        let (ready, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.unmaps)
            .into_iter()
            .partition(|u| u.upto <= oldest);
        self.unmaps = later;
        for u in ready {
            self.unmap(u);
        }
        self.retired.retain(|(upto, _)| *upto > oldest);
    }

    /// Stop: fail what is queued, close every endpoint, wait (bounded) for
    /// outstanding requests, unmap, then drop the worker and the context.
    fn shutdown(mut self, rx: &Receiver<Cmd>) {
        self.stopping = true;
        while let Ok(cmd) = rx.try_recv() {
            match cmd {
                Cmd::Batch(b) => b.completer.complete(Err(TransferError::new(
                    &b.peer.session,
                    None,
                    ErrorKind::Shutdown,
                    "engine shut down",
                ))),
                Cmd::Map { reply, .. } => {
                    let _ = reply.send(Err(UcxError::Shutdown));
                }
                Cmd::Unmap { addrs, reply } => self.unmaps.push(PendingUnmap {
                    upto: 0,
                    before_gen: self.map_gen + 1,
                    addrs,
                    reply,
                }),
                Cmd::Shutdown => {}
            }
        }
        let peers: Vec<Peer> = self.peers.drain().map(|(_, p)| p).collect();
        for p in peers {
            self.retire(p);
        }
        let t = Instant::now();
        let waiting =
            |p: &Self| !p.closing.is_empty() || p.batches.iter().any(|b| !b.abandoned.get());
        while waiting(&self) && t.elapsed() < Duration::from_secs(2) {
            self.worker.progress();
            self.reap();
        }
        if !self.batches.is_empty() || !self.closing.is_empty() {
            // UCX still holds requests pointing at our state: keep all of it
            // (and UCX itself) alive rather than free memory it may touch.
            tracing::warn!("ucx: requests still outstanding at shutdown; leaking the worker");
            for b in &self.batches {
                if let Some(c) = b.completer.borrow_mut().take() {
                    c.complete(Err(TransferError::new(
                        &b.session,
                        None,
                        ErrorKind::Shutdown,
                        "engine shut down",
                    )));
                }
            }
            std::mem::forget(self);
            return;
        }
        for u in std::mem::take(&mut self.unmaps) {
            self.unmap(u);
        }
        self.retired.clear();
    }

    fn unmap(&mut self, u: PendingUnmap) {
        for a in &u.addrs {
            if self.mems.get(a).is_some_and(|m| m.2 <= u.before_gen) {
                self.mems.remove(a);
            }
        }
        let _ = u.reply.send(());
    }
}

/// The local registration covering `[addr, addr + len)`: its start, end
/// and memory handle.
fn mem_of(
    mems: &BTreeMap<u64, (u64, MemHandle, u64)>,
    addr: u64,
    len: u64,
) -> Option<(u64, u64, &MemHandle)> {
    let (&start, (rlen, m, _)) = mems.range(..=addr).next_back()?;
    let end = start.saturating_add(*rlen);
    (addr.saturating_add(len) <= end).then_some((start, end, m))
}

#[cfg(test)]
mod tests {
    use super::shared_memory_only;

    #[test]
    fn shared_memory_only_transport_lists() {
        assert!(shared_memory_only("posix,cma,self"));
        assert!(shared_memory_only("sm,self"));
        assert!(!shared_memory_only("tcp"));
        assert!(!shared_memory_only("rc,sm"));
        assert!(!shared_memory_only("^tcp"));
        assert!(!shared_memory_only("all"));
    }
}
