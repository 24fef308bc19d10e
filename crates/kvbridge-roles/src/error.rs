//! Errors of the role managers.

use thiserror::Error;

/// A configuration or layout that cannot work; reported at start-up or
/// registration, never discovered at transfer time.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The registered buffers do not describe a consistent layout.
    #[error("inconsistent KV layout: {0}")]
    Layout(String),
    /// A setting is out of range.
    #[error("invalid setting: {0}")]
    Setting(String),
}

/// Why a role manager could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StartError {
    /// Bad configuration or layout.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The transfer engine refused our memory.
    #[error("registering memory with the transfer engine: {0}")]
    Register(#[from] kvbridge_engine::MemError),
    /// The control plane could not be set up.
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    /// The bootstrap server did not accept the registration.
    #[error("registering with the bootstrap server {addr}: {reason}")]
    Bootstrap {
        /// The bootstrap server.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// A thread could not be spawned.
    #[error("spawning a thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// A room's failure as the scheduler sees it (sglang `KVTransferError`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("KVTransferError(bootstrap_room={room}): {reason}")]
pub struct KvTransferError {
    /// The failed room.
    pub room: u64,
    /// The recorded reason (or a generic one when another rank failed it).
    pub reason: String,
    /// Whether no reason was recorded locally: the failure came from another rank.
    pub is_from_another_rank: bool,
}

impl KvTransferError {
    /// The room's failure from its recorded reason, or a generic one marked
    /// as coming from another rank when none was recorded here.
    pub(crate) fn from_recorded(room: u64, reason: Option<String>) -> Self {
        Self {
            room,
            is_from_another_rank: reason.is_none(),
            reason: reason
                .unwrap_or_else(|| "Failed due to an unknown reason from another rank".into()),
        }
    }
}

/// Why `KvSender::send` refused a chunk.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SendError {
    /// `init` was not called first.
    #[error("room {0}: send before init")]
    NotInitialized(u64),
    /// More pages than `init` announced.
    #[error("room {room}: {sent} pages sent but only {total} announced")]
    TooManyPages {
        /// The room.
        room: u64,
        /// Pages sent so far, including this chunk.
        sent: u64,
        /// Pages announced by `init`.
        total: u64,
    },
    /// The last chunk has no aux index (set one in `init`).
    #[error("room {0}: the last chunk needs an aux index")]
    MissingAuxIndex(u64),
    /// The manager was torn down.
    #[error("room {0}: the prefill manager is stopped")]
    Stopped(u64),
}
