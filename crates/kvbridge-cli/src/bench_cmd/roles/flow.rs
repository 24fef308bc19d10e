//! The timed part of `bench roles`: rooms streamed through the roles with
//! `in_flight` of them transferring at once (a room starts as soon as one
//! concludes, its destinations sent ahead), and raw-engine batches of the
//! same bytes streamed the same way.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvbridge_engine::{Batch, Target};

use super::DEADLINE;
use super::pair::{Flying, Pair};

/// Shortest pause between two polls of the rooms in flight.
const POLL_MIN: Duration = Duration::from_micros(20);
/// Longest pause between two polls before a room's latency is known.
const POLL_FIRST: Duration = Duration::from_micros(50);
/// Longest pause between two polls ever.
const POLL_CAP: Duration = Duration::from_millis(2);
/// Polls per room latency, at most: a room concludes at most 1/32 of its
/// latency before it is noticed, and the polls cost the driving thread
/// little CPU however long rooms take (on two cores, 50 µs polls of 60 ms
/// TCP rooms took a fifth of a core from the transfer).
const POLLS_PER_ROOM: u32 = 32;

/// What one stream measured.
pub(super) struct Flow {
    /// First send (or submission) to the last conclusion.
    pub(super) wall: Duration,
    /// Each room's (or raw slot batch's) time, send to conclusion.
    pub(super) rooms: Vec<Duration>,
}

impl Pair {
    /// Streams rooms `first..first + count` through the roles, at most
    /// `in_flight` transferring at once. The prefill's pages keep the bytes
    /// they hold (the untimed [`Pair::check`] verifies the slots' rooms).
    pub(super) fn stream(&mut self, first: u64, count: u64, in_flight: usize) -> Result<Flow> {
        let tokens = self.room_tokens();
        // One room per slot to begin with; a slot takes the next room as
        // soon as its room is cleared.
        let mut next = count.min(self.slots());
        let mut ready: VecDeque<Flying> = (0..next)
            .map(|slot| self.open_room(first + slot, slot, false))
            .collect();
        // Timing starts once the first rooms could go, as when a forward
        // pass ends with the decode's destinations already known.
        let deadline = Instant::now() + DEADLINE;
        for r in ready.iter_mut().take(in_flight) {
            r.wait_destinations(deadline)?;
        }
        let start = Instant::now();
        let mut active: Vec<Flying> = Vec::with_capacity(in_flight);
        let mut took = Vec::with_capacity(count as usize);
        // Polls back off to `poll_max`, as a scheduler between its
        // iterations, so that polling does not take the cores the transfer
        // needs; `poll_max` follows the rooms' latency (the last one's).
        let mut nap = POLL_MIN;
        let mut poll_max = POLL_FIRST;
        while took.len() < count as usize {
            let mut moved = false;
            while active.len() < in_flight
                && let Some(r) = ready.front_mut()
                && r.destinations_known()?
                && let Some(mut r) = ready.pop_front()
            {
                r.sender
                    .send(&r.pages, None, Some(tokens))
                    .context("queueing the room")?;
                r.sent = Some(Instant::now());
                active.push(r);
                moved = true;
            }
            let mut i = 0;
            while i < active.len() {
                if !active[i].concluded()? {
                    i += 1;
                    continue;
                }
                let mut r = active.swap_remove(i);
                super::stages::noticed(r.room);
                let latency = r.sent.map_or(Duration::ZERO, |t| t.elapsed());
                poll_max = (latency / POLLS_PER_ROOM).clamp(POLL_MIN, POLL_CAP);
                took.push(latency);
                self.close_room(&mut r, deadline)?;
                if next < count {
                    ready.push_back(self.open_room(first + next, r.slot, false));
                    next += 1;
                }
                moved = true;
            }
            if Instant::now() > deadline {
                bail!("rooms {first}.. did not conclude within {DEADLINE:?}");
            }
            if moved {
                nap = POLL_MIN;
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(poll_max);
            }
        }
        Ok(Flow {
            wall: start.elapsed(),
            rooms: took,
        })
    }

    /// Streams `count` raw-engine batches of a room's bytes (whole-buffer
    /// blocks from the prefill engine into each decode rank, the slots in
    /// turn), at most `in_flight` slots' batches in flight at once.
    pub(super) fn raw_stream(&self, count: u64, in_flight: usize) -> Result<Flow> {
        let start = Instant::now();
        let mut flying = VecDeque::with_capacity(in_flight);
        let mut took = Vec::with_capacity(count as usize);
        let mut next = 0u64;
        let slots = self.raw_blocks.len().max(1) as u64;
        while next < count || !flying.is_empty() {
            while flying.len() < in_flight && next < count {
                let blocks = &self.raw_blocks[(next % slots) as usize];
                let handles: Vec<_> = self
                    .decode
                    .iter()
                    .zip(blocks)
                    .map(|(d, b)| {
                        self.prefill_engine
                            .submit(Target::any(d.session_id()), Batch::Blocks(b))
                    })
                    .collect();
                flying.push_back((Instant::now(), handles));
                next += 1;
            }
            let Some((sent, handles)) = flying.pop_front() else {
                break;
            };
            for h in handles {
                match h.wait_timeout(DEADLINE) {
                    Some(r) => r.context("the raw engine batch failed")?,
                    None => bail!("the raw engine batch did not finish within {DEADLINE:?}"),
                }
            }
            took.push(sent.elapsed());
        }
        Ok(Flow {
            wall: start.elapsed(),
            rooms: took,
        })
    }
}
