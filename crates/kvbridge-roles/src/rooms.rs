//! Room states and failure reasons, with sglang's update rules, and an
//! optional journal of state changes for a watcher that mirrors them
//! elsewhere (a pipeline-parallel prefill stage reporting to stage 0).

use std::collections::HashMap;

use kvbridge_wire::KvPoll;

/// Every live room's [`KvPoll`] and the first recorded failure reason.
#[derive(Debug, Default)]
pub struct RoomTable {
    status: HashMap<u64, KvPoll>,
    failures: HashMap<u64, String>,
    /// Each changed room's latest state (`None`: removed) since the last
    /// [`RoomTable::take_changes`]; kept only once [`RoomTable::watch`] was
    /// called, so it is bounded by the rooms touched between two takes.
    journal: Option<HashMap<u64, Option<KvPoll>>>,
}

impl RoomTable {
    /// The room's state, if it exists.
    pub fn get(&self, room: u64) -> Option<KvPoll> {
        self.status.get(&room).copied()
    }

    /// Whether the room exists.
    pub fn contains(&self, room: u64) -> bool {
        self.status.contains_key(&room)
    }

    /// Applies a new state the way sglang's `update_status` does: only an
    /// opening state (`Bootstrapping`, `WaitingForInput`) creates a room;
    /// `Failed` always wins and is terminal; otherwise states only move
    /// forward. Returns the room's state afterwards.
    pub fn update(&mut self, room: u64, status: KvPoll) -> Option<KvPoll> {
        let before = self.status.get(&room).copied();
        let after = self.apply(before, room, status);
        if after != before
            && let Some(journal) = &mut self.journal
        {
            journal.insert(room, after);
        }
        after
    }

    fn apply(&mut self, before: Option<KvPoll>, room: u64, status: KvPoll) -> Option<KvPoll> {
        match before {
            None => {
                if matches!(status, KvPoll::Bootstrapping | KvPoll::WaitingForInput) {
                    self.status.insert(room, status);
                    self.failures.remove(&room);
                    Some(status)
                } else {
                    None
                }
            }
            Some(_) if status == KvPoll::Failed => {
                self.status.insert(room, KvPoll::Failed);
                Some(KvPoll::Failed)
            }
            Some(KvPoll::Failed) => Some(KvPoll::Failed),
            Some(current) => {
                let next = current.max(status);
                self.status.insert(room, next);
                Some(next)
            }
        }
    }

    /// Records why a room failed (replacing an earlier reason, as
    /// `record_failure` does).
    pub fn record_failure(&mut self, room: u64, reason: impl Into<String>) {
        self.failures.insert(room, reason.into());
    }

    /// Records why the room failed (replacing an earlier reason) and marks
    /// it `Failed`.
    pub(crate) fn fail(&mut self, room: u64, reason: impl Into<String>) {
        self.record_failure(room, reason);
        self.update(room, KvPoll::Failed);
    }

    /// Records a reason only if none is recorded yet; returns the kept one.
    pub fn first_failure(&mut self, room: u64, reason: impl Into<String>) -> String {
        self.failures
            .entry(room)
            .or_insert_with(|| reason.into())
            .clone()
    }

    /// The recorded reason, if any.
    pub fn failure(&self, room: u64) -> Option<&str> {
        self.failures.get(&room).map(String::as_str)
    }

    /// Removes and returns the recorded reason.
    pub fn take_failure(&mut self, room: u64) -> Option<String> {
        self.failures.remove(&room)
    }

    /// Forgets a room's state (its failure record stays until taken).
    pub fn remove(&mut self, room: u64) -> Option<KvPoll> {
        let removed = self.status.remove(&room);
        if removed.is_some()
            && let Some(journal) = &mut self.journal
        {
            journal.insert(room, None);
        }
        removed
    }

    /// Starts journaling state changes (idempotent).
    pub fn watch(&mut self) {
        self.journal.get_or_insert_with(HashMap::new);
    }

    /// The rooms whose state changed since the last call, each with its
    /// latest state (`None`: removed); empty when not watched.
    pub fn take_changes(&mut self) -> Vec<(u64, Option<KvPoll>)> {
        self.journal
            .as_mut()
            .map(|j| j.drain().collect())
            .unwrap_or_default()
    }

    /// Number of live rooms.
    pub fn len(&self) -> usize {
        self.status.len()
    }

    /// Whether no room is live.
    pub fn is_empty(&self) -> bool {
        self.status.is_empty()
    }

    /// Rooms currently in a non-terminal state.
    pub fn active_rooms(&self) -> impl Iterator<Item = u64> + '_ {
        self.status
            .iter()
            .filter(|(_, s)| !s.is_terminal())
            .map(|(r, _)| *r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_opening_states_create_rooms() {
        let mut t = RoomTable::default();
        assert_eq!(t.update(1, KvPoll::Success), None);
        assert_eq!(t.update(1, KvPoll::Failed), None);
        assert!(!t.contains(1));
        assert_eq!(
            t.update(1, KvPoll::Bootstrapping),
            Some(KvPoll::Bootstrapping)
        );
        assert_eq!(
            t.update(2, KvPoll::WaitingForInput),
            Some(KvPoll::WaitingForInput)
        );
    }

    #[test]
    fn states_move_forward_and_failed_is_terminal() {
        let mut t = RoomTable::default();
        t.update(1, KvPoll::Bootstrapping);
        assert_eq!(
            t.update(1, KvPoll::Transferring),
            Some(KvPoll::Transferring)
        );
        assert_eq!(
            t.update(1, KvPoll::WaitingForInput),
            Some(KvPoll::Transferring)
        );
        assert_eq!(t.update(1, KvPoll::Failed), Some(KvPoll::Failed));
        assert_eq!(t.update(1, KvPoll::Success), Some(KvPoll::Failed));
        assert_eq!(t.get(1), Some(KvPoll::Failed));
    }

    #[test]
    fn fail_records_the_reason_and_marks_failed() {
        let mut t = RoomTable::default();
        t.update(4, KvPoll::Transferring);
        t.update(4, KvPoll::Bootstrapping);
        t.fail(4, "why");
        assert_eq!(t.get(4), Some(KvPoll::Failed));
        assert_eq!(t.failure(4), Some("why"));
    }

    #[test]
    fn the_journal_keeps_each_changed_rooms_latest_state() {
        let mut t = RoomTable::default();
        t.update(1, KvPoll::Bootstrapping);
        assert!(t.take_changes().is_empty(), "not watched yet");
        t.watch();
        t.update(1, KvPoll::Transferring);
        t.update(1, KvPoll::WaitingForInput); // no change: states move forward
        t.update(2, KvPoll::Bootstrapping);
        t.update(2, KvPoll::Success);
        t.update(3, KvPoll::Success); // does not create a room
        let mut changes = t.take_changes();
        changes.sort();
        assert_eq!(
            changes,
            vec![(1, Some(KvPoll::Transferring)), (2, Some(KvPoll::Success))]
        );
        assert!(t.take_changes().is_empty());
        t.remove(2);
        t.remove(9); // never existed
        t.fail(1, "why");
        let mut changes = t.take_changes();
        changes.sort();
        assert_eq!(changes, vec![(1, Some(KvPoll::Failed)), (2, None)]);
    }

    #[test]
    fn first_failure_keeps_the_root_cause() {
        let mut t = RoomTable::default();
        assert_eq!(t.first_failure(3, "root"), "root");
        assert_eq!(t.first_failure(3, "symptom"), "root");
        t.record_failure(3, "replaced");
        assert_eq!(t.take_failure(3).as_deref(), Some("replaced"));
        assert_eq!(t.failure(3), None);
    }
}
