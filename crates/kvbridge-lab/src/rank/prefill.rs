//! A prefill rank process: fills its pools with the workload's pattern,
//! then streams each room in chunks as soon as its decode ranks are known.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvbridge_roles::synthetic::RankPools;
use kvbridge_roles::{KvPoll, KvSender, PrefillManager};

use super::RankFile;
use super::control::CONTROL;
use super::events::{Event, emit, unix_ms};
use super::workload::{PageAllocator, Request, Workload, alloc_request};

struct Active {
    request: Request,
    pages: Vec<i32>,
    aux: i32,
    sender: KvSender,
    /// When the decode's destination arrived (the forward pass starts).
    ready_at: Option<Instant>,
    first_send: Option<Instant>,
}

/// Runs the rank; `Ok(true)` when every room concluded (successfully or not).
pub fn run(file: &RankFile) -> Result<bool> {
    let model = file.model()?;
    super::announce_pools("prefill", file, &model);
    let mut pools = RankPools::with_placement(
        model.clone(),
        file.rank,
        file.pages,
        file.aux_slots,
        file.placement,
    )
    .context("allocating KV pools")?;
    let mut config = file.prefill.clone();
    config.rank.attn_tp_size = file.rank.tp_size;
    config.rank.attn_tp_rank = file.rank.tp_rank;
    config.rank.pp_size = file.rank.pp_size;
    config.rank.pp_rank = file.rank.pp_rank;
    let engine = file.engine()?;
    let requests = file
        .workload
        .as_ref()
        .map(Workload::requests)
        .unwrap_or_default();
    // Fill every request's pages that fit before starting, so the pattern
    // is not written while transfers are being timed.
    let mut pages = PageAllocator::new(pools.pages());
    let mut aux_slots = PageAllocator::new(pools.aux_slots());
    let mut filled: HashMap<u64, (Vec<i32>, i32)> = HashMap::new();
    for r in &requests {
        let n = Workload::pages(r.tokens, model.page_size);
        let Some((p, a)) = alloc_request(&mut pages, &mut aux_slots, n) else {
            break;
        };
        pools.fill_request(r.room, &r.slots(&p, a));
        filled.insert(r.index, (p, a));
    }
    // SAFETY: `pools` lives until after `manager.teardown()` below.
    let manager = unsafe { PrefillManager::start(config, file.kv_args(&pools), engine) }
        .context("starting the prefill manager")?;
    let cp = (
        file.prefill.rank.attn_cp_size.max(1),
        file.prefill.rank.attn_cp_rank,
    );
    let rank = (file.rank.pp_rank * cp.0 + cp.1) * file.rank.tp_size + file.rank.tp_rank;
    // Installed before "ready": a supervisor may signal as soon as it reads it.
    let signals = match file.workload {
        None => Some(crate::signals::StopSignals::install()?),
        Some(_) => None,
    };
    emit(&Event::Ready {
        role: "prefill".into(),
        rank,
        session: manager.session_id().to_owned(),
        control_port: manager.rank_port(),
    });
    let (Some(workload), None) = (&file.workload, signals.as_ref()) else {
        let signal = signals.map_or("no signal", crate::signals::StopSignals::wait);
        tracing::info!(signal, "prefill rank stopping");
        manager.teardown();
        drop(pools);
        return Ok(true);
    };
    let chunk_pages = Workload::pages(workload.chunk_tokens, model.page_size).max(1) as usize;
    let forward = Duration::try_from_secs_f64(workload.forward_s)
        .context("workload.forward_s must be a non-negative number of seconds")?;
    let mut pending: VecDeque<Request> = requests.into();
    let mut active: Vec<Active> = Vec::new();
    let mut drained = false;
    while !(pending.is_empty() && active.is_empty()) {
        let mut progressed = false;
        if let Some(below) = CONTROL.drain_below().filter(|_| !drained) {
            // No decode asked, or will ask, for a room at or past the
            // bound: give up the ones set up, never start the rest.
            drained = true;
            pending.retain(|r| r.index < below);
            active.retain_mut(|a| {
                // Sending means a decode asked: that room runs to its end.
                if a.request.index < below || a.first_send.is_some() {
                    return true;
                }
                a.sender
                    .fail("drained: the run ended before a decode asked for the room");
                a.sender.clear();
                pages.free(&a.pages);
                aux_slots.free(&[a.aux]);
                false
            });
            tracing::info!(below, left = pending.len() + active.len(), "draining");
        }
        while active.len() < workload.concurrency.max(1) {
            let Some(request) = pending.front().copied() else {
                break;
            };
            let n = Workload::pages(request.tokens, model.page_size);
            let (p, aux) = match filled.remove(&request.index) {
                Some(x) => x,
                // None: wait for a finishing room to return its pages.
                None => match alloc_request(&mut pages, &mut aux_slots, n) {
                    Some((p, a)) => {
                        pools.fill_request(request.room, &request.slots(&p, a));
                        (p, a)
                    }
                    None => break,
                },
            };
            pending.pop_front();
            let mut sender = manager.sender(request.room);
            sender.init(n, Some(aux as u64));
            active.push(Active {
                request,
                pages: p,
                aux,
                sender,
                ready_at: None,
                first_send: None,
            });
            progressed = true;
        }
        let mut i = 0;
        while i < active.len() {
            let a = &mut active[i];
            let status = a.sender.poll();
            let computed = status == KvPoll::WaitingForInput
                && a.ready_at.get_or_insert_with(Instant::now).elapsed() >= forward;
            if a.first_send.is_none() && computed {
                a.first_send = Some(Instant::now());
                // States travel with the last chunk (the sender attaches them there).
                let states = pools.state_indices(&a.request.slots(&a.pages, a.aux));
                let states: Vec<Option<Vec<i64>>> = states.into_iter().map(Some).collect();
                let mut sent_tokens = 0;
                for chunk in a.pages.chunks(chunk_pages) {
                    let tokens =
                        (chunk.len() as u64 * model.page_size).min(a.request.tokens - sent_tokens);
                    sent_tokens += tokens;
                    let last = sent_tokens == a.request.tokens;
                    a.sender
                        .send(chunk, last.then(|| states.clone()), Some(tokens))
                        .context("queueing a chunk")?;
                }
                progressed = true;
            }
            if status.is_terminal() {
                let mut a = active.swap_remove(i);
                let latency_ms = a
                    .first_send
                    .map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
                let reason =
                    (status == KvPoll::Failed).then(|| a.sender.failure_exception().reason);
                if status == KvPoll::Success {
                    a.sender.clear();
                }
                emit(&Event::Done {
                    role: "prefill".into(),
                    rank,
                    room: a.request.room,
                    success: status == KvPoll::Success,
                    reason,
                    latency_ms,
                    verified: 0,
                    mismatched: 0,
                    aborted: false,
                    timed_out: false,
                    end_unix_ms: unix_ms(),
                });
                pages.free(&a.pages);
                aux_slots.free(&[a.aux]);
                progressed = true;
                continue;
            }
            i += 1;
        }
        if !progressed {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    emit(&Event::Finished {
        role: "prefill".into(),
        rank,
    });
    if file.linger {
        if file.supervised {
            // The supervisor thread reads stdin and exits the process at its end.
            loop {
                std::thread::park();
            }
        }
        // Read errors also end the wait: stdin is gone either way.
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
    }
    manager.teardown();
    drop(pools);
    Ok(true)
}
