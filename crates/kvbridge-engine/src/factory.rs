//! Building an engine by name from a configuration: the one place that
//! knows which transports exist, which cargo feature each needs and what
//! each needs on the machine (a GPU, libucp).
//!
//! **Never:** guesses a transport the caller did not name, or starts one
//! whose prerequisite is missing: it says which one instead.

use std::str::FromStr;
use std::sync::Arc;

use crate::{EngineConfig, LoopbackEngine, TcpEngine, TransferEngine};

/// A transport a [`TransferEngine`] can be built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// The TCP engine (any machine).
    Tcp,
    /// The CUDA IPC engine (intra-node, device memory; `cuda` feature).
    Ipc,
    /// The UCX engine (RDMA, shared memory or TCP; `ucx` feature).
    Ucx,
    /// The in-process loopback engine (tests; ignores the configuration).
    Loopback,
}

impl Transport {
    /// Every transport, in the order of their names in errors.
    pub const ALL: [Transport; 4] = [
        Transport::Tcp,
        Transport::Ipc,
        Transport::Ucx,
        Transport::Loopback,
    ];

    /// The transport's name (`"tcp"`, `"ipc"`, `"ucx"`, `"loopback"`).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Ipc => "ipc",
            Transport::Ucx => "ucx",
            Transport::Loopback => "loopback",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Transport {
    type Err = FactoryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Transport::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| FactoryError::Unknown(s.to_owned()))
    }
}

/// Why [`build`] could not start an engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FactoryError {
    /// No transport has this name.
    #[error("unknown engine {0:?} (tcp, ipc, ucx or loopback)")]
    Unknown(String),
    /// The transport was left out of this build.
    #[error("the {transport} engine needs the `{feature}` feature, which this build lacks")]
    NotBuilt {
        /// The transport asked for.
        transport: Transport,
        /// The cargo feature that builds it in.
        feature: &'static str,
    },
    /// The CUDA IPC engine needs a GPU and its driver; this machine has none.
    #[error("the ipc engine needs a GPU: no CUDA ({reason})")]
    NoCuda {
        /// Why the CUDA driver could not be loaded.
        reason: &'static str,
    },
    /// The UCX engine needs libucp; it could not be loaded.
    #[cfg(feature = "ucx")]
    #[error("the ucx engine needs libucp")]
    NoUcx(#[source] crate::UcxError),
    /// The UCX engine failed to start.
    #[cfg(feature = "ucx")]
    #[error("starting the ucx engine")]
    Ucx(#[source] crate::UcxError),
    /// The engine failed to start (port taken, bad address, ...).
    #[error("starting the {transport} engine")]
    Start {
        /// The transport being started.
        transport: Transport,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Start the engine of `transport` with `cfg` (the IPC engine takes its
/// copy tuning from `cfg.ipc`, the UCX engine its settings from `cfg.ucx`).
pub fn build(
    transport: Transport,
    cfg: &EngineConfig,
) -> Result<Arc<dyn TransferEngine>, FactoryError> {
    let start = |source| FactoryError::Start { transport, source };
    match transport {
        Transport::Tcp => Ok(Arc::new(TcpEngine::new(cfg.clone()).map_err(start)?)),
        Transport::Loopback => Ok(Arc::new(LoopbackEngine::new())),
        Transport::Ipc => ipc(cfg),
        Transport::Ucx => ucx(cfg),
    }
}

/// [`build`] by name (`"tcp"`, `"ipc"`, `"ucx"`, `"loopback"`).
pub fn build_named(
    name: &str,
    cfg: &EngineConfig,
) -> Result<Arc<dyn TransferEngine>, FactoryError> {
    build(name.parse()?, cfg)
}

#[cfg(feature = "cuda")]
fn ipc(cfg: &EngineConfig) -> Result<Arc<dyn TransferEngine>, FactoryError> {
    use kvbridge_mem::cuda;
    if !cuda::available() {
        return Err(FactoryError::NoCuda {
            reason: cuda::unavailable_reason().unwrap_or("unknown"),
        });
    }
    let engine =
        crate::IpcEngine::new(cfg.clone(), cfg.ipc).map_err(|source| FactoryError::Start {
            transport: Transport::Ipc,
            source,
        })?;
    Ok(Arc::new(engine))
}

#[cfg(not(feature = "cuda"))]
fn ipc(_: &EngineConfig) -> Result<Arc<dyn TransferEngine>, FactoryError> {
    Err(FactoryError::NotBuilt {
        transport: Transport::Ipc,
        feature: "cuda",
    })
}

#[cfg(feature = "ucx")]
fn ucx(cfg: &EngineConfig) -> Result<Arc<dyn TransferEngine>, FactoryError> {
    use crate::UcxError;
    match crate::UcxEngine::new(cfg.clone()) {
        Ok(e) => Ok(Arc::new(e)),
        Err(e @ UcxError::Unavailable(_)) => Err(FactoryError::NoUcx(e)),
        Err(e) => Err(FactoryError::Ucx(e)),
    }
}

#[cfg(not(feature = "ucx"))]
fn ucx(_: &EngineConfig) -> Result<Arc<dyn TransferEngine>, FactoryError> {
    Err(FactoryError::NotBuilt {
        transport: Transport::Ucx,
        feature: "ucx",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_typed() {
        for t in Transport::ALL {
            assert_eq!(t.name().parse::<Transport>().ok(), Some(t));
        }
        assert!(matches!(
            build_named("rdma", &EngineConfig::default()),
            Err(FactoryError::Unknown(n)) if n == "rdma"
        ));
        let e = build_named("tcp", &EngineConfig::default()).expect("tcp starts anywhere");
        assert!(e.session_id().starts_with("127.0.0.1:"));
        let bad = EngineConfig {
            listen_host: "0.0.0.0".into(),
            ..EngineConfig::default()
        };
        assert!(matches!(
            build(Transport::Tcp, &bad),
            Err(FactoryError::Start { .. })
        ));
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            build(Transport::Ipc, &EngineConfig::default()),
            Err(FactoryError::NotBuilt {
                feature: "cuda",
                ..
            })
        ));
    }
}
