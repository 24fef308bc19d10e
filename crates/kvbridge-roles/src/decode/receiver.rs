//! `KvReceiver`: one request's receiving side (sglang `MooncakeKVReceiver`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_wire::bootstrap::{PrefillRankInfo, PrefillServerInfo};
use kvbridge_wire::{Abort, KvPoll};

use super::Shared;
use super::room::{Drain, Input, Output};
use super::slots::ExpectedRanks;
use super::state::{BootstrapInfo, PrefillSummary};
use super::topology::{LocalTopology, RankMapping, resolve};
use crate::error::KvTransferError;
use crate::stage::{self, Stage};

/// The decode side of one room: find the prefill ranks, register, send the
/// destination pages, poll until `Success` or `Failed`.
#[derive(Debug)]
pub struct KvReceiver {
    pub(super) shared: Arc<Shared>,
    pub(super) bootstrap_addr: String,
    pub(super) room: u64,
    pub(super) infos: Option<Vec<BootstrapInfo>>,
    pub(super) mapping: Option<RankMapping>,
    pub(super) conclude_state: Option<KvPoll>,
    pub(super) init_time: Option<Instant>,
    /// When DP routing gives up waiting for the room's DP rank.
    pub(super) dp_deadline: Option<Instant>,
}

/// The outcome of one bootstrap lookup.
pub(crate) enum Fetch<T> {
    /// Resolved.
    Ready(T),
    /// Not yet (the prefill is still registering, or unreachable).
    Retry(String),
    /// Never (an incompatible topology or a malformed answer).
    Fatal(String),
}

/// One attempt to resolve the prefill server at `addr` (cached once
/// resolved): fetch its parallel info and map its ranks onto ours.
pub(crate) fn ensure_parallel_info(shared: &Shared, addr: &str) -> Fetch<RankMapping> {
    if let Some(m) = shared.prefills.lock().mapping.get(addr) {
        return Fetch::Ready(m.clone());
    }
    let url = format!(
        "http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    );
    let info: PrefillServerInfo = match get_json(shared, &url) {
        Fetch::Ready(i) => i,
        Fetch::Retry(r) => return Fetch::Retry(r),
        Fetch::Fatal(r) => return Fetch::Fatal(r),
    };
    let l = &shared.kv_args.layout;
    let local = LocalTopology {
        attn_tp_size: l.attn_tp_size,
        engine_rank: l.engine_rank,
        pp_size: shared.config.pp_size,
        pp_rank: shared.config.pp_rank,
        page_size: l.page_size,
        is_mla: l.is_mla_backend,
        is_hybrid_mla: l.is_hybrid_mla_backend,
        all_cp_ranks: shared.config.all_cp_ranks,
        dcp_size: l.dcp_size,
    };
    match resolve(
        &info,
        &local,
        &shared.config.kv_cache_dtype,
        shared.config.kv_layout.as_deref(),
    ) {
        Ok(m) => {
            let mut prefills = shared.prefills.lock();
            prefills
                .sizes
                .insert(addr.to_owned(), (info.pp_size, info.attn_cp_size));
            prefills.servers.insert(
                addr.to_owned(),
                PrefillSummary {
                    dp_size: info.dp_size,
                    follow_bootstrap_room: info.follow_bootstrap_room,
                },
            );
            prefills.mapping.insert(addr.to_owned(), m.clone());
            Fetch::Ready(m)
        }
        Err(reason) => Fetch::Fatal(reason),
    }
}

/// `GET url` as JSON: 503 and transport errors are worth retrying.
fn get_json<T: serde::de::DeserializeOwned>(shared: &Shared, url: &str) -> Fetch<T> {
    match shared.http.get(url).call() {
        Ok(mut resp) if resp.status() == 200 => match resp.body_mut().read_json::<T>() {
            Ok(v) => Fetch::Ready(v),
            Err(e) => Fetch::Fatal(format!("bad answer from {url}: {e}")),
        },
        Ok(resp) if resp.status() == 503 => Fetch::Retry("prefill not fully registered yet".into()),
        Ok(mut resp) => {
            let status = resp.status();
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            Fetch::Retry(format!("{url} answered {status}: {text}"))
        }
        Err(e) => Fetch::Retry(format!("{url}: {e}")),
    }
}

impl KvReceiver {
    pub(crate) fn new(shared: Arc<Shared>, bootstrap_addr: String, room: u64) -> Self {
        shared.step(Input::Open {
            room,
            addr: bootstrap_addr.clone(),
        });
        Self {
            shared,
            bootstrap_addr,
            room,
            infos: None,
            mapping: None,
            conclude_state: None,
            init_time: None,
            dp_deadline: None,
        }
    }

    /// The room.
    pub fn room(&self) -> u64 {
        self.room
    }

    /// The prefill ranks this room talks to, once resolved.
    pub fn bootstrap_infos(&self) -> Option<&[BootstrapInfo]> {
        self.infos.as_deref()
    }

    pub(super) fn fail(&mut self, reason: String) -> KvPoll {
        tracing::warn!(room = self.room, %reason, "room failed");
        self.shared.step(Input::Fail {
            room: self.room,
            reason,
        });
        self.conclude_state = Some(KvPoll::Failed);
        self.stop_writers();
        KvPoll::Failed
    }

    /// Tells every prefill rank of the room to stop writing its pages
    /// (ABORT), once per room: each acknowledges when its in-flight writes
    /// drained, which [`KvReceiver::abort_acknowledged`] reports. Sent on
    /// an abort and whenever the room fails here, so that one rank's
    /// failure never leaves another still writing pages about to be reused.
    fn stop_writers(&mut self) {
        let Some(infos) = self.infos.as_ref() else {
            return; // no prefill rank was told about the room
        };
        let Output::Abort(Some(generation)) = self.shared.step(Input::StopWriters {
            room: self.room,
            with_generation: self.shared.config.deferred_release,
            now: Instant::now(),
        }) else {
            return; // sent already
        };
        for info in infos {
            let message = Abort {
                room: self.room,
                decode_ip: self.shared.config.local_ip.as_str().into(),
                decode_port: self.shared.rank_port,
                generation,
            };
            if let Err(e) = self.shared.send_sealed(&info.endpoint(), message.encode()) {
                tracing::debug!(room = self.room, error = %e, "cannot send abort notification");
            }
        }
    }

    /// Resolves the prefill ranks (retrying while the prefill server is not
    /// yet fully registered, up to the bootstrap timeout), registers our
    /// buffers with each of them once, and moves the room to
    /// `WaitingForInput`. Returns the room's state.
    pub fn init(&mut self, prefill_dp_rank: u64) -> KvPoll {
        let _span = tracing::debug_span!("room", room = self.room, side = "decode").entered();
        if self.conclude_state == Some(KvPoll::Failed) {
            return KvPoll::Failed;
        }
        let deadline = Instant::now() + self.shared.config.bootstrap_timeout;
        let mapping = loop {
            match self.ensure_parallel_info() {
                Fetch::Ready(m) => break m,
                Fetch::Fatal(reason) => return self.fail(reason),
                Fetch::Retry(reason) => {
                    if Instant::now() >= deadline {
                        return self.fail(format!(
                            "Could not fetch prefill parallel info from bootstrap_addr {}: {reason}",
                            self.bootstrap_addr
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        let mut all = Vec::new();
        for cp in mapping.target_cp_ranks.clone() {
            match self.bootstrap_infos_for(prefill_dp_rank, cp, &mapping) {
                Ok(infos) => all.extend(infos),
                Err(reason) => return self.fail(reason),
            }
        }
        let expected = ExpectedRanks {
            status: all
                .iter()
                .filter(|i| !i.is_dummy)
                .map(|i| i.unique_rank)
                .collect(),
            all: all.iter().map(|i| i.unique_rank).collect(),
            sessions: all
                .iter()
                .filter_map(|i| Some((i.unique_rank, i.engine_session.clone()?)))
                .collect(),
            keys: all
                .iter()
                .filter_map(|i| Some((i.unique_rank, self.shared.pair_key(&i.endpoint())?)))
                .collect(),
        };
        self.infos = Some(all);
        let required = mapping.required_prefill_response_num;
        self.mapping = Some(mapping);
        match self.shared.step(Input::Resolved {
            room: self.room,
            required,
            expected,
        }) {
            Output::State(Some(state)) => state,
            _ => KvPoll::Failed,
        }
    }

    fn ensure_parallel_info(&self) -> Fetch<RankMapping> {
        ensure_parallel_info(&self.shared, &self.bootstrap_addr)
    }

    fn get_json<T: serde::de::DeserializeOwned>(&self, url: &str) -> Fetch<T> {
        get_json(&self.shared, url)
    }

    /// The prefill ranks of one CP rank, resolved and registered with once
    /// per bootstrap key and cached.
    fn bootstrap_infos_for(
        &self,
        dp: u64,
        cp: u64,
        m: &RankMapping,
    ) -> Result<Vec<BootstrapInfo>, String> {
        let target = m
            .target_tp_rank
            .map_or_else(|| "None".to_owned(), |t| t.to_string());
        let key = format!("{}_{dp}_{cp}_{target}", self.bootstrap_addr);
        if let Some(cached) = self.shared.prefills.lock().pool.get(&key) {
            return Ok(cached.clone());
        }
        let Some((pp_size, cp_size)) = self
            .shared
            .prefills
            .lock()
            .sizes
            .get(&self.bootstrap_addr)
            .copied()
        else {
            return Err(format!(
                "prefill server {} was forgotten while resolving its ranks",
                self.bootstrap_addr
            ));
        };
        let mut infos = Vec::new();
        for &tp in &m.target_tp_ranks {
            for &pp in m.target_pp_ranks.iter().rev() {
                let url = format!(
                    "http://{}/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}",
                    self.bootstrap_addr
                );
                let rank: PrefillRankInfo = match self.get_json(&url) {
                    Fetch::Ready(r) => r,
                    Fetch::Retry(r) | Fetch::Fatal(r) => {
                        return Err(format!(
                            "Could not fetch bootstrap info for: prefill_dp_rank: {dp} prefill_cp_rank: {cp} \
                             target_tp_rank: {tp} and target_pp_rank {pp}: {r}"
                        ));
                    }
                };
                // A kvbridge prefill says whether its CP ranks share the
                // transfer: pulling from CP rank 0 alone would then take a
                // room with part of its KV.
                if rank.all_cp_ranks_transfer == Some(true) && m.target_cp_ranks.len() == 1 {
                    return Err(format!(
                        "the prefill's {cp_size} CP ranks each send a share of every room \
                         (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER on the prefill), but this \
                         decode pulls from CP rank 0 only: set the variable on the decode too"
                    ));
                }
                let is_dummy = self.shared.kv_args.layout.is_mla_backend
                    && !(m.target_tp_rank.is_none() || m.target_tp_rank == Some(tp));
                let unique_rank = tp
                    .checked_mul(pp_size.saturating_mul(cp_size))
                    .and_then(|r| r.checked_add(pp.checked_mul(cp_size)?))
                    .and_then(|r| r.checked_add(cp))
                    .ok_or_else(|| {
                        format!("prefill rank numbers overflow (tp {tp}, pp {pp}, cp {cp})")
                    })?;
                infos.push(BootstrapInfo {
                    rank_ip: rank.rank_ip,
                    rank_port: rank.rank_port,
                    pp_rank: pp,
                    is_dummy,
                    unique_rank,
                    engine_session: rank.engine_session,
                });
            }
        }
        let registration = self.shared.kv_args.registration(
            &self.shared.config.local_ip,
            self.shared.rank_port,
            self.shared.engine.session_id(),
            self.shared.engine.incarnation(),
        );
        let mut registration = registration;
        // The ring is offered only once our head counts are known: a
        // prefill told of it stages, and a room here could not scatter.
        if let Some(staging) = &self.shared.staging
            && staging.layout("registration").is_some()
        {
            let (base, size) = staging.region();
            registration.staging_base_ptr = base;
            registration.staging_total_size = size;
        }
        for info in &infos {
            // Each prefill rank gets its own pair key (secret mode).
            let endpoint = info.endpoint();
            registration.pair_key = self.shared.pair_key(&endpoint);
            let frames = registration.encode();
            if let Err(e) = self
                .shared
                .push
                .send(&endpoint, frames.iter().map(|f| f.as_ref()))
            {
                return Err(format!(
                    "_register_kv_args to prefill {}:{} failed: {e}",
                    info.rank_ip, info.rank_port
                ));
            }
        }
        let mut prefills = self.shared.prefills.lock();
        Ok(prefills.pool.entry(key).or_insert(infos).clone())
    }

    pub(super) fn invalidate_cache(&self) {
        let prefix = format!("{}_", self.bootstrap_addr);
        self.shared
            .prefills
            .lock()
            .pool
            .retain(|k, _| !k.starts_with(&prefix));
    }

    /// The room's state; a room waiting for its KV past the waiting timeout fails.
    pub fn poll(&mut self) -> KvPoll {
        if let Some(state) = self.conclude_state {
            return state;
        }
        let status = match self.shared.step(Input::Poll { room: self.room }) {
            Output::State(Some(state)) => state,
            _ => KvPoll::Failed,
        };
        if status.is_terminal() {
            stage::mark(self.room, Stage::Seen);
            self.conclude_state = Some(status);
            if status == KvPoll::Failed {
                self.stop_writers();
            }
            return status;
        }
        if status == KvPoll::WaitingForInput
            && self
                .init_time
                .is_some_and(|t| t.elapsed() >= self.shared.config.waiting_timeout)
        {
            let waited = self.init_time.map_or(0.0, |t| t.elapsed().as_secs_f64());
            return self.fail(format!(
                "Request {} timed out after {waited:.1}s in KVPoll.WaitingForInput",
                self.room
            ));
        }
        status
    }

    /// Whether the room's prefill ranks were told to stop writing (ABORT
    /// sent, by [`KvReceiver::abort`], a failure, or
    /// [`KvReceiver::notify_abort`]).
    pub fn abort_notified(&self) -> bool {
        self.infos.is_some()
            && self.shared.step(Input::AbortSent { room: self.room }) == Output::Flag(true)
    }

    /// Tells the room's prefill ranks to stop writing its pages (once),
    /// whatever the room's state (sglang's `ensure_abort_notified`): for a
    /// failure this side did not start, so sibling ranks still writing are
    /// stopped and acknowledge before the pages are reused.
    pub fn notify_abort(&mut self) {
        self.stop_writers();
    }

    /// Aborts the room: marks it Failed here and tells every prefill rank,
    /// which acknowledges once its in-flight writes to the room drained.
    pub fn abort(&mut self) {
        self.shared.step(Input::Fail {
            room: self.room,
            reason: "Aborted by AbortReq.".into(),
        });
        self.conclude_state = Some(KvPoll::Failed);
        self.stop_writers();
    }

    /// Whether every prefill rank that could write this room's pages has
    /// acknowledged the abort, sent by [`KvReceiver::abort`] or when the
    /// room failed: only then may the pages be reused. True when no
    /// prefill rank was ever told about the room. Nothing else counts as
    /// drained (not a lost bootstrap server, not a timeout), except a
    /// fence: past `abort_ack_timeout`, each silent rank whose engine
    /// session is known is fenced by our engine (no write of it can land
    /// any more) and counts as drained; a rank that cannot be fenced keeps
    /// the pages pinned, reported once.
    pub fn abort_acknowledged(&self) -> bool {
        // Our own scatter into the pages counts as a write in flight.
        if super::staging::scattering(&self.shared, self.room) {
            return false;
        }
        let Some(needed) = self.infos.as_ref().map(Vec::len) else {
            return true;
        };
        let silent = match self.shared.step(Input::Drain {
            room: self.room,
            needed,
            ack_timeout: self.shared.config.abort_ack_timeout,
            now: Instant::now(),
        }) {
            Output::Drain(Drain::Drained) => return true,
            Output::Drain(Drain::Overdue(silent)) => silent,
            _ => return false,
        };
        let mut fenced = Vec::new();
        let mut unfenced = Vec::new();
        for (rank, session) in silent {
            let done = match &session {
                Some(s) => match self.shared.engine.fence_peer(s) {
                    Ok(done) => done,
                    Err(e) => {
                        tracing::warn!(room = self.room, rank, session = %s, error = %e, "cannot fence a silent prefill rank");
                        false
                    }
                },
                None => false,
            };
            match session {
                Some(s) if done => {
                    self.shared.metrics.failure("abort_fenced");
                    tracing::warn!(
                        room = self.room,
                        rank,
                        session = %s,
                        "prefill rank did not acknowledge the abort in time; its engine session is \
                         fenced until it does, so no late write can land"
                    );
                    let endpoint = self
                        .infos
                        .iter()
                        .flatten()
                        .find(|i| i.unique_rank == rank)
                        .map(BootstrapInfo::endpoint);
                    fenced.push((rank, s, endpoint));
                }
                _ => unfenced.push(rank),
            }
        }
        if !unfenced.is_empty() {
            self.shared.metrics.failure("abort_ack_overdue");
            tracing::error!(
                room = self.room,
                ranks = ?unfenced,
                "prefill ranks have not acknowledged the abort and cannot be fenced; the room's \
                 pages stay pinned until they do (a write could still land)"
            );
        }
        self.shared.step(Input::Fenced {
            room: self.room,
            needed,
            fenced,
        }) == Output::Flag(true)
    }

    /// Clears the room and returns its failure: the recorded reason, or a
    /// generic one marked as coming from another rank.
    pub fn failure_exception(&mut self) -> KvTransferError {
        self.conclude_state = Some(KvPoll::Failed);
        let reason = self.take_reason();
        self.clear();
        KvTransferError::from_recorded(self.room, reason)
    }

    /// The room's failure (recorded reason, or a generic one from another
    /// rank), leaving the room known until [`KvReceiver::clear`]: its abort
    /// ACKs still count for [`KvReceiver::abort_acknowledged`], as sglang's
    /// scheduler asks after `failure_exception` while it holds the pages.
    pub fn take_failure(&mut self) -> KvTransferError {
        self.conclude_state = Some(KvPoll::Failed);
        let reason = self.take_reason();
        KvTransferError::from_recorded(self.room, reason)
    }

    fn take_reason(&self) -> Option<String> {
        match self.shared.step(Input::TakeFailure { room: self.room }) {
            Output::Reason(reason) => reason,
            _ => None,
        }
    }

    /// Forgets the room.
    pub fn clear(&mut self) {
        self.shared.step(Input::Clear { room: self.room });
        super::staging::release_room(&self.shared, self.room);
    }
}
