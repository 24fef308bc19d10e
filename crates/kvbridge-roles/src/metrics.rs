//! Prometheus counters and histograms of one role, and an optional HTTP
//! endpoint that serves them.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::http::{ConnCounters, ConnLimits, ServerThread};

type Labels = Vec<(String, String)>;

/// The metrics of one role manager.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Rooms concluded, by `result` (`success` / `failed`).
    pub rooms: Family<Labels, Counter>,
    /// Chunks handed to the engine.
    pub chunks: Counter,
    /// Bytes confirmed delivered: written by this prefill's engine, or
    /// received into this decode's slots by rooms that succeeded.
    pub bytes: Counter,
    /// Blocks handed to the engine.
    pub blocks: Counter,
    /// Failures, by `reason` (a small fixed set of words).
    pub failures: Family<Labels, Counter>,
    /// Blacklisted sessions lifted by a probe (sglang's counter).
    pub session_recoveries: Counter,
    /// Peer messages dropped as malformed or out of region, by `kind`.
    pub dropped_messages: Family<Labels, Counter>,
    /// Room latency, seconds: from its first chunk (prefill) or its
    /// transfer request (decode) to its success.
    pub transfer_latency: Histogram,
    /// One chunk's engine time, seconds.
    pub chunk_latency: Histogram,
    /// KV bytes gathered into (prefill) or scattered from (decode) staging.
    pub staged_bytes: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics, all zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let rooms = Family::<Labels, Counter>::default();
        let chunks = Counter::default();
        let bytes = Counter::default();
        let blocks = Counter::default();
        let failures = Family::<Labels, Counter>::default();
        let session_recoveries = Counter::default();
        let dropped_messages = Family::<Labels, Counter>::default();
        let transfer_latency = Histogram::new(exponential_buckets(0.0005, 2.0, 20));
        let chunk_latency = Histogram::new(exponential_buckets(0.0001, 2.0, 20));
        let staged_bytes = Counter::default();
        registry.register(
            "kvbridge_rooms",
            "Rooms concluded, by result",
            rooms.clone(),
        );
        registry.register("kvbridge_chunks", "Chunks transferred", chunks.clone());
        registry.register(
            "kvbridge_transfer_bytes",
            "Bytes confirmed delivered: written to decode peers (prefill), received into this rank's slots (decode)",
            bytes.clone(),
        );
        registry.register(
            "kvbridge_transfer_blocks",
            "Blocks handed to the engine",
            blocks.clone(),
        );
        registry.register(
            "kvbridge_transfer_failures",
            "Transfer failures by reason",
            failures.clone(),
        );
        registry.register(
            "sglang:failed_session_recoveries",
            "Number of mooncake_session_ids un-blacklisted via probe",
            session_recoveries.clone(),
        );
        registry.register(
            "kvbridge_dropped_messages",
            "Peer messages dropped as malformed or out of region",
            dropped_messages.clone(),
        );
        registry.register(
            "kvbridge_transfer_latency_seconds",
            "Room latency: first chunk to conclusion (prefill), transfer request to success (decode)",
            transfer_latency.clone(),
        );
        registry.register(
            "kvbridge_chunk_latency_seconds",
            "Engine time of one chunk",
            chunk_latency.clone(),
        );
        registry.register(
            "kvbridge_staged_bytes",
            "KV bytes gathered into or scattered from staging buffers",
            staged_bytes.clone(),
        );
        Self {
            registry,
            rooms,
            chunks,
            bytes,
            blocks,
            failures,
            session_recoveries,
            dropped_messages,
            transfer_latency,
            chunk_latency,
            staged_bytes,
        }
    }

    fn label(key: &str, value: &str) -> Labels {
        vec![(key.to_owned(), value.to_owned())]
    }

    /// Counts one concluded room.
    pub fn room_concluded(&self, success: bool) {
        let result = if success { "success" } else { "failed" };
        self.rooms
            .get_or_create(&Self::label("result", result))
            .inc();
    }

    /// Counts one failure with a short `reason` word.
    pub fn failure(&self, reason: &str) {
        self.failures
            .get_or_create(&Self::label("reason", reason))
            .inc();
    }

    /// Counts one dropped peer message of `kind`.
    pub fn dropped(&self, kind: &str) {
        self.dropped_messages
            .get_or_create(&Self::label("kind", kind))
            .inc();
    }

    /// Counts `n` dropped peer messages of `kind`.
    pub fn dropped_n(&self, kind: &str, n: u64) {
        self.dropped_messages
            .get_or_create(&Self::label("kind", kind))
            .inc_by(n);
    }

    /// Failures counted for `reason`.
    pub fn failures_for(&self, reason: &str) -> u64 {
        self.failures
            .get_or_create(&Self::label("reason", reason))
            .get()
    }

    /// Dropped messages counted for `kind`.
    pub fn dropped_for(&self, kind: &str) -> u64 {
        self.dropped_messages
            .get_or_create(&Self::label("kind", kind))
            .get()
    }

    /// The OpenMetrics text exposition of every metric (ends in `# EOF`).
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            tracing::warn!("metrics encoding failed");
        }
        out
    }
}

/// The content type of [`Metrics::render`]'s text, which Prometheus
/// negotiates and parses as OpenMetrics.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Connection limits of the metrics endpoint (a scraper or two).
const METRICS_LIMITS: ConnLimits = ConnLimits {
    max_connections: 64,
    header_timeout: Duration::from_secs(20),
};

/// Serves `GET /metrics` for a [`Metrics`] until dropped. Accept errors
/// (e.g. the process is out of file descriptors) are logged and retried
/// after a short backoff; they never stop the endpoint.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    counters: Arc<ConnCounters>,
    _server: ServerThread,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks one) and serves on a thread of its own.
    pub fn start(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let app = Router::new().route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move { ([(CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], metrics.render()) }
            }),
        );
        let counters = Arc::new(ConnCounters::default());
        let server = ServerThread::spawn(
            "metrics",
            listener,
            app,
            METRICS_LIMITS,
            counters.clone(),
            None,
        )?;
        Ok(Self {
            addr,
            counters,
            _server: server,
        })
    }

    /// Where `/metrics` is served.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many accept calls have failed (and been retried) so far.
    pub fn accept_errors(&self) -> u64 {
        self.counters.accept_errors.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_sglang_counter_name() {
        let m = Metrics::new();
        m.session_recoveries.inc();
        m.failure("engine");
        m.room_concluded(true);
        let text = m.render();
        assert!(
            text.contains("sglang:failed_session_recoveries_total 1"),
            "{text}"
        );
        assert!(
            text.contains(r#"kvbridge_transfer_failures_total{reason="engine"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kvbridge_rooms_total{result="success"} 1"#),
            "{text}"
        );
        assert_eq!(m.failures_for("engine"), 1);
    }
}
