//! PUSH sockets to peers, one per endpoint, opened on first use and kept
//! within a bound: at most `max_sockets` (clamped to what the process's
//! descriptor limit can hold), the least recently used idle one closed to
//! make room for a new endpoint, and any unused for [`IDLE_SOCKET`] closed.
//! Endpoints come from peers' messages (in open mode from anyone's), so
//! without the bound a stream of made-up endpoints would open sockets, and
//! descriptors, until the rank could open none.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{
    BUSY_WAIT, ControlContext, ControlError, ControlSecurity, DEFAULT_MAX_SOCKETS,
    SEND_QUEUE_MESSAGES, SOCKETS_PER_CONTEXT, zmq_call, zmq_err,
};

/// A socket not used for this long is closed (the next send reopens it).
pub const IDLE_SOCKET: Duration = Duration::from_secs(600);
/// How often idle sockets are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// Descriptors a socket may take (its connection and its mailbox), for
/// the clamp to the process's limit.
const FDS_PER_SOCKET: u64 = 2;
/// Share of the process's descriptor limit the pool may take.
const FD_SHARE: u64 = 2;

/// PUSH sockets to peers, one per endpoint, created on first use. libzmq
/// caps a context at 1023 sockets; past `SOCKETS_PER_CONTEXT` the pool
/// opens further contexts (client sockets need no ZAP handler).
pub struct PushPool {
    context: zmq::Context,
    security: ControlSecurity,
    send_timeout: Duration,
    max_sockets: usize,
    per_context: usize,
    sockets: Mutex<Sockets>,
    dropped: AtomicU64,
    evicted: AtomicU64,
}

/// One open socket: its context's index (0: the rank's) and last use.
struct Entry {
    context: usize,
    socket: Arc<Mutex<zmq::Socket>>,
    used: Instant,
}

/// The open sockets, the sockets open per context, and the extra
/// contexts. Sockets drop before their contexts (field order).
struct Sockets {
    by_endpoint: HashMap<String, Entry>,
    open: Vec<usize>,
    extra: Vec<zmq::Context>,
    swept: Instant,
}

impl Sockets {
    fn remove(&mut self, endpoint: &str) {
        if let Some(e) = self.by_endpoint.remove(endpoint)
            && let Some(n) = self.open.get_mut(e.context)
        {
            *n = n.saturating_sub(1);
        }
    }

    /// Closes sockets unused for [`IDLE_SOCKET`] (none a sender holds).
    fn sweep(&mut self, now: Instant) -> usize {
        if now.duration_since(self.swept) < SWEEP_EVERY {
            return 0;
        }
        self.swept = now;
        let idle: Vec<String> = self
            .by_endpoint
            .iter()
            .filter(|(_, e)| {
                now.duration_since(e.used) >= IDLE_SOCKET && Arc::strong_count(&e.socket) == 1
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in &idle {
            self.remove(k);
        }
        idle.len()
    }

    /// Closes the least recently used socket no sender holds; false when
    /// every socket is in use.
    fn evict_oldest(&mut self) -> bool {
        let oldest = self
            .by_endpoint
            .iter()
            .filter(|(_, e)| Arc::strong_count(&e.socket) == 1)
            .min_by_key(|(_, e)| e.used)
            .map(|(k, _)| k.clone());
        match oldest {
            Some(k) => {
                self.remove(&k);
                true
            }
            None => false,
        }
    }
}

impl std::fmt::Debug for PushPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sockets = self.sockets.lock();
        f.debug_struct("PushPool")
            .field("endpoints", &sockets.by_endpoint.len())
            .field("contexts", &(1 + sockets.extra.len()))
            .finish()
    }
}

/// The process's soft limit on open descriptors (`None`: unknown or
/// unlimited), from `/proc/self/limits`.
fn fd_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    soft_fd_limit(&limits)
}

/// The soft "Max open files" value of a `/proc/<pid>/limits` text.
fn soft_fd_limit(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `wanted` sockets, or fewer when the descriptor limit could not hold
/// them (the pool takes at most half of it; at least 64 sockets).
fn clamp_to_fds(wanted: usize, limit: Option<u64>) -> usize {
    let Some(limit) = limit else {
        return wanted;
    };
    let fits = usize::try_from(limit / FD_SHARE / FDS_PER_SOCKET).unwrap_or(usize::MAX);
    wanted.min(fits.max(64))
}

impl PushPool {
    /// A pool of sockets secured as `control` says, whose sends give up
    /// after `send_timeout` (zmq `SNDTIMEO`), at most
    /// [`DEFAULT_MAX_SOCKETS`] of them.
    pub fn new(control: &ControlContext, send_timeout: Duration) -> Self {
        Self::with_limits(
            control,
            send_timeout,
            DEFAULT_MAX_SOCKETS,
            SOCKETS_PER_CONTEXT,
        )
    }

    /// [`PushPool::new`] with at most `max_sockets` sockets.
    pub fn capped(control: &ControlContext, send_timeout: Duration, max_sockets: usize) -> Self {
        Self::with_limits(control, send_timeout, max_sockets, SOCKETS_PER_CONTEXT)
    }

    /// [`PushPool::new`] with at most `max_sockets` sockets (fewer when the
    /// descriptor limit cannot hold them, logged), `per_context` in each
    /// zmq context (tests use small numbers).
    pub fn with_limits(
        control: &ControlContext,
        send_timeout: Duration,
        max_sockets: usize,
        per_context: usize,
    ) -> Self {
        let limit = fd_limit();
        let max = clamp_to_fds(max_sockets, limit);
        if max < max_sockets {
            tracing::info!(
                asked = max_sockets,
                max,
                fd_limit = limit.unwrap_or(0),
                "control sockets capped to what the descriptor limit holds (raise RLIMIT_NOFILE for more)"
            );
        }
        Self {
            context: control.context().clone(),
            security: control.security().clone(),
            send_timeout,
            max_sockets: max.max(1),
            per_context: per_context.clamp(1, SOCKETS_PER_CONTEXT),
            sockets: Mutex::new(Sockets {
                by_endpoint: HashMap::new(),
                open: Vec::new(),
                extra: Vec::new(),
                swept: Instant::now(),
            }),
            dropped: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    /// The zmq contexts the pool uses (the rank's own and any extra).
    pub fn contexts(&self) -> usize {
        1 + self.sockets.lock().extra.len()
    }

    /// The most sockets the pool keeps open.
    pub fn max_sockets(&self) -> usize {
        self.max_sockets
    }

    fn socket(&self, endpoint: &str) -> Result<Arc<Mutex<zmq::Socket>>, ControlError> {
        let now = Instant::now();
        let mut sockets = self.sockets.lock();
        if let Some(e) = sockets.by_endpoint.get_mut(endpoint) {
            e.used = now;
            return Ok(e.socket.clone());
        }
        let idle = sockets.sweep(now);
        if idle > 0 {
            tracing::debug!(closed = idle, "closed idle control sockets");
        }
        if sockets.by_endpoint.len() >= self.max_sockets {
            if !sockets.evict_oldest() {
                return Err(ControlError::TooManySockets {
                    endpoint: endpoint.to_owned(),
                    max: self.max_sockets,
                });
            }
            let n = self.evicted.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(
                    max = self.max_sockets,
                    evicted_total = n,
                    "all control sockets open; closed the least recently used for a new endpoint"
                );
            }
        }
        // The first context with room: the rank's own, then the extras,
        // opening one more when all are full.
        let per = self.per_context;
        let slot = match sockets.open.iter().position(|&n| n < per) {
            Some(i) => i,
            None => sockets.open.len(),
        };
        if slot >= sockets.open.len() {
            sockets.open.push(0);
        }
        while sockets.extra.len() < slot {
            sockets.extra.push(zmq::Context::new());
        }
        let context = match slot {
            0 => self.context.clone(),
            i => sockets.extra[i - 1].clone(),
        };
        let socket = zmq_call!(context.socket(zmq::PUSH), endpoint)?;
        if endpoint.contains('[') {
            zmq_call!(socket.set_ipv6(true), endpoint)?;
        }
        self.security.apply_client(&socket, endpoint)?;
        zmq_call!(socket.set_sndhwm(SEND_QUEUE_MESSAGES), endpoint)?;
        let ms = i32::try_from(self.send_timeout.as_millis()).unwrap_or(i32::MAX);
        zmq_call!(socket.set_sndtimeo(ms), endpoint)?;
        zmq_call!(socket.set_linger(0), endpoint)?;
        zmq_call!(socket.set_tcp_keepalive(1), endpoint)?;
        zmq_call!(socket.connect(endpoint), endpoint)?;
        let socket = Arc::new(Mutex::new(socket));
        sockets.by_endpoint.insert(
            endpoint.to_owned(),
            Entry {
                context: slot,
                socket: socket.clone(),
                used: now,
            },
        );
        sockets.open[slot] += 1;
        Ok(socket)
    }

    /// Sends one multipart message to `endpoint` (`tcp://host:port`).
    pub fn send<I, F>(&self, endpoint: &str, frames: I) -> Result<(), ControlError>
    where
        I: IntoIterator<Item = F>,
        F: Into<zmq::Message>,
    {
        let socket = self.socket(endpoint)?;
        let guard = socket.lock();
        guard
            .send_multipart(frames, 0)
            .map_err(zmq_err("send", endpoint))
    }

    /// Sends without ever blocking, for threads that serve every peer (an
    /// inbox): when `endpoint`'s queue is full the message is dropped,
    /// counted and logged (once per burst), and `false` returned.
    pub fn try_send<I, F>(&self, endpoint: &str, frames: I) -> bool
    where
        I: IntoIterator<Item = F>,
        F: Into<zmq::Message>,
    {
        let socket = match self.socket(endpoint) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%endpoint, error = %e, "cannot open a control socket; message dropped");
                return false;
            }
        };
        let Some(guard) = socket.try_lock_for(BUSY_WAIT) else {
            // Another thread has been sending to this peer for a while (and
            // may be blocked on it): never wait behind it for long.
            self.note_dropped(endpoint, "socket busy");
            return false;
        };
        match guard.send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => true,
            Err(e) => {
                drop(guard);
                self.note_dropped(endpoint, &e.to_string());
                false
            }
        }
    }

    fn note_dropped(&self, endpoint: &str, why: &str) {
        let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(%endpoint, why, dropped_total = n, "control message dropped: peer not keeping up");
        }
    }

    /// Messages [`PushPool::try_send`] dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Closes the socket to `endpoint` (a peer known to be gone).
    pub fn disconnect(&self, endpoint: &str) {
        self.sockets.lock().remove(endpoint);
    }

    /// Sockets closed to make room for a new endpoint so far.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Sockets open now.
    pub fn open(&self) -> usize {
        self.sockets.lock().by_endpoint.len()
    }

    /// Closes every socket.
    pub fn close_all(&self) {
        let mut sockets = self.sockets.lock();
        sockets.by_endpoint.clear();
        sockets.open.iter_mut().for_each(|n| *n = 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_cap_fits_the_descriptor_limit() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        assert_eq!(soft_fd_limit(limits), Some(1024));
        assert_eq!(
            soft_fd_limit("Max open files  unlimited  unlimited  files"),
            None
        );
        assert_eq!(clamp_to_fds(16384, Some(1024)), 256);
        assert_eq!(clamp_to_fds(16384, Some(1 << 20)), 16384);
        assert_eq!(clamp_to_fds(16384, Some(100)), 64);
        assert_eq!(clamp_to_fds(16384, None), 16384);
        assert!(fd_limit().is_some_and(|l| l > 0) || fd_limit().is_none());
    }
}
