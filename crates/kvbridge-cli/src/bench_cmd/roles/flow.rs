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
    /// When each room concluded, in order.
    pub(super) ends: Vec<Instant>,
}

impl Flow {
    /// The stream once its pipeline was full: the rooms that concluded
    /// after the `in_flight`-th and the time from its conclusion to the
    /// last one (`None` when the stream held no more rooms than that). This
    /// leaves out the fill, the first rooms' fixed latency, which `wall`
    /// holds once per stream; with rooms sharing the wire the first
    /// `in_flight` conclude together, so counting from the first alone
    /// would not leave it out.
    pub(super) fn steady(&self, in_flight: usize) -> Option<(u64, Duration)> {
        let k = in_flight.max(1);
        let (full, last) = (self.ends.get(k - 1)?, self.ends.last()?);
        let rooms = (self.ends.len() - k) as u64;
        (rooms > 0).then(|| (rooms, last.duration_since(*full)))
    }
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
        let mut ends = Vec::with_capacity(count as usize);
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
                ends.push(Instant::now());
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
            ends,
        })
    }

    /// Streams `count` raw-engine batches of a room's bytes (whole-buffer
    /// blocks from the prefill engine into each decode rank, the slots in
    /// turn), at most `in_flight` slots' batches in flight at once.
    pub(super) fn raw_stream(&self, count: u64, in_flight: usize) -> Result<Flow> {
        let start = Instant::now();
        let mut flying = VecDeque::with_capacity(in_flight);
        let mut took = Vec::with_capacity(count as usize);
        let mut ends = Vec::with_capacity(count as usize);
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
            ends.push(Instant::now());
            took.push(sent.elapsed());
        }
        Ok(Flow {
            wall: start.elapsed(),
            rooms: took,
            ends,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(ends_ms: &[u64]) -> Flow {
        let t0 = Instant::now();
        Flow {
            wall: Duration::from_millis(ends_ms.last().copied().unwrap_or(0)),
            rooms: vec![Duration::ZERO; ends_ms.len()],
            ends: ends_ms
                .iter()
                .map(|&ms| t0 + Duration::from_millis(ms))
                .collect(),
        }
    }

    #[test]
    fn steady_leaves_out_the_fill() {
        // One at a time on a serial copier: a 10 ms fill, then one room per ms.
        let f = flow(&[10, 11, 12, 13, 14, 15]);
        assert_eq!(f.steady(1), Some((5, Duration::from_millis(5))));
        assert_eq!(f.steady(2), Some((4, Duration::from_millis(4))));
        // Rooms sharing the wire conclude in waves of `in_flight`: from the
        // first wave's end, one wave per 20 ms.
        let f = flow(&[19, 20, 20, 20, 39, 40, 40, 40, 59, 60, 60, 60]);
        assert_eq!(f.steady(4), Some((8, Duration::from_millis(40))));
    }

    #[test]
    fn no_steady_rate_without_more_rooms_than_in_flight() {
        assert_eq!(flow(&[5, 6, 7]).steady(3), None);
        assert_eq!(flow(&[5, 6]).steady(4), None);
        assert_eq!(flow(&[]).steady(1), None);
        // `in_flight` 0 counts as 1.
        assert_eq!(flow(&[5, 7]).steady(0), Some((1, Duration::from_millis(2))));
    }
}
