//! What Mooncake's `initialize(local_hostname, metadata_server, protocol,
//! device_name)` means in kvbridge terms: which transport, where to listen
//! and which [`EngineConfig`]. Pure functions of the arguments, the
//! environment (passed in as a lookup) and the cluster secret, so they are
//! tested without Python or sockets.
//!
//! **Never:** reads the process environment itself, starts an engine, or
//! guesses a transport for a protocol it does not know.

use std::path::Path;

use kvbridge_engine::EngineConfig;
use kvbridge_engine::factory::{FactoryError, Transport};
use kvbridge_engine::secret::{ClusterSecret, SecretError};

/// The only metadata server kvbridge supports: peers find each other by
/// session id (`host:port`), as Mooncake's peer-to-peer handshake mode.
pub const P2P_HANDSHAKE: &str = "P2PHANDSHAKE";
/// Environment variable with the port to listen on (default: a free port).
pub const PORT_ENV: &str = "KVBRIDGE_ENGINE_PORT";
/// Environment variable with the path of a JSON engine configuration
/// (the `engine` section of `kvbridge prefill`'s file: timeouts, `tcp`, `ucx`, ...).
pub const CONFIG_ENV: &str = "KVBRIDGE_ENGINE_CONFIG";
/// Mooncake's switch forcing its TCP transport whatever the protocol.
pub const FORCE_TCP_ENV: &str = "MC_FORCE_TCP";
/// UCX's variable naming the network devices; kvbridge leaves it alone when set.
pub const UCX_NET_DEVICES_ENV: &str = "UCX_NET_DEVICES";

/// Why `initialize` could not start an engine (it then returns -1).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// A metadata server other than [`P2P_HANDSHAKE`] (etcd, redis, http).
    #[error(
        "metadata server {0:?} is not supported: kvbridge engines reach each other by \
         session id (pass \"P2PHANDSHAKE\")"
    )]
    MetadataServer(String),
    /// A protocol with no kvbridge transport.
    #[error("unknown protocol {0:?} (tcp, rdma, nvlink or nvlink_intra)")]
    Protocol(String),
    /// The hostname is empty or its port part is not a port.
    #[error("hostname {0:?} is not host, host:port, [ipv6] or [ipv6]:port")]
    Hostname(String),
    /// [`PORT_ENV`] is not a port number.
    #[error("{PORT_ENV}={0:?} is not a port number")]
    Port(String),
    /// [`CONFIG_ENV`] names a file that cannot be read or parsed.
    #[error("engine configuration {path} ({CONFIG_ENV}): {reason}")]
    Config {
        /// The file.
        path: String,
        /// Why it was refused.
        reason: String,
    },
    /// The cluster secret from the environment cannot be loaded.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The engine failed to start (port taken, no GPU, no libucp, ...).
    #[error(transparent)]
    Start(#[from] FactoryError),
}

/// The engine `initialize` starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnginePlan {
    /// The transport.
    pub transport: Transport,
    /// Its configuration (listen address, port, secret, sections).
    pub config: EngineConfig,
}

/// The transport for Mooncake's `protocol` (case-insensitive); a true
/// `MC_FORCE_TCP` picks TCP whatever the protocol, as in Mooncake.
pub fn transport_for(protocol: &str, force_tcp: bool) -> Result<Transport, InitError> {
    if force_tcp {
        return Ok(Transport::Tcp);
    }
    match protocol.to_ascii_lowercase().as_str() {
        "tcp" => Ok(Transport::Tcp),
        "rdma" | "ucx" => Ok(Transport::Ucx),
        "nvlink" | "nvlink_intra" | "ipc" => Ok(Transport::Ipc),
        _ => Err(InitError::Protocol(protocol.to_owned())),
    }
}

/// Whether an environment flag's value means "on" (`1`, `true`, `yes`, `on`).
pub fn flag_on(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// Splits Mooncake's `local_hostname` into the host to listen on (IPv6
/// without brackets) and the port it names, if any: `host`, `host:port`,
/// `[v6]`, `[v6]:port`; a bare IPv6 address (two colons or more) is a host.
pub fn split_hostname(hostname: &str) -> Result<(String, Option<u16>), InitError> {
    let bad = || InitError::Hostname(hostname.to_owned());
    let h = hostname.trim();
    let (host, port) = if let Some(rest) = h.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(bad)?;
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':').ok_or_else(bad)?)),
        }
    } else {
        match h.split_once(':') {
            Some((host, port)) if !port.contains(':') => (host, Some(port)),
            _ => (h, None),
        }
    };
    if host.is_empty() {
        return Err(bad());
    }
    let port = port
        .map(|p| p.parse::<u16>().map_err(|_| bad()))
        .transpose()?;
    Ok((host.to_owned(), port))
}

/// UCX's `NET_DEVICES` for Mooncake's `device_name` (comma-separated HCA
/// names, `mlx5_0,mlx5_1`): each on port 1 unless it names one
/// (`mlx5_0:2`). `None` for an empty name or one that is not such a list.
pub fn ucx_net_devices(device_name: &str) -> Option<String> {
    let names: Vec<&str> = device_name
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    let plain = |n: &str| {
        n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
            && !n.starts_with(':')
            && n.matches(':').count() <= 1
    };
    if names.is_empty() || !names.iter().all(|n| plain(n)) {
        return None;
    }
    let with_port: Vec<String> = names
        .iter()
        .map(|n| {
            if n.contains(':') {
                (*n).to_owned()
            } else {
                format!("{n}:1")
            }
        })
        .collect();
    Some(with_port.join(","))
}

/// The engine for `initialize(hostname, metadata_server, protocol,
/// device_name)`, with `env` looking up environment variables and `secret`
/// the cluster secret (from [`ClusterSecret::from_env`]).
pub fn plan_engine(
    hostname: &str,
    metadata_server: &str,
    protocol: &str,
    device_name: &str,
    env: &dyn Fn(&str) -> Option<String>,
    secret: Option<&ClusterSecret>,
) -> Result<EnginePlan, InitError> {
    if metadata_server != P2P_HANDSHAKE {
        return Err(InitError::MetadataServer(metadata_server.to_owned()));
    }
    let transport = transport_for(protocol, flag_on(env(FORCE_TCP_ENV).as_deref()))?;
    let (host, host_port) = split_hostname(hostname)?;
    let mut config = match env(CONFIG_ENV).filter(|p| !p.is_empty()) {
        Some(path) => read_config(Path::new(&path))?,
        None => EngineConfig::default(),
    };
    config.listen_host = host;
    config.port = match (host_port, env(PORT_ENV).filter(|p| !p.is_empty())) {
        (Some(p), _) => p,
        (None, Some(p)) => p.trim().parse().map_err(|_| InitError::Port(p))?,
        (None, None) => 0,
    };
    config.secret = secret.map(ClusterSecret::to_env_value);
    if transport == Transport::Ucx
        && env(UCX_NET_DEVICES_ENV).is_none()
        && !config.ucx.settings.contains_key("NET_DEVICES")
        && let Some(devices) = ucx_net_devices(device_name)
    {
        config.ucx.settings.insert("NET_DEVICES".into(), devices);
    }
    Ok(EnginePlan { transport, config })
}

/// The engine configuration in `path`; a `secret` in it is refused (the
/// secret comes from `KVBRIDGE_SECRET_FILE` / `KVBRIDGE_SECRET` only).
fn read_config(path: &Path) -> Result<EngineConfig, InitError> {
    let refuse = |reason: String| InitError::Config {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| refuse(e.to_string()))?;
    let config: EngineConfig = serde_json::from_str(&text).map_err(|e| refuse(e.to_string()))?;
    if config.secret.is_some() {
        return Err(refuse(
            "sets `secret`; pass the cluster secret with KVBRIDGE_SECRET_FILE or KVBRIDGE_SECRET"
                .into(),
        ));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn protocols_map_to_transports_and_force_tcp_wins() {
        assert_eq!(transport_for("tcp", false).unwrap(), Transport::Tcp);
        assert_eq!(transport_for("rdma", false).unwrap(), Transport::Ucx);
        assert_eq!(transport_for("RDMA", false).unwrap(), Transport::Ucx);
        assert_eq!(transport_for("nvlink", false).unwrap(), Transport::Ipc);
        assert_eq!(
            transport_for("nvlink_intra", false).unwrap(),
            Transport::Ipc
        );
        assert_eq!(transport_for("rdma", true).unwrap(), Transport::Tcp);
        assert_eq!(transport_for("nvlink", true).unwrap(), Transport::Tcp);
        assert!(matches!(
            transport_for("efa", false),
            Err(InitError::Protocol(p)) if p == "efa"
        ));
        assert!(flag_on(Some("1")) && flag_on(Some("TRUE")) && flag_on(Some(" on")));
        assert!(!flag_on(Some("0")) && !flag_on(Some("")) && !flag_on(None));
    }

    #[test]
    fn hostnames_split_into_host_and_port() {
        let split = |h| split_hostname(h).ok();
        assert_eq!(split("10.0.0.1"), Some(("10.0.0.1".into(), None)));
        assert_eq!(
            split("10.0.0.1:17000"),
            Some(("10.0.0.1".into(), Some(17000)))
        );
        assert_eq!(split("node-3"), Some(("node-3".into(), None)));
        assert_eq!(split("::1"), Some(("::1".into(), None)));
        assert_eq!(split("fe80::1:2"), Some(("fe80::1:2".into(), None)));
        assert_eq!(split("[::1]"), Some(("::1".into(), None)));
        assert_eq!(split("[::1]:80"), Some(("::1".into(), Some(80))));
        for bad in [
            "", ":80", "[]:80", "[::1", "[::1]80", "h:port", "h:70000", "[::1]:",
        ] {
            assert!(split(bad).is_none(), "{bad:?} accepted");
        }
    }

    #[test]
    fn ucx_devices_get_port_one() {
        assert_eq!(ucx_net_devices("mlx5_0").as_deref(), Some("mlx5_0:1"));
        assert_eq!(
            ucx_net_devices("mlx5_0, mlx5_1:2").as_deref(),
            Some("mlx5_0:1,mlx5_1:2")
        );
        assert_eq!(ucx_net_devices(""), None);
        assert_eq!(ucx_net_devices("{\"cpu:0\": [\"mlx5_0\"]}"), None);
    }

    #[test]
    fn initialize_arguments_become_an_engine_config() {
        let p = plan_engine("127.0.0.1", P2P_HANDSHAKE, "tcp", "", &no_env, None).unwrap();
        assert_eq!(p.transport, Transport::Tcp);
        assert_eq!(
            (p.config.listen_host.as_str(), p.config.port),
            ("127.0.0.1", 0)
        );
        assert_eq!(p.config.secret, None);

        let env = |k: &str| match k {
            PORT_ENV => Some("17001".to_owned()),
            FORCE_TCP_ENV => Some("0".to_owned()),
            _ => None,
        };
        let secret = ClusterSecret::from_text("0123456789abcdef0123", "test").unwrap();
        let p = plan_engine(
            "[::1]",
            P2P_HANDSHAKE,
            "rdma",
            "mlx5_0",
            &env,
            Some(&secret),
        )
        .unwrap();
        assert_eq!(p.transport, Transport::Ucx);
        assert_eq!(
            (p.config.listen_host.as_str(), p.config.port),
            ("::1", 17001)
        );
        assert_eq!(p.config.secret.as_deref(), Some("0123456789abcdef0123"));
        assert_eq!(
            p.config.ucx.settings.get("NET_DEVICES").map(String::as_str),
            Some("mlx5_0:1")
        );

        // A port in the hostname wins over the environment's.
        let p = plan_engine("h:9", P2P_HANDSHAKE, "tcp", "", &env, None).unwrap();
        assert_eq!(p.config.port, 9);
        // UCX's own variable wins over device_name.
        let ucx_env = |k: &str| (k == UCX_NET_DEVICES_ENV).then(|| "mlx5_3:1".to_owned());
        let p = plan_engine("h", P2P_HANDSHAKE, "rdma", "mlx5_0", &ucx_env, None).unwrap();
        assert!(p.config.ucx.settings.is_empty());
    }

    #[test]
    fn bad_initialize_arguments_are_typed() {
        assert!(matches!(
            plan_engine("h", "etcd://x:2379", "tcp", "", &no_env, None),
            Err(InitError::MetadataServer(_))
        ));
        let bad_port = |k: &str| (k == PORT_ENV).then(|| "http".to_owned());
        let err = plan_engine("h", P2P_HANDSHAKE, "tcp", "", &bad_port, None).unwrap_err();
        assert!(
            err.to_string().contains("KVBRIDGE_ENGINE_PORT=\"http\""),
            "{err}"
        );
        let missing = |k: &str| (k == CONFIG_ENV).then(|| "/nonexistent/engine.json".to_owned());
        assert!(matches!(
            plan_engine("h", P2P_HANDSHAKE, "tcp", "", &missing, None),
            Err(InitError::Config { .. })
        ));
    }

    #[test]
    fn config_file_applies_but_may_not_hold_the_secret() {
        let dir = std::env::temp_dir().join(format!("kvbridge-py-opts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("engine.json");
        std::fs::write(
            &good,
            r#"{"io_timeout_ms": 1234, "tcp": {"connections_per_peer": 2}}"#,
        )
        .unwrap();
        let with_secret = dir.join("secret.json");
        std::fs::write(&with_secret, r#"{"secret": "0123456789abcdef0123"}"#).unwrap();
        let env_for = |path: &Path| {
            let path = path.display().to_string();
            move |k: &str| (k == CONFIG_ENV).then(|| path.clone())
        };
        let p = plan_engine("h", P2P_HANDSHAKE, "tcp", "", &env_for(&good), None).unwrap();
        assert_eq!(p.config.io_timeout_ms, 1234);
        assert_eq!(p.config.tcp.connections_per_peer, 2);
        assert_eq!(p.config.listen_host, "h");
        let err =
            plan_engine("h", P2P_HANDSHAKE, "tcp", "", &env_for(&with_secret), None).unwrap_err();
        assert!(err.to_string().contains("sets `secret`"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
