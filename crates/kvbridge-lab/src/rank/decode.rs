//! A decode rank process: asks for each room's KV, verifies every byte that
//! arrives, and aborts the rooms the workload says to.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvbridge_roles::synthetic::RankPools;
use kvbridge_roles::{DecodeManager, KvPoll, KvReceiver};

use super::RankFile;
use super::control::CONTROL;
use super::events::{Event, emit, unix_ms};
use super::workload::{PageAllocator, Request, alloc_request};

/// Byte written over an aborted room's pages once its ACK arrived; a later
/// write by the prefill would show up as a mismatch.
const POISON: u8 = 0xee;

struct Active {
    request: Request,
    pages: Vec<i32>,
    aux: i32,
    receiver: KvReceiver,
    started: Instant,
    abort_at: Option<Instant>,
    aborted_at: Option<Instant>,
    /// Given up past the room timeout.
    timed_out: bool,
}

/// Runs the rank; `Ok(true)` when no byte mismatched.
pub fn run(file: &RankFile) -> Result<bool> {
    let model = file.model()?;
    let Some(addr) = file.bootstrap_addr.clone() else {
        bail!("a decode rank needs `bootstrap_addr` (the prefill's bootstrap server)");
    };
    // Fail here, before "ready", rather than leave every room to time out.
    kvbridge_roles::bootstrap::client::wait_until_reachable(
        &addr,
        kvbridge_roles::bootstrap::client::REACHABLE_DEADLINE,
    )
    .map_err(anyhow::Error::msg)?;
    super::announce_pools("decode", file, &model);
    let mut pools = RankPools::with_placement(
        model.clone(),
        file.rank,
        file.pages,
        file.aux_slots,
        file.placement,
    )
    .context("allocating KV pools")?;
    let mut config = file.decode.clone();
    config.attn_tp_size = file.rank.tp_size;
    config.pp_size = file.rank.pp_size;
    config.pp_rank = file.rank.pp_rank;
    let engine = file.engine()?;
    // Past the role's ABORT_ACK timeout it fences silent prefill ranks (the
    // pages become safe); a room still not drained a little later is one
    // whose ranks cannot be fenced: its pages are quarantined.
    let quarantine_after = config.abort_ack_timeout + Duration::from_secs(5);
    // SAFETY: `pools` lives until after `manager.teardown()` below.
    let manager = unsafe { DecodeManager::start(config, file.kv_args(&pools), engine) }
        .context("starting the decode manager")?;
    let rank = file.rank.tp_rank;
    // Installed before "ready": a supervisor may signal as soon as it reads it.
    let signals = match file.workload {
        None => Some(crate::signals::StopSignals::install()?),
        Some(_) => None,
    };
    emit(&Event::Ready {
        role: "decode".into(),
        rank,
        session: manager.session_id().to_owned(),
        control_port: manager.rank_port(),
    });
    let (Some(workload), None) = (&file.workload, signals.as_ref()) else {
        let signal = signals.map_or("no signal", crate::signals::StopSignals::wait);
        tracing::info!(signal, "decode rank stopping");
        manager.teardown();
        drop(pools);
        return Ok(true);
    };
    let mut pages = PageAllocator::new(pools.pages());
    let mut aux_slots = PageAllocator::new(pools.aux_slots());
    let mut pending: VecDeque<Request> = workload.requests().into();
    let mut active: Vec<Active> = Vec::new();
    let mut clean = true;
    // Pages held back for ever because their room's abort was never acknowledged.
    let mut quarantined: u64 = 0;
    let room_timeout =
        Duration::try_from_secs_f64(workload.room_timeout_s).unwrap_or(Duration::from_secs(60));
    let mut jitter = workload.seed | 1;
    // Every request started so far has an index below this.
    let mut below = 0;
    let mut pause_reported = false;
    while !(pending.is_empty() && active.is_empty()) {
        let mut progressed = false;
        while active.len() < workload.concurrency.max(1) {
            if CONTROL.paused() {
                if !pause_reported {
                    pause_reported = true;
                    emit(&Event::Paused { rank, below });
                }
                break;
            }
            let Some(request) = pending.front().copied() else {
                break;
            };
            // Drained (which also ended the pause just read): requests
            // are in index order, so none from here on starts.
            if let Some(b) = CONTROL.drain_below().filter(|b| request.index >= *b) {
                tracing::info!(below = b, dropped = pending.len(), "drained");
                pending.clear();
                break;
            }
            // A DCP rank's pages are virtual (`page_size * dcp_size` tokens).
            let n = pools.pages_for(request.tokens);
            let Some((p, a)) = alloc_request(&mut pages, &mut aux_slots, n) else {
                break;
            };
            pending.pop_front();
            below = request.index + 1;
            let slots = request.slots(&p, a);
            let states = pools.dst_state_indices(&slots);
            let mut receiver = manager.receiver(&addr, request.room);
            // The prefill DP rank holding the room: computed, or asked of the
            // bootstrap server until its prefill registered it (bounded by
            // the bootstrap timeout; `None` with the room failed past it).
            let dp = loop {
                match receiver.prefill_dp_rank(None) {
                    Some(dp) => break Some(dp),
                    None if receiver.poll() == KvPoll::Failed => break None,
                    None => std::thread::sleep(Duration::from_millis(2)),
                }
            };
            // Before the destination goes out: the prefill's transfer of
            // this room starts after this instant.
            let started_unix_ms = unix_ms();
            let mut state = match dp {
                Some(dp) => receiver.init(dp),
                None => KvPoll::Failed,
            };
            if state != KvPoll::Failed {
                state = match pools.hisparse_host_pages(&p) {
                    Some(host) => {
                        receiver.send_metadata_hisparse(&host, &p, a as u64, &states, None)
                    }
                    None => receiver.send_metadata(&p, a as u64, &states, None),
                };
            }
            emit(&Event::Started {
                room: request.room,
                unix_ms: started_unix_ms,
            });
            jitter ^= jitter << 13;
            jitter ^= jitter >> 7;
            jitter ^= jitter << 17;
            let abort_at = workload
                .aborts(request.index)
                .then(|| Instant::now() + Duration::from_micros(jitter % 3000));
            active.push(Active {
                request,
                pages: p,
                aux: a,
                receiver,
                started: Instant::now(),
                abort_at,
                aborted_at: None,
                timed_out: false,
            });
            let _ = state;
            progressed = true;
        }
        let mut i = 0;
        while i < active.len() {
            let a = &mut active[i];
            if a.aborted_at.is_none() && a.abort_at.is_some_and(|t| Instant::now() >= t) {
                a.receiver.abort();
                a.aborted_at = Some(Instant::now());
            }
            if a.aborted_at.is_none() && a.started.elapsed() > room_timeout {
                a.receiver.abort();
                a.aborted_at = Some(Instant::now());
                a.abort_at = None;
                a.timed_out = true;
            }
            if a.aborted_at.is_none() && a.receiver.poll() == KvPoll::Failed {
                // Failed (here or at a prefill rank): the receiver told
                // every prefill rank to stop; wait for them as for an abort.
                a.aborted_at = Some(Instant::now());
            }
            // Pages are reused only once every prefill rank has acknowledged
            // the abort (its in-flight writes drained). A room whose ranks
            // stay silent is concluded after a while but its pages are
            // quarantined, never reused: a late write could still land.
            let mut reuse_pages = true;
            let finished = match a.aborted_at {
                Some(at) => {
                    if a.receiver.abort_acknowledged() {
                        pools.poison(&a.pages, POISON);
                        Some(KvPoll::Failed)
                    } else if at.elapsed() > quarantine_after {
                        reuse_pages = false;
                        quarantined += a.pages.len() as u64;
                        tracing::error!(
                            room = a.request.room,
                            pages = a.pages.len(),
                            quarantined,
                            "no ABORT_ACK from the room's prefill ranks; its pages are quarantined"
                        );
                        Some(KvPoll::Failed)
                    } else {
                        None
                    }
                }
                None => Some(a.receiver.poll()).filter(|s| s.is_terminal()),
            };
            let Some(status) = finished else {
                i += 1;
                continue;
            };
            let mut a = active.swap_remove(i);
            let latency_ms = a.started.elapsed().as_secs_f64() * 1e3;
            let (verified, reason) = if status == KvPoll::Success {
                let slots = a.request.slots(&a.pages, a.aux);
                (pools.verify_request(a.request.room, &slots), None)
            } else {
                let why = a.receiver.failure_exception().reason;
                let why = if a.abort_at.is_some() {
                    "aborted by the demo (decode side)".to_owned()
                } else if a.timed_out {
                    format!(
                        "no KV within the room timeout ({} s); the decode aborted the room",
                        room_timeout.as_secs_f64()
                    )
                } else {
                    why
                };
                (Default::default(), Some(why))
            };
            a.receiver.clear();
            if verified.mismatched > 0 {
                clean = false;
            }
            emit(&Event::Done {
                role: "decode".into(),
                rank,
                room: a.request.room,
                success: status == KvPoll::Success,
                reason,
                latency_ms,
                verified: verified.bytes,
                mismatched: verified.mismatched,
                aborted: a.abort_at.is_some(),
                timed_out: a.timed_out,
                end_unix_ms: unix_ms(),
            });
            if reuse_pages {
                pages.free(&a.pages);
                aux_slots.free(&[a.aux]);
            }
            progressed = true;
        }
        if !progressed {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    emit(&Event::Finished {
        role: "decode".into(),
        rank,
    });
    manager.teardown();
    drop(pools);
    Ok(clean)
}
