//! sglang's `KVPoll`: the state of one room.

use std::fmt;

use crate::error::DecodeError;

/// The state of one room (request transfer), with sglang's numbering.
///
/// A room moves `Bootstrapping → WaitingForInput → Transferring → Success`,
/// or to `Failed` from any state; `Success` and `Failed` are terminal. The
/// numeric order is the one sglang compares with `max()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum KvPoll {
    /// The transfer failed or was aborted (terminal).
    Failed = 0,
    /// Waiting for the peer to connect and register.
    Bootstrapping = 1,
    /// Both sides know each other; waiting for KV to send.
    WaitingForInput = 2,
    /// Chunks are being written.
    Transferring = 3,
    /// Every byte was written and acknowledged (terminal).
    Success = 4,
}

impl KvPoll {
    /// Every state, in numeric order.
    pub const ALL: [KvPoll; 5] = [
        KvPoll::Failed,
        KvPoll::Bootstrapping,
        KvPoll::WaitingForInput,
        KvPoll::Transferring,
        KvPoll::Success,
    ];

    /// Whether the state is final (`Success` or `Failed`).
    pub fn is_terminal(self) -> bool {
        matches!(self, KvPoll::Success | KvPoll::Failed)
    }

    /// The state with sglang's number `value`.
    pub fn from_u64(value: u64) -> Result<Self, DecodeError> {
        match value {
            0 => Ok(KvPoll::Failed),
            1 => Ok(KvPoll::Bootstrapping),
            2 => Ok(KvPoll::WaitingForInput),
            3 => Ok(KvPoll::Transferring),
            4 => Ok(KvPoll::Success),
            other => Err(DecodeError::UnknownStatus(other)),
        }
    }

    /// sglang's number for this state.
    pub fn as_u8(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for KvPoll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
