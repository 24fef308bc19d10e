//! The TCP engine's counters, and the rate limit of the warnings that go
//! with its refusals (a hostile peer must not flood the log).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Counters of one TCP engine, for logs, metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineStats {
    /// Payload bytes sent and acknowledged.
    pub bytes_sent: u64,
    /// Payload bytes received into registered memory.
    pub bytes_received: u64,
    /// Requests refused because a destination lay outside our regions.
    pub requests_refused: u64,
    /// Connections refused at authentication.
    pub auth_failures: u64,
    /// Malformed frames (connection dropped).
    pub bad_frames: u64,
    /// Connections accepted.
    pub connections_accepted: u64,
    /// Accepted connections open now (a gauge, at most `max_connections`).
    pub connections_open: u64,
    /// Connections closed at once because `max_connections` were open.
    pub connections_rejected: u64,
    /// `accept` failures for lack of resources (EMFILE, ENFILE, ENOBUFS,
    /// ENOMEM), each followed by a back-off.
    pub accept_errors: u64,
    /// Connections dropped because their handshake was not done within `connect_timeout_ms`.
    pub handshake_timeouts: u64,
    /// Connections closed in their handshake to admit a newer one, because
    /// `max_pending_handshakes` were pending.
    pub handshakes_evicted: u64,
    /// Accepted connections in their handshake now (a gauge, at most
    /// `max_pending_handshakes`).
    pub handshakes_pending: u64,
    /// Connections closed after `idle_timeout_ms` without a request.
    pub idle_closed: u64,
    /// Requests dropped (with their connection) because they were not
    /// received whole within `request_timeout_ms`, or stalled for `io_timeout_ms`.
    pub request_timeouts: u64,
    /// Requests abandoned mid-payload (with their connection) because the
    /// engine shut down, the peer was fenced or a destination was deregistered.
    pub requests_aborted: u64,
    /// Connections and requests refused because the peer is fenced.
    pub fenced_refusals: u64,
    /// Connections the sender reset (it gave up on its batch): the requests
    /// still queued on them were dropped unread, never written.
    pub resets_by_sender: u64,
    /// Submitted batches whose state is still alive (a gauge; 0 when idle).
    pub live_batches: u64,
}

/// Quiet time after which a repeated warning is logged again.
const LOG_QUIET: Duration = Duration::from_secs(10);

/// Rate limit of one repeated warning: the first of a burst is logged, the
/// rest are counted, and the next one after [`LOG_QUIET`] is logged with
/// how many were suppressed in between.
#[derive(Debug, Default)]
pub(crate) struct Burst {
    state: Mutex<(Option<Instant>, u64)>,
}

impl Burst {
    /// `Some(suppressed since the last logged one)` when this occurrence should be logged.
    pub(crate) fn hit(&self) -> Option<u64> {
        let now = Instant::now();
        let mut s = self.state.lock();
        match s.0 {
            Some(last) if now.duration_since(last) < LOG_QUIET => {
                s.1 += 1;
                None
            }
            _ => {
                let suppressed = std::mem::take(&mut s.1);
                s.0 = Some(now);
                Some(suppressed)
            }
        }
    }
}

/// The live counters behind [`EngineStats`], and the rate limits of their warnings.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub requests_refused: AtomicU64,
    pub auth_failures: AtomicU64,
    pub bad_frames: AtomicU64,
    pub connections_accepted: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_rejected: AtomicU64,
    pub accept_errors: AtomicU64,
    pub handshake_timeouts: AtomicU64,
    pub handshakes_evicted: AtomicU64,
    pub handshakes_pending: AtomicU64,
    pub idle_closed: AtomicU64,
    pub request_timeouts: AtomicU64,
    pub requests_aborted: AtomicU64,
    pub fenced_refusals: AtomicU64,
    pub resets_by_sender: AtomicU64,
    /// Shared with every batch state (which counts itself in and out).
    pub live_batches: Arc<AtomicU64>,
    pub log_refused: Burst,
    pub log_auth: Burst,
    pub log_bad_frame: Burst,
    pub log_rejected: Burst,
    pub log_handshake: Burst,
    pub log_evicted: Burst,
    pub log_idle: Burst,
    pub log_request: Burst,
    pub log_fenced: Burst,
}

/// Add one to a counter.
pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Stats {
    /// A snapshot of the counters.
    pub(crate) fn snapshot(&self) -> EngineStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        EngineStats {
            bytes_sent: l(&self.bytes_sent),
            bytes_received: l(&self.bytes_received),
            requests_refused: l(&self.requests_refused),
            auth_failures: l(&self.auth_failures),
            bad_frames: l(&self.bad_frames),
            connections_accepted: l(&self.connections_accepted),
            connections_open: l(&self.connections_open),
            connections_rejected: l(&self.connections_rejected),
            accept_errors: l(&self.accept_errors),
            handshake_timeouts: l(&self.handshake_timeouts),
            handshakes_evicted: l(&self.handshakes_evicted),
            handshakes_pending: l(&self.handshakes_pending),
            idle_closed: l(&self.idle_closed),
            request_timeouts: l(&self.request_timeouts),
            requests_aborted: l(&self.requests_aborted),
            fenced_refusals: l(&self.fenced_refusals),
            resets_by_sender: l(&self.resets_by_sender),
            live_batches: l(&self.live_batches),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_logs_its_first_occurrence_only() {
        let b = Burst::default();
        assert_eq!(b.hit(), Some(0));
        assert_eq!(b.hit(), None);
        assert_eq!(b.hit(), None);
        // After the quiet time the next one is logged with the count.
        b.state.lock().0 = Some(Instant::now() - LOG_QUIET);
        assert_eq!(b.hit(), Some(2));
    }
}
