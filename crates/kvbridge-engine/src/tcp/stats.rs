//! The TCP engine's counters, and the rate limit of the warnings that go
//! with its refusals (a hostile peer must not flood the log).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) use crate::session::burst::Burst;
use crate::session::server::Gate;

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

/// The live counters behind [`EngineStats`], and the rate limits of their warnings.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub requests_refused: AtomicU64,
    pub auth_failures: AtomicU64,
    pub bad_frames: AtomicU64,
    /// The accept loop's counters (accepted, open, rejected, accept errors).
    pub gate: Gate,
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
            connections_accepted: l(&self.gate.accepted),
            connections_open: l(&self.gate.open),
            connections_rejected: l(&self.gate.refused),
            accept_errors: l(&self.gate.accept_errors),
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
