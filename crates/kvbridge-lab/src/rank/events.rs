//! The JSON-lines progress protocol between rank processes and the demo.

use std::io::Write;

use serde::{Deserialize, Serialize};

/// One progress event, one JSON object per stdout line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The rank is up: memory registered, sockets bound, pools filled.
    Ready {
        /// `prefill` or `decode`.
        role: String,
        /// Index of the rank in its role (TP rank + PP rank × TP).
        rank: u64,
        /// The transfer engine's session id.
        session: String,
        /// The port of the rank's zmq control socket.
        #[serde(default)]
        control_port: u16,
    },
    /// A decode rank sent a room's destination to the prefill.
    Started {
        /// The room.
        room: u64,
        /// When the decode began the room (before it sent the destination),
        /// in milliseconds since the Unix epoch; 0 from older ranks.
        #[serde(default)]
        unix_ms: f64,
    },
    /// A room concluded on this rank.
    Done {
        /// `prefill` or `decode`.
        role: String,
        /// Rank index.
        rank: u64,
        /// The room.
        room: u64,
        /// Whether the room succeeded.
        success: bool,
        /// Why it failed.
        reason: Option<String>,
        /// Transfer latency in milliseconds.
        latency_ms: f64,
        /// Bytes verified (decode).
        verified: u64,
        /// Bytes that did not match (decode).
        mismatched: u64,
        /// Whether the decode aborted it on purpose.
        aborted: bool,
        /// Whether the decode gave it up past its room timeout.
        #[serde(default)]
        timed_out: bool,
        /// When the room concluded, in milliseconds since the Unix epoch
        /// (the ranks share the host's clock); with `latency_ms` it gives
        /// the interval the room was in transfer.
        #[serde(default)]
        end_unix_ms: f64,
    },
    /// A decode rank paused (the supervisor's `pause`): it starts no new
    /// room until told which requests still run.
    Paused {
        /// Rank index.
        rank: u64,
        /// Every request it started has an index below this.
        below: u64,
    },
    /// The rank finished its workload.
    Finished {
        /// `prefill` or `decode`.
        role: String,
        /// Rank index.
        rank: u64,
    },
    /// The rank cannot continue.
    Error {
        /// What went wrong.
        message: String,
    },
}

/// Now, in milliseconds since the Unix epoch.
pub fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// Writes one event line to stdout (flushed, so a reader sees it at once).
pub fn emit(event: &Event) {
    if let Ok(line) = serde_json::to_string(event) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}
