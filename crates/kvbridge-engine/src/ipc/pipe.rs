//! What an IPC engine shares with its sessions ([`Shared`]) and what a
//! session's submitters share with its completion thread ([`Pipe`],
//! [`InFlight`]), with the limits both sides keep.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::time::Duration;

use parking_lot::Mutex;

use super::copier::Slot;
use super::idle::IdleSlots;
use super::schedule::CopyTuning;
use crate::batch::Completer;
use crate::tcp::EngineHost;

/// An idle session releases its holds after this long.
pub(super) const IDLE_RELEASE: Duration = Duration::from_millis(500);
/// Passes over one batch (re-fetched table, new mappings, revokes) before giving up.
pub(super) const MAX_ATTEMPTS: usize = 6;

/// Counters of an IPC engine.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) mappings_opened: AtomicU64,
    pub(super) mappings_closed: AtomicU64,
    pub(super) bytes_sent: AtomicU64,
}

/// What the engine shares with its sessions.
#[derive(Debug)]
pub(super) struct Shared {
    /// The port peers reach us on: handshake, registry and the control
    /// protocol, without the TCP data plane.
    pub(super) host: EngineHost,
    pub(super) tuning: CopyTuning,
    pub(super) counters: Counters,
}

/// A launched batch for the completion thread.
pub(super) struct InFlight {
    pub(super) slot: Slot,
    pub(super) bytes: u64,
    pub(super) done: Completer,
}

/// What a session's submitters and its completion thread share.
#[derive(Debug, Default)]
pub(super) struct Pipe {
    /// Idle descriptor slots.
    pub(super) free: Mutex<IdleSlots<Slot>>,
    /// Batches launched and not completed.
    pub(super) in_flight: AtomicUsize,
    /// Descriptor slots allocated so far.
    pub(super) slots_made: AtomicU64,
    /// Whether the session holds regions of the peer (the completion thread
    /// then watches for revokes while idle).
    pub(super) holding: AtomicBool,
}
