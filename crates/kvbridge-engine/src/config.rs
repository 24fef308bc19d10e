//! The engines' configuration, one serde-friendly struct (a file's
//! `engine` section, or flags) in three parts:
//!
//! * what every transport shares: where it listens and what it announces
//!   (`listen_host`, `advertise_host`, `port`), the connect and I/O
//!   timeouts and the cluster secret (the session layer's handshake);
//! * the TCP engine's settings (also those of the CUDA IPC engine's
//!   control server): connections, framing, limits against hostile peers;
//!   flat, as they always were, so existing files and code keep working;
//! * per-transport sections: `ipc` (copy tuning) and `ucx` (UCX settings).
//!
//! **Never:** holds anything but plain settings (no sockets, no secrets
//! other than the configured one, which `Debug` redacts).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::ipc::CopyTuning;

/// Configuration of every engine ([`crate::TcpEngine`], the CUDA IPC and
/// UCX engines); serde-friendly (file or flags), every field optional with
/// the defaults below. Old files (flat, without sections) parse unchanged.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    // Shared by every transport.
    /// Address to listen on (`"127.0.0.1"` by default; the node's IP in production).
    pub listen_host: String,
    /// Host peers should dial, when it differs from `listen_host` (e.g. listening on `0.0.0.0`).
    pub advertise_host: Option<String>,
    /// Port to listen on; 0 picks a free one.
    pub port: u16,
    /// Limit on establishing a connection and its whole handshake (not per
    /// read: a peer trickling its hello is dropped when it passes), in milliseconds.
    pub connect_timeout_ms: u64,
    /// Limit on any single read or write making no progress, in milliseconds.
    pub io_timeout_ms: u64,
    /// Shared cluster secret: when set, connections must prove knowledge of it
    /// (HMAC challenge-response, never sent on the wire), in both directions.
    pub secret: Option<String>,
    // The TCP engine (and the CUDA IPC engine's control server).
    /// Parallel connections (and sender threads) per peer.
    pub connections_per_peer: usize,
    /// Blocks shorter than this are copied into frame buffers (coalesced);
    /// longer ones are sent and received in place with vectored I/O.
    pub coalesce_threshold: usize,
    /// Target payload bytes of one request frame; batches are cut into
    /// requests of about this size and spread over the peer's connections.
    pub request_bytes: usize,
    /// Requests a connection may have in flight before waiting for an ack.
    pub pipeline_depth: usize,
    /// Most accepted connections open at once; connections beyond it are
    /// closed at once (counted in `connections_rejected`).
    pub max_connections: usize,
    /// An authenticated connection that sends no request for this long is
    /// closed (counted in `idle_closed`), in milliseconds. Connections that
    /// hold regions (CUDA IPC leases) are exempt.
    pub idle_timeout_ms: u64,
    /// Limit on receiving (or sending) one whole request — header,
    /// descriptors and payload — once its first byte moved, in
    /// milliseconds: a peer that trickles a request is dropped when it
    /// passes (counted in `request_timeouts`).
    pub request_timeout_ms: u64,
    /// Debug aid: treat every region like device memory (stage all bytes
    /// through host bounce buffers), to exercise the staging path.
    #[doc(hidden)]
    pub force_staging: bool,
    /// The CUDA IPC engine's section: how it copies.
    pub ipc: CopyTuning,
    /// The UCX engine's section.
    pub ucx: UcxConfig,
}

/// The UCX engine's section of [`EngineConfig`].
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UcxConfig {
    /// UCX settings applied over UCX's environment, names without the
    /// `UCX_` prefix: `{"TLS": "rc,sm"}` is `UCX_TLS=rc,sm` for this engine.
    pub settings: BTreeMap<String, String>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            listen_host: "127.0.0.1".into(),
            advertise_host: None,
            port: 0,
            connections_per_peer: 4,
            connect_timeout_ms: 3_000,
            io_timeout_ms: 30_000,
            secret: None,
            coalesce_threshold: 2048,
            request_bytes: 8 << 20,
            pipeline_depth: 2,
            max_connections: 1024,
            idle_timeout_ms: 600_000,
            request_timeout_ms: 60_000,
            force_staging: false,
            ipc: CopyTuning::default(),
            ucx: UcxConfig::default(),
        }
    }
}

/// Accessors that turn `*_ms` settings into durations (at least 1 ms).
macro_rules! durations {
    ($($name:ident: $field:ident),* $(,)?) => {
        impl EngineConfig {
            $(
                #[doc = concat!("`", stringify!($field), "` as a duration.")]
                pub fn $name(&self) -> Duration {
                    Duration::from_millis(self.$field.max(1))
                }
            )*
        }
    };
}

durations!(
    connect_timeout: connect_timeout_ms,
    io_timeout: io_timeout_ms,
    idle_timeout: idle_timeout_ms,
    request_timeout: request_timeout_ms,
);

/// `Debug` of every field in order, with the secret (between the two
/// lists) redacted.
macro_rules! debug_redacting_secret {
    ($($before:ident),*; $($after:ident),*) => {
        impl fmt::Debug for EngineConfig {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let mut d = f.debug_struct("EngineConfig");
                $(d.field(stringify!($before), &self.$before);)*
                d.field("secret", &self.secret.as_ref().map(|_| "<redacted>"));
                $(d.field(stringify!($after), &self.$after);)*
                d.finish()
            }
        }
    };
}

debug_redacting_secret!(
    listen_host, advertise_host, port, connections_per_peer, connect_timeout_ms, io_timeout_ms;
    coalesce_threshold, request_bytes, pipeline_depth, max_connections, idle_timeout_ms,
    request_timeout_ms, force_staging, ipc, ucx
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_defaults_and_redacted_debug() {
        let c: EngineConfig =
            serde_json::from_str(r#"{"port": 15001, "secret": "s3cret"}"#).unwrap_or_default();
        assert_eq!(c.port, 15001);
        assert_eq!(
            c.connections_per_peer,
            EngineConfig::default().connections_per_peer
        );
        assert_eq!(c.max_connections, 1024);
        assert_eq!(c.idle_timeout(), Duration::from_secs(600));
        assert_eq!(c.request_timeout(), Duration::from_secs(60));
        assert!(!format!("{c:?}").contains("s3cret"));
        assert!(serde_json::from_str::<EngineConfig>(r#"{"prot": 1}"#).is_err());
        let back: EngineConfig =
            serde_json::from_str(&serde_json::to_string(&c).unwrap_or_default())
                .unwrap_or_default();
        assert_eq!(back, c);
    }

    #[test]
    fn transport_sections_parse_next_to_the_flat_settings() {
        let c: EngineConfig = serde_json::from_str(
            r#"{"port": 1, "connections_per_peer": 2,
                "ipc": {"mode": "kernel", "kernel_streams": 1},
                "ucx": {"settings": {"TLS": "tcp"}}}"#,
        )
        .unwrap_or_default();
        assert_eq!((c.port, c.connections_per_peer), (1, 2));
        assert_eq!(c.ipc.mode, crate::ipc::CopyMode::Kernel);
        assert_eq!(c.ipc.kernel_streams, 1);
        assert_eq!(c.ipc.piece, CopyTuning::default().piece);
        assert_eq!(c.ucx.settings.get("TLS").map(String::as_str), Some("tcp"));
        assert!(serde_json::from_str::<EngineConfig>(r#"{"ucx": {"tls": 1}}"#).is_err());
    }
}
