//! The bootstrap server's refusal counters and limits: every refused
//! request or connection is counted (readable with
//! [`super::BootstrapServer::stats`]) and logged once per burst of its cause.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::http::{BurstLog, ConnCounters};

/// Resource limits of the bootstrap server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootstrapLimits {
    /// Most connections served at once; a new one beyond that closes the
    /// oldest idle connection (one that never sent a request first), or is
    /// closed itself when every connection is busy.
    pub max_connections: usize,
    /// Close a connection that has not sent a whole request head within
    /// this long (also between keep-alive requests).
    pub header_timeout: Duration,
    /// Refuse a request whose body has not arrived within this long (408).
    pub body_timeout: Duration,
    /// Refuse a request body longer than this (413).
    pub max_body_bytes: usize,
    /// Most request bodies being read at once; a request beyond gets 503
    /// at once, so slow bodies cannot hold every connection (health checks
    /// and reads need none).
    pub max_pending_bodies: usize,
    /// Most `register_dp_rank` entries kept (503 beyond, until cleanup).
    pub max_dp_rank_entries: usize,
}

/// Default [`BootstrapLimits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Default [`BootstrapLimits::header_timeout`]: longer than the 15 s an
/// idle pooled `ureq` connection is kept, so a client never reuses one the
/// server is closing.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(20);
/// Default [`BootstrapLimits::body_timeout`].
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`BootstrapLimits::max_body_bytes`].
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 * 1024;
/// Default [`BootstrapLimits::max_pending_bodies`].
pub const DEFAULT_MAX_PENDING_BODIES: usize = 64;
/// Default [`BootstrapLimits::max_dp_rank_entries`].
pub const DEFAULT_MAX_DP_RANK_ENTRIES: usize = 1 << 20;

impl Default for BootstrapLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_pending_bodies: DEFAULT_MAX_PENDING_BODIES,
            max_dp_rank_entries: DEFAULT_MAX_DP_RANK_ENTRIES,
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// A write without a valid signature in secret mode (401), or a replay.
    Unauthorized,
    /// A body that does not parse, or values out of range (400 / 422).
    Invalid,
    /// A registration that conflicts with the table: a live prefill's slot
    /// or a different topology (409).
    Conflict,
    /// A body over the size limit (413).
    BodyTooLarge,
    /// A body that did not arrive in time (408).
    BodyTimeout,
    /// A table or the replay memory is full (503).
    Full,
}

impl Refusal {
    const ALL: [Refusal; 6] = [
        Refusal::Unauthorized,
        Refusal::Invalid,
        Refusal::Conflict,
        Refusal::BodyTooLarge,
        Refusal::BodyTimeout,
        Refusal::Full,
    ];

    /// A short word for logs.
    pub fn word(self) -> &'static str {
        match self {
            Refusal::Unauthorized => "unauthorized",
            Refusal::Invalid => "invalid",
            Refusal::Conflict => "conflict",
            Refusal::BodyTooLarge => "body_too_large",
            Refusal::BodyTimeout => "body_timeout",
            Refusal::Full => "full",
        }
    }

    /// The cause of a state answer with this status (`None`: not a refusal).
    pub fn from_status(status: u16) -> Option<Self> {
        match status {
            400 | 422 => Some(Refusal::Invalid),
            401 => Some(Refusal::Unauthorized),
            409 => Some(Refusal::Conflict),
            408 => Some(Refusal::BodyTimeout),
            413 => Some(Refusal::BodyTooLarge),
            503 => Some(Refusal::Full),
            _ => None,
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|r| *r == self).unwrap_or(0)
    }
}

/// What the bootstrap server refused and replaced so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BootstrapStats {
    /// Writes refused for a missing, bad or replayed signature (401).
    pub unauthorized: u64,
    /// Requests refused as unparsable or out of range (400 / 422).
    pub invalid: u64,
    /// Registrations refused as conflicting (409).
    pub conflicts: u64,
    /// Bodies refused as too large (413).
    pub body_too_large: u64,
    /// Bodies refused as too slow (408).
    pub body_timeouts: u64,
    /// Writes refused because a table was full (503).
    pub full: u64,
    /// Prefill addresses replaced by a later registration.
    pub replacements: u64,
    /// Connections closed on arrival (cap reached, all busy).
    pub connections_refused: u64,
    /// Idle connections closed to make room for new ones.
    pub connections_evicted: u64,
    /// Connections closed for not sending a request head in time.
    pub header_timeouts: u64,
    /// Failed accept calls (retried after a backoff).
    pub accept_errors: u64,
}

/// Refusal counters and their burst log.
#[derive(Debug, Default)]
pub(crate) struct Guard {
    counts: [AtomicU64; 6],
    log: BurstLog,
    /// The accept loop's counters.
    pub conn: Arc<ConnCounters>,
}

impl Guard {
    /// Counts one refusal and logs it when it starts a burst.
    pub fn refuse(&self, cause: Refusal, route: &str, reason: &str) {
        self.counts[cause.index()].fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = self.log.should_log(cause.word()) {
            tracing::warn!(
                cause = cause.word(),
                route,
                reason,
                suppressed,
                "bootstrap request refused"
            );
        }
    }

    /// A snapshot of every counter; `replacements` comes from the state.
    pub fn stats(&self, replacements: u64) -> BootstrapStats {
        let c = |r: Refusal| self.counts[r.index()].load(Ordering::Relaxed);
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BootstrapStats {
            unauthorized: c(Refusal::Unauthorized),
            invalid: c(Refusal::Invalid),
            conflicts: c(Refusal::Conflict),
            body_too_large: c(Refusal::BodyTooLarge),
            body_timeouts: c(Refusal::BodyTimeout),
            full: c(Refusal::Full),
            replacements,
            connections_refused: n(&self.conn.refused),
            connections_evicted: n(&self.conn.evicted),
            header_timeouts: n(&self.conn.header_timeouts),
            accept_errors: n(&self.conn.accept_errors),
        }
    }
}
