//! `KvSender`: one request's sending side (sglang `MooncakeKVSender`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvbridge_plan::{TransferChunk, cp_filter_chunk};
use kvbridge_wire::KvPoll;

use super::cp::CpRole;
use super::room::{Input, Output};
use super::{QueuedChunk, Shared};
use crate::error::{KvTransferError, SendError};
use crate::stage::{self, Stage};

/// The prefill side of one room: announce the pages, send them in chunks,
/// poll until `Success` or `Failed`.
#[derive(Debug)]
pub struct KvSender {
    shared: Arc<Shared>,
    room: u64,
    total_pages: Option<u64>,
    aux_index: Option<u64>,
    sent_pages: u64,
    conclude_state: Option<KvPoll>,
    init_time: Instant,
}

/// With several DP ranks and no router hint: registers the room's DP rank
/// with the bootstrap server for decodes to query, or, when routing follows
/// the bootstrap room, fails a room this DP rank should not have received.
fn route_dp(shared: &Shared, room: u64) {
    let config = &shared.config;
    let (dp, dp_size) = config.rank.dp_group();
    if dp_size <= 1 {
        return;
    }
    if config.load_balance_method != "follow_bootstrap_room" || config.force_query_dp_rank {
        if let Err(e) = crate::bootstrap::client::register_dp_rank(config, room, dp) {
            shared.metrics.failure("dp_registration");
            tracing::warn!(room, dp, error = %e, "cannot register the room's DP rank; its decode cannot find it");
        }
    } else if room % dp_size != dp {
        shared.metrics.failure("dp_conflict");
        let reason = format!(
            "follow_bootstrap_room conflict: room {room} was dispatched to DP rank {dp} but the \
             bootstrap room implies DP rank {}; set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 \
             or route by the bootstrap room",
            room % dp_size
        );
        shared.step(Input::Fail { room, reason });
    }
}

/// The shard queue of a room's chunks: from the port sum of the room's
/// decode sessions (where sglang puts every room of that decode) on, spread
/// over every queue by a hash of the room. A room's chunks stay on one
/// queue, in order; one decode's rooms no longer wait on one worker, whose
/// CPU per room held 64 MiB IPC rooms to about 0.6 of the engine with 16 in
/// flight (docs/engines.md, "Rooms through the roles against the engine
/// alone").
fn shard_of(port_sum: u64, room: u64, queues: usize) -> usize {
    let queues = queues.max(1) as u64;
    // Hashed, not the room itself: rooms a DP router sent here share a
    // residue modulo the DP size, and must still reach every queue.
    let z = kvbridge_plan::rng::splitmix(room);
    ((port_sum % queues + z % queues) % queues) as usize
}

impl KvSender {
    /// A sender for `room`; `dp_hinted`: the router told the decode which
    /// DP rank serves the room (sglang's `disagg_prefill_dp_rank`), so it
    /// needs neither the bootstrap room rule nor a registration.
    pub(crate) fn new(shared: Arc<Shared>, room: u64, dp_hinted: bool) -> Self {
        // A dummy CP rank is never asked by a decode: nothing to wait for.
        shared.step(Input::Open {
            room,
            dummy: shared.cp.is_dummy(),
        });
        if !dp_hinted && !shared.cp.is_dummy() {
            route_dp(&shared, room);
        }
        Self {
            shared,
            room,
            total_pages: None,
            aux_index: None,
            sent_pages: 0,
            conclude_state: None,
            init_time: Instant::now(),
        }
    }

    /// The room.
    pub fn room(&self) -> u64 {
        self.room
    }

    /// Announces how many pages the request has and its aux slot.
    pub fn init(&mut self, num_kv_indices: u64, aux_index: Option<u64>) {
        self.total_pages = Some(num_kv_indices);
        self.aux_index = aux_index;
    }

    /// Queues the next chunk of pages; the chunk that completes the announced
    /// page count is the last one and also carries states and aux.
    pub fn send(
        &mut self,
        kv_indices: &[i32],
        state_indices: Option<Vec<Option<Vec<i64>>>>,
        num_kv_tokens: Option<u64>,
    ) -> Result<(), SendError> {
        let room = self.room;
        let _span = tracing::debug_span!("room", room, side = "prefill").entered();
        let total = self.total_pages.ok_or(SendError::NotInitialized(room))?;
        if matches!(self.conclude_state, Some(KvPoll::Success | KvPoll::Failed)) {
            return Ok(());
        }
        let start = self.sent_pages;
        let end = start + kv_indices.len() as u64;
        if end > total {
            return Err(SendError::TooManyPages {
                room,
                sent: end,
                total,
            });
        }
        let is_last = end == total;
        if is_last
            && self.aux_index.is_none()
            && !self.shared.kv_args.layout.aux_data_ptrs.is_empty()
        {
            return Err(SendError::MissingAuxIndex(room));
        }
        if self.shared.stopped.load(Ordering::SeqCst) {
            return Err(SendError::Stopped(room));
        }
        self.sent_pages = end;
        let (kv_indices, positions, state_indices) = match self.shared.cp {
            CpRole::Whole => (kv_indices, start..end, state_indices),
            CpRole::Dummy => {
                if is_last {
                    self.shared.step(Input::Succeed { room });
                }
                return Ok(());
            }
            CpRole::Share { rank, size } => {
                let (pages, at) = cp_filter_chunk(kv_indices, start..end, total, rank, size);
                // The state is replicated across CP ranks: rank 0 sends it.
                (pages, at, state_indices.filter(|_| rank == 0))
            }
        };
        // Failed, cleared, or no destination (this rank is a dummy for the
        // room): nothing to send.
        let Output::Shard(Some(port_sum)) = self.shared.step(Input::Queue {
            room,
            now: Instant::now(),
        }) else {
            return Ok(());
        };
        let shard = shard_of(port_sum, room, self.shared.queues.len());
        let chunk = TransferChunk {
            prefill_kv_indices: kv_indices.to_vec(),
            index_slice_start: positions.start,
            index_slice_end: Some(positions.end),
            is_last_chunk: is_last,
            prefill_aux_index: if is_last { self.aux_index } else { None },
            state_indices: if is_last { state_indices } else { None },
            num_kv_tokens,
        };
        stage::mark(room, Stage::Queued);
        if let Some(queue) = self.shared.queues.get(shard)
            && queue.send(Some(QueuedChunk { room, chunk })).is_err()
        {
            return Err(SendError::Stopped(room));
        }
        Ok(())
    }

    /// The room's state; a room stuck bootstrapping past the timeout fails.
    pub fn poll(&mut self) -> KvPoll {
        if let Some(state) = self.conclude_state {
            return state;
        }
        let give_up =
            (self.init_time.elapsed() >= self.shared.config.bootstrap_timeout).then(|| {
                format!(
                    "Request {} timed out after {:.1}s in KVPoll.Bootstrapping",
                    self.room,
                    self.init_time.elapsed().as_secs_f64()
                )
            });
        let Output::Polled(status, notice) = self.shared.step(Input::Poll {
            room: self.room,
            give_up,
        }) else {
            return KvPoll::Failed;
        };
        if let Some(notice) = notice {
            self.shared.tell_failed(self.room, notice);
            self.conclude_state = Some(KvPoll::Failed);
            return KvPoll::Failed;
        }
        if status.is_terminal() {
            self.conclude_state = Some(status);
        }
        status
    }

    /// Tokens the decode already holds for this room (once its destinations
    /// are known), consumed once.
    pub fn pop_decode_prefix_len(&self) -> u64 {
        match self.shared.step(Input::TakePrefixLen { room: self.room }) {
            Output::Count(n) => n,
            _ => 0,
        }
    }

    /// KV and state bytes of this room confirmed written to its decode
    /// ranks so far (aux rows not counted; MLA copies to several decode
    /// ranks each count), until [`KvSender::clear`].
    pub fn payload_bytes(&self) -> u64 {
        match self.shared.step(Input::PayloadBytes { room: self.room }) {
            Output::Count(n) => n,
            _ => 0,
        }
    }

    /// Aborts the room from the prefill side; its decode ranks that sent
    /// their destinations are told `Failed` (once, when nothing of the room
    /// is in flight), so they conclude at once instead of at their timeout.
    pub fn abort(&mut self) {
        self.fail("Aborted by AbortReq.");
    }

    /// Fails the room with `reason` (a give-up decided above the role, e.g.
    /// a pipeline stage that never reported in time) and tells its known
    /// decode ranks, as [`KvSender::abort`] does.
    pub fn fail(&mut self, reason: impl Into<String>) {
        let notice = self.shared.step(Input::FailAndTell {
            room: self.room,
            reason: reason.into(),
        });
        self.conclude_state = Some(KvPoll::Failed);
        if let Output::Notice(notice) = notice {
            self.shared.tell_failed(self.room, notice);
        }
    }

    /// Seconds since the sender was created (the bootstrap timeout's clock).
    pub fn age(&self) -> std::time::Duration {
        self.init_time.elapsed()
    }

    /// Clears the room and returns its failure: the recorded reason, or a
    /// generic one marked as coming from another rank.
    pub fn failure_exception(&mut self) -> KvTransferError {
        self.conclude_state = Some(KvPoll::Failed);
        self.clear();
        let reason = match self.shared.step(Input::TakeFailure { room: self.room }) {
            Output::Reason(reason) => reason,
            _ => None,
        };
        KvTransferError::from_recorded(self.room, reason)
    }

    /// Forgets the room (its transfer state is dropped once nothing of it is
    /// in flight; a pending abort ACK still goes out when it drains).
    pub fn clear(&mut self) {
        let Output::Cleared(state, acks) = self.shared.step(Input::Clear { room: self.room })
        else {
            return;
        };
        if self.conclude_state.is_none()
            && let Some(s) = state.filter(|s| s.is_terminal())
        {
            self.conclude_state = Some(s);
        }
        for target in acks {
            self.shared.send_abort_ack(self.room, &target);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::shard_of;

    /// Rooms per queue of `rooms` sent to one decode (port sum 40_123).
    fn counts(rooms: impl Iterator<Item = u64>, queues: usize) -> Vec<usize> {
        let mut n = vec![0; queues];
        for room in rooms {
            n[shard_of(40_123, room, queues)] += 1;
        }
        n
    }

    #[test]
    fn a_room_always_lands_on_the_same_queue_in_range() {
        for queues in [0, 1, 3, 4, 12] {
            for room in [0, 1, 7, u64::MAX, 1 << 63] {
                for port_sum in [0, 17_000, u64::MAX] {
                    let shard = shard_of(port_sum, room, queues);
                    assert!(shard < queues.max(1));
                    assert_eq!(shard, shard_of(port_sum, room, queues));
                }
            }
        }
    }

    #[test]
    fn one_decode_rooms_spread_over_every_queue() {
        for queues in [2, 4, 12] {
            let n = counts(0..12_000, queues);
            let even = 12_000 / queues;
            for (q, &c) in n.iter().enumerate() {
                assert!(
                    c > even * 8 / 10 && c < even * 12 / 10,
                    "queue {q} of {queues} got {c} rooms: {n:?}"
                );
            }
        }
    }

    #[test]
    fn dp_routed_rooms_sharing_a_residue_still_reach_every_queue() {
        // A DP rank of 4 gets the rooms with room % 4 == its rank.
        for rank in 0..4 {
            let n = counts((0..4_000).map(|i| i * 4 + rank), 4);
            assert!(n.iter().all(|&c| c > 800), "DP rank {rank}: {n:?}");
        }
    }

    #[test]
    fn a_single_queue_takes_everything() {
        assert!((0..100).all(|room| shard_of(12_345, room, 1) == 0));
    }
}
