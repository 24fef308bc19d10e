//! The engines' configuration, one serde-friendly struct (a file's
//! `engine` section, or flags) in three parts:
//!
//! * what every transport shares: where it listens and what it announces
//!   (`listen_host`, `advertise_host`, `port`), the connect and I/O
//!   timeouts and the cluster secret (the session layer's handshake);
//! * [`TcpConfig`], the `tcp` section: the TCP engine's settings (also
//!   those of the CUDA IPC engine's control server): connections, framing,
//!   limits against hostile peers;
//! * the other per-transport sections: `ipc` (copy tuning) and `ucx`
//!   (UCX settings).
//!
//! Files written before the `tcp` section existed keep parsing: its fields
//! are also accepted flat, at the top of the `engine` section (naming one
//! both ways is refused).
//!
//! **Never:** holds anything but plain settings (no sockets, no secrets
//! other than the configured one, which `Debug` redacts).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::ipc::CopyTuning;

/// Configuration of every engine ([`crate::TcpEngine`], the CUDA IPC and
/// UCX engines); serde-friendly (file or flags), every field optional with
/// the defaults below.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "file::EngineConfigFile", into = "file::EngineConfigFile")]
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
    /// The TCP engine's section (also the CUDA IPC engine's control server).
    pub tcp: TcpConfig,
    /// The CUDA IPC engine's section: how it copies.
    pub ipc: CopyTuning,
    /// The UCX engine's section.
    pub ucx: UcxConfig,
}

/// The TCP engine's section of [`EngineConfig`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TcpConfig {
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
    /// Most accepted connections still in their handshake (not yet
    /// authenticated); a new one beyond it closes the oldest of them
    /// (counted in `handshakes_evicted`), so strangers that never finish a
    /// handshake hold a bounded share of connections and descriptors while
    /// a member's handshake, done in milliseconds, still gets through.
    pub max_pending_handshakes: usize,
    /// An authenticated connection that sends no request for this long is
    /// closed (counted in `idle_closed`), in milliseconds. Connections that
    /// hold regions (CUDA IPC leases) are exempt.
    pub idle_timeout_ms: u64,
    /// Limit on receiving (or sending) one whole request — header,
    /// descriptors and payload — once its first byte moved, in
    /// milliseconds: a peer that trickles a request is dropped when it
    /// passes (counted in `request_timeouts`).
    pub request_timeout_ms: u64,
    /// Carry strided runs (heterogeneous-TP head slices) as run
    /// descriptors, a copy count and strides each, instead of one
    /// descriptor per copy; the receiver scatters them. Off: runs are
    /// expanded into blocks before sending.
    pub native_runs: bool,
    /// Debug aid: treat every region like device memory (stage all bytes
    /// through host bounce buffers), to exercise the staging path.
    #[doc(hidden)]
    pub force_staging: bool,
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
            connect_timeout_ms: 3_000,
            io_timeout_ms: 30_000,
            secret: None,
            tcp: TcpConfig::default(),
            ipc: CopyTuning::default(),
            ucx: UcxConfig::default(),
        }
    }
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            connections_per_peer: 4,
            // A 1 KiB head slice (Llama TP 1 -> 2) goes out in place: a
            // copy into the frame costs more than its iovec (bench roles
            // --layout hetero: 3.06 against 2.70 GB/s with 2048).
            coalesce_threshold: 512,
            request_bytes: 8 << 20,
            pipeline_depth: 2,
            max_connections: 1024,
            max_pending_handshakes: 64,
            idle_timeout_ms: 600_000,
            request_timeout_ms: 60_000,
            native_runs: true,
            force_staging: false,
        }
    }
}

/// A `*_ms` setting as a duration (at least 1 ms).
fn ms(v: u64) -> Duration {
    Duration::from_millis(v.max(1))
}

impl EngineConfig {
    /// `connect_timeout_ms` as a duration.
    pub fn connect_timeout(&self) -> Duration {
        ms(self.connect_timeout_ms)
    }

    /// `io_timeout_ms` as a duration.
    pub fn io_timeout(&self) -> Duration {
        ms(self.io_timeout_ms)
    }

    /// `tcp.idle_timeout_ms` as a duration.
    pub fn idle_timeout(&self) -> Duration {
        ms(self.tcp.idle_timeout_ms)
    }

    /// `tcp.request_timeout_ms` as a duration.
    pub fn request_timeout(&self) -> Duration {
        ms(self.tcp.request_timeout_ms)
    }
}

impl fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineConfig")
            .field("listen_host", &self.listen_host)
            .field("advertise_host", &self.advertise_host)
            .field("port", &self.port)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("io_timeout_ms", &self.io_timeout_ms)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("tcp", &self.tcp)
            .field("ipc", &self.ipc)
            .field("ucx", &self.ucx)
            .finish()
    }
}

/// The serde form: the sections, plus the TCP settings accepted flat as
/// files had them before the `tcp` section.
mod file {
    use super::{CopyTuning, EngineConfig, TcpConfig, UcxConfig};

    /// Declares the file form with the flat TCP fields and the merge of
    /// those into the `tcp` section.
    macro_rules! flat_tcp {
        ($($field:ident: $ty:ty),* $(,)?) => {
            /// `EngineConfig` as files write it.
            #[derive(Clone, Default, serde::Serialize, serde::Deserialize)]
            #[serde(default, deny_unknown_fields)]
            pub(super) struct EngineConfigFile {
                listen_host: Option<String>,
                #[serde(skip_serializing_if = "Option::is_none")]
                advertise_host: Option<String>,
                port: Option<u16>,
                connect_timeout_ms: Option<u64>,
                io_timeout_ms: Option<u64>,
                #[serde(skip_serializing_if = "Option::is_none")]
                secret: Option<String>,
                tcp: Option<TcpConfig>,
                ipc: Option<CopyTuning>,
                ucx: Option<UcxConfig>,
                $(
                    #[serde(skip_serializing)]
                    $field: Option<$ty>,
                )*
            }

            impl TryFrom<EngineConfigFile> for EngineConfig {
                type Error = String;

                fn try_from(f: EngineConfigFile) -> Result<Self, String> {
                    let d = EngineConfig::default();
                    let sectioned = f.tcp.is_some();
                    let mut tcp = f.tcp.unwrap_or_default();
                    $(
                        if let Some(v) = f.$field {
                            if sectioned {
                                return Err(format!(
                                    "`{}` given both flat and in the `tcp` section; \
                                     use the `tcp` section",
                                    stringify!($field),
                                ));
                            }
                            tcp.$field = v;
                        }
                    )*
                    Ok(EngineConfig {
                        listen_host: f.listen_host.unwrap_or(d.listen_host),
                        advertise_host: f.advertise_host,
                        port: f.port.unwrap_or(d.port),
                        connect_timeout_ms: f.connect_timeout_ms.unwrap_or(d.connect_timeout_ms),
                        io_timeout_ms: f.io_timeout_ms.unwrap_or(d.io_timeout_ms),
                        secret: f.secret,
                        tcp,
                        ipc: f.ipc.unwrap_or(d.ipc),
                        ucx: f.ucx.unwrap_or(d.ucx),
                    })
                }
            }
        };
    }

    flat_tcp!(
        connections_per_peer: usize,
        coalesce_threshold: usize,
        request_bytes: usize,
        pipeline_depth: usize,
        max_connections: usize,
        max_pending_handshakes: usize,
        idle_timeout_ms: u64,
        request_timeout_ms: u64,
        native_runs: bool,
        force_staging: bool,
    );

    impl From<EngineConfig> for EngineConfigFile {
        fn from(c: EngineConfig) -> Self {
            EngineConfigFile {
                listen_host: Some(c.listen_host),
                advertise_host: c.advertise_host,
                port: Some(c.port),
                connect_timeout_ms: Some(c.connect_timeout_ms),
                io_timeout_ms: Some(c.io_timeout_ms),
                secret: c.secret,
                tcp: Some(c.tcp),
                ipc: Some(c.ipc),
                ucx: Some(c.ucx),
                ..EngineConfigFile::default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_defaults_and_redacted_debug() {
        let c: EngineConfig =
            serde_json::from_str(r#"{"port": 15001, "secret": "s3cret"}"#).unwrap_or_default();
        assert_eq!(c.port, 15001);
        assert_eq!(c.tcp, TcpConfig::default());
        assert_eq!(c.tcp.max_connections, 1024);
        assert_eq!(c.idle_timeout(), Duration::from_secs(600));
        assert_eq!(c.request_timeout(), Duration::from_secs(60));
        assert!(!format!("{c:?}").contains("s3cret"));
        assert!(serde_json::from_str::<EngineConfig>(r#"{"prot": 1}"#).is_err());
        let text = serde_json::to_string(&c).unwrap_or_default();
        assert!(text.contains(r#""tcp":{"#), "{text}");
        let back: EngineConfig = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(back, c);
    }

    #[test]
    fn flat_tcp_settings_still_parse_but_not_twice() {
        let flat: EngineConfig =
            serde_json::from_str(r#"{"port": 1, "connections_per_peer": 2, "pipeline_depth": 3}"#)
                .unwrap_or_default();
        let sectioned: EngineConfig = serde_json::from_str(
            r#"{"port": 1, "tcp": {"connections_per_peer": 2, "pipeline_depth": 3}}"#,
        )
        .unwrap_or_default();
        assert_eq!(flat, sectioned);
        assert_eq!(
            (flat.tcp.connections_per_peer, flat.tcp.pipeline_depth),
            (2, 3)
        );
        let both = serde_json::from_str::<EngineConfig>(
            r#"{"connections_per_peer": 2, "tcp": {"pipeline_depth": 3}}"#,
        );
        let err = both.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("connections_per_peer"), "{err}");
        assert!(serde_json::from_str::<EngineConfig>(r#"{"tcp": {"conections": 1}}"#).is_err());
    }

    #[test]
    fn transport_sections_parse() {
        let c: EngineConfig = serde_json::from_str(
            r#"{"port": 1, "tcp": {"connections_per_peer": 2},
                "ipc": {"mode": "kernel", "kernel_streams": 1},
                "ucx": {"settings": {"TLS": "tcp"}}}"#,
        )
        .unwrap_or_default();
        assert_eq!((c.port, c.tcp.connections_per_peer), (1, 2));
        assert_eq!(c.ipc.mode, crate::ipc::CopyMode::Kernel);
        assert_eq!(c.ipc.kernel_streams, 1);
        assert_eq!(c.ipc.piece, CopyTuning::default().piece);
        assert_eq!(c.ucx.settings.get("TLS").map(String::as_str), Some("tcp"));
        assert!(serde_json::from_str::<EngineConfig>(r#"{"ucx": {"tls": 1}}"#).is_err());
    }
}
