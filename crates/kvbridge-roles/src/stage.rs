//! Named points in a room's life, emitted as `trace` events under
//! [`TARGET`], so that a tool (`kvbridge bench roles --stages`, or a
//! `KVBRIDGE_LOG=kvbridge::room_stage=trace` log) can tell where a room's
//! latency goes.
//!
//! **Owns:** the stage names and their order.
//! **Never:** records or times anything itself: an event is all it costs,
//! and nothing when no subscriber asks for the target.

/// The `tracing` target of every stage event (fields `room` and `stage`).
pub const TARGET: &str = "kvbridge::room_stage";

/// A point in a room's life, in the order a room passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// The decode sent the room's destinations to its prefill ranks.
    DestSent,
    /// The prefill took in a decode rank's destinations for the room.
    DestKnown,
    /// The prefill's caller handed the room's pages to `send`.
    Queued,
    /// A prefill worker took the room's chunk off its queue.
    Taken,
    /// The worker handed the chunk's first batch to the engine.
    Submitted,
    /// Every batch of the room finished: every byte is written.
    Written,
    /// The prefill sent the room's status to its decode ranks.
    Concluded,
    /// A decode rank took in the prefill's status.
    StatusIn,
    /// A decode's `poll` first returned the room's terminal state.
    Seen,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 9] = [
        Stage::DestSent,
        Stage::DestKnown,
        Stage::Queued,
        Stage::Taken,
        Stage::Submitted,
        Stage::Written,
        Stage::Concluded,
        Stage::StatusIn,
        Stage::Seen,
    ];

    /// The name the event carries in its `stage` field.
    pub fn name(self) -> &'static str {
        match self {
            Stage::DestSent => "dest_sent",
            Stage::DestKnown => "dest_known",
            Stage::Queued => "queued",
            Stage::Taken => "taken",
            Stage::Submitted => "submitted",
            Stage::Written => "written",
            Stage::Concluded => "concluded",
            Stage::StatusIn => "status_in",
            Stage::Seen => "seen",
        }
    }

    /// The stage named `name` (as [`Stage::name`] writes it).
    pub fn from_name(name: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// Emits the event of `room` reaching `stage`.
pub(crate) fn mark(room: u64, stage: Stage) {
    tracing::trace!(target: TARGET, room, stage = stage.name());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reads_back_as_its_stage() {
        for s in Stage::ALL {
            assert_eq!(Stage::from_name(s.name()), Some(s));
        }
        assert_eq!(Stage::from_name("sent"), None);
        assert!(Stage::ALL.windows(2).all(|w| w[0] < w[1]));
    }
}
