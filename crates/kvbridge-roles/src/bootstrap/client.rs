//! kvbridge's own bootstrap client: a prefill rank's `PUT /route`
//! registration (sglang's `register_to_bootstrap`), signed with the cluster
//! secret when the rank has one ([`super::auth`]).

use std::collections::HashMap;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvbridge_wire::bootstrap::{PrefillRankInfo, RouteRegistration};
use parking_lot::Mutex;

use super::auth::{SERVER_HEADER, WriteAuth};
use crate::config::PrefillConfig;
use crate::error::StartError;

/// How long one registration attempt may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long registration is retried before start-up fails.
const REGISTRATION_DEADLINE: Duration = Duration::from_secs(30);

/// The `PUT /route` body of a prefill rank, as sglang's prefill sends it,
/// plus (a kvbridge extension) the rank's engine session when it is a
/// `host:port`, so decodes can fence the rank's writes.
pub fn registration(
    config: &PrefillConfig,
    page_size: u64,
    rank_port: u16,
    engine_session: &str,
) -> RouteRegistration {
    let r = &config.rank;
    RouteRegistration {
        attn_tp_size: r.attn_tp_size,
        attn_tp_rank: r.attn_tp_rank,
        attn_cp_size: r.attn_cp_size,
        attn_cp_rank: r.attn_cp_rank,
        attn_dp_size: r.attn_dp_size,
        attn_dp_rank: r.attn_dp_rank,
        pp_size: r.pp_size,
        pp_rank: r.pp_rank,
        system_dp_size: r.system_dp_size,
        system_dp_rank: r.system_dp_rank,
        rank_ip: config.local_ip.clone(),
        rank_port,
        page_size,
        kv_cache_dtype: Some(config.kv_cache_dtype.clone()),
        kv_layout: config.kv_layout.clone(),
        dsv41_spec_layout: None,
        load_balance_method: Some(config.load_balance_method.clone()),
        enable_dsa_cache_layer_split: Some(false),
        enable_kv_cache_sharding: Some(false),
        prefill_http_port: None,
        decode_allocation_policy: Some("early".into()),
        engine_session: kvbridge_wire::bootstrap::is_session_id(engine_session)
            .then(|| engine_session.to_owned()),
        all_cp_ranks_transfer: (r.attn_cp_size > 1).then_some(config.all_cp_ranks),
    }
}

/// `PUT /route` with retries and backoff, as sglang's
/// `register_to_bootstrap`; every attempt is signed afresh when
/// `config.secret` is set. A 400, 401, 413 or 422 answer fails at once
/// (the same request cannot succeed later); other failures are retried for
/// 30 s or until `stopped` is set.
pub fn register_with_bootstrap(
    config: &PrefillConfig,
    page_size: u64,
    rank_port: u16,
    engine_session: &str,
    stopped: &AtomicBool,
) -> Result<(), StartError> {
    let fail = |reason: String| StartError::Bootstrap {
        addr: config.bootstrap_addr.clone(),
        reason,
    };
    check_addr(&config.bootstrap_addr).map_err(fail)?;
    let body = serde_json::to_vec(&registration(config, page_size, rank_port, engine_session))
        .map_err(|e| fail(format!("cannot encode the registration: {e}")))?;
    let url = format!("http://{}/route", config.bootstrap_addr);
    let agent = crate::http::agent(ATTEMPT_TIMEOUT);
    let mut delay = Duration::from_millis(200);
    let deadline = Instant::now() + REGISTRATION_DEADLINE;
    loop {
        // Every attempt signs for the instance that answers now.
        let attempt = signer(config, &agent, true).and_then(|auth| {
            let request = agent.put(&url).content_type("application/json");
            signed(request, auth.as_ref(), "PUT", "/route", &body)
                .send(&body[..])
                .map_err(|e| e.to_string())
        });
        let reason = match attempt {
            Ok(resp) if resp.status() == 200 => return Ok(()),
            Ok(resp) => {
                let (status, text) = refusal(resp);
                let reason = format!("status {status}: {text}");
                if matches!(status, 400 | 401 | 413 | 422) {
                    return Err(fail(reason));
                }
                reason
            }
            Err(e) => e,
        };
        if Instant::now() + delay > deadline || stopped.load(Ordering::SeqCst) {
            return Err(fail(reason));
        }
        tracing::warn!(url, reason, "bootstrap registration failed; retrying");
        std::thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// What [`refresh_registration`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    /// The server still holds this rank's entry.
    Present,
    /// The entry was gone (a restarted server) and is registered again.
    Registered,
    /// The slot named another rank (a replayed or stale registration) and
    /// this rank took it back.
    Reclaimed,
}

/// Checks that the bootstrap server still knows this rank (`GET /route`
/// for its DP, CP, TP and PP rank answers 200) and registers it again when
/// it does not (any other answer),
/// as after a bootstrap server restart: one attempt of each, at most 5 s.
pub fn refresh_registration(
    config: &PrefillConfig,
    page_size: u64,
    rank_port: u16,
    engine_session: &str,
) -> Result<Refresh, String> {
    let r = &config.rank;
    let url = format!(
        "http://{}/route?prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}",
        config.bootstrap_addr, r.attn_dp_rank, r.attn_cp_rank, r.attn_tp_rank, r.pp_rank
    );
    let agent = crate::http::agent(ATTEMPT_TIMEOUT);
    let ours = registration(config, page_size, rank_port, engine_session);
    let mut reclaim = false;
    let answer = agent.get(&url).call();
    if let Ok(resp) = &answer {
        learn_server_id(&config.bootstrap_addr, resp);
    }
    match answer {
        Ok(mut resp) if resp.status() == 200 => {
            // A 200 is ours only if the slot names this rank: a replayed
            // or stale registration of another endpoint is taken back.
            let held = resp
                .body_mut()
                .with_config()
                .limit(ROUTE_ANSWER_LIMIT)
                .read_to_vec()
                .ok()
                .and_then(|b| serde_json::from_slice::<PrefillRankInfo>(&b).ok());
            match held {
                Some(h) if names_rank(&h, &ours) => return Ok(Refresh::Present),
                Some(h) => {
                    tracing::warn!(
                        slot = %format_args!("{}:{}", h.rank_ip, h.rank_port),
                        held_session = h.engine_session.as_deref().unwrap_or("-"),
                        ours = %format_args!("{}:{}", ours.rank_ip, ours.rank_port),
                        "the bootstrap server's slot for this rank names another endpoint; registering again"
                    );
                }
                None => tracing::warn!(
                    %url,
                    "the bootstrap server answered this rank's slot with no rank info; registering again"
                ),
            }
            reclaim = true;
        }
        // Not found, or not ready (a restarted server has nobody yet).
        Ok(_) => {}
        Err(e) => return Err(format!("{url}: {e}")),
    }
    let body =
        serde_json::to_vec(&ours).map_err(|e| format!("cannot encode the registration: {e}"))?;
    let put = format!("http://{}/route", config.bootstrap_addr);
    let auth = signer(config, &agent, false)?;
    let request = agent.put(&put).content_type("application/json");
    let request = signed(request, auth.as_ref(), "PUT", "/route", &body);
    match request.send(&body[..]) {
        Ok(resp) if resp.status() == 200 && reclaim => Ok(Refresh::Reclaimed),
        Ok(resp) if resp.status() == 200 => Ok(Refresh::Registered),
        Ok(resp) => {
            let (status, text) = refusal(resp);
            Err(format!("{put} answered {status}: {text}"))
        }
        Err(e) => Err(format!("{put}: {e}")),
    }
}

/// The most of a `GET /route` answer for one rank that is read.
const ROUTE_ANSWER_LIMIT: u64 = 64 * 1024;

/// Whether a slot's answer names the rank `ours` registers: its endpoint,
/// and its engine session when both published one.
fn names_rank(held: &PrefillRankInfo, ours: &RouteRegistration) -> bool {
    held.rank_ip == ours.rank_ip
        && held.rank_port == ours.rank_port
        && match (&held.engine_session, &ours.engine_session) {
            (Some(h), Some(o)) => h == o,
            _ => true,
        }
}

/// `POST /register_dp_rank`: tells the bootstrap server that this prefill's
/// DP rank `dp_rank` serves `room`, for decodes that cannot compute it
/// (routing that does not follow the bootstrap room). One attempt of at
/// most 5 s, signed when `config.secret` is set; as in sglang, a failure is
/// the caller's to log (the room's decode then cannot find it and times out).
pub fn register_dp_rank(config: &PrefillConfig, room: u64, dp_rank: u64) -> Result<(), String> {
    let body = serde_json::to_vec(&kvbridge_wire::bootstrap::RegisterDpRank {
        bootstrap_room: room,
        dp_rank,
    })
    .map_err(|e| format!("cannot encode the DP registration: {e}"))?;
    let url = format!("http://{}/register_dp_rank", config.bootstrap_addr);
    let agent = crate::http::agent(ATTEMPT_TIMEOUT);
    // The remembered instance id first; once more with the current one if
    // the server restarted since (it refuses the old id).
    let mut fresh = false;
    loop {
        let auth = signer(config, &agent, fresh)?;
        let request = agent.post(&url).content_type("application/json");
        let request = signed(request, auth.as_ref(), "POST", "/register_dp_rank", &body);
        match request.send(&body[..]) {
            Ok(resp) if resp.status() == 200 => return Ok(()),
            Ok(resp) => {
                let (status, text) = refusal(resp);
                if status == 401 && !fresh && auth.is_some() {
                    fresh = true;
                    continue;
                }
                return Err(format!("{url} answered {status}: {text}"));
            }
            Err(e) => return Err(format!("{url}: {e}")),
        }
    }
}

/// How long [`wait_until_reachable`] tries by default: as long as a
/// prefill retries its registration.
pub const REACHABLE_DEADLINE: Duration = REGISTRATION_DEADLINE;

/// Checks that `addr` is a `host:port` (an IPv6 host in brackets) with a
/// port from 1 to 65535; the reason names what is wrong.
pub fn check_addr(addr: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "bootstrap address {addr:?} {why} (expected host:port)"
        ))
    };
    let Some((host, port)) = addr.rsplit_once(':') else {
        return bad("has no port");
    };
    let host_ok = if let Some(inner) = host.strip_prefix('[') {
        inner
            .strip_suffix(']')
            .is_some_and(|h| h.parse::<std::net::Ipv6Addr>().is_ok())
    } else {
        !host.is_empty() && !host.contains(['/', '@', '?', '#', ' ', '[', ']', ':'])
    };
    if !host_ok {
        return bad("has no valid host");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && !port.starts_with('+') => Ok(()),
        _ => bad("has no valid port"),
    }
}

/// Waits until the bootstrap server at `addr` answers `GET /health` with
/// 200, retrying for at most `within`; the error says why it gave up
/// (malformed address, refused, timed out, a non-200 answer).
pub fn wait_until_reachable(addr: &str, within: Duration) -> Result<(), String> {
    check_addr(addr)?;
    let url = format!("http://{addr}/health");
    let deadline = Instant::now() + within;
    let mut delay = Duration::from_millis(100);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let agent = crate::http::agent(ATTEMPT_TIMEOUT.min(left.max(Duration::from_millis(100))));
        let reason = match agent.get(&url).call() {
            Ok(resp) if resp.status() == 200 => return Ok(()),
            Ok(resp) => {
                let (status, text) = refusal(resp);
                format!("answered {status}: {text}")
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() + delay >= deadline {
            return Err(format!(
                "bootstrap server {addr} not reachable within {} s: {reason}",
                within.as_secs_f64()
            ));
        }
        tracing::debug!(url, reason, "bootstrap server not reachable yet; retrying");
        std::thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_secs(2));
    }
}

/// A request body's builder.
type WithBody = ureq::RequestBuilder<ureq::typestate::WithBody>;

/// The instance id each bootstrap server (by address) last announced.
static SERVER_IDS: LazyLock<Mutex<HashMap<String, String>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Remembers the instance id `resp` announces for the server at `addr`.
fn learn_server_id<B>(addr: &str, resp: &ureq::http::Response<B>) -> Option<String> {
    let id = resp.headers().get(SERVER_HEADER)?.to_str().ok()?.to_owned();
    SERVER_IDS.lock().insert(addr.to_owned(), id.clone());
    Some(id)
}

/// The instance id of the bootstrap server at `addr` (what a signed write
/// must name): remembered, or asked for (`GET /health`) when unknown or
/// `fresh` (a restarted server has a new one).
fn server_id(agent: &ureq::Agent, addr: &str, fresh: bool) -> Result<String, String> {
    if !fresh && let Some(id) = SERVER_IDS.lock().get(addr) {
        return Ok(id.clone());
    }
    let url = format!("http://{addr}/health");
    let resp = agent.get(&url).call().map_err(|e| format!("{url}: {e}"))?;
    learn_server_id(addr, &resp).ok_or_else(|| {
        format!("{url} names no bootstrap server instance (not a kvbridge bootstrap server in secret mode?)")
    })
}

/// `request` with the cluster secret's signature of `method path body`
/// for the server instance `server` in its headers, when there is a
/// secret; unchanged otherwise.
fn signed(
    mut request: WithBody,
    auth: Option<&(WriteAuth, String)>,
    method: &str,
    path: &str,
    body: &[u8],
) -> WithBody {
    if let Some((auth, server)) = auth {
        for (name, value) in auth.sign(server, method, path, body).pairs() {
            request = request.header(name, value);
        }
    }
    request
}

/// The signer for a write to `addr`, with the server's instance id, when
/// there is a secret.
fn signer(
    config: &PrefillConfig,
    agent: &ureq::Agent,
    fresh: bool,
) -> Result<Option<(WriteAuth, String)>, String> {
    let Some(secret) = &config.secret else {
        return Ok(None);
    };
    let id = server_id(agent, &config.bootstrap_addr, fresh)?;
    Ok(Some((WriteAuth::new(secret), id)))
}

/// The status and (first 4 KiB of the) text of a refused request.
fn refusal(mut resp: ureq::http::Response<ureq::Body>) -> (u16, String) {
    let status = resp.status().as_u16();
    let text = resp
        .body_mut()
        .with_config()
        .limit(4096)
        .read_to_string()
        .unwrap_or_default();
    (status, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_addresses_are_host_and_port() {
        for ok in [
            "127.0.0.1:8998",
            "localhost:1",
            "[::1]:65535",
            "prefill-0.svc:80",
        ] {
            assert_eq!(check_addr(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "8998",
            "host:",
            ":80",
            "host:0",
            "host:65536",
            "host:+80",
            "host:x",
            "http://h:80",
            "h/x:80",
            "::1:80",
            "[::1:80",
            "[zz]:80",
        ] {
            assert!(check_addr(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn an_unreachable_bootstrap_fails_within_the_stated_time() {
        // A port nothing listens on: bind, note it, close.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(9);
        let start = Instant::now();
        let err = wait_until_reachable(&format!("127.0.0.1:{port}"), Duration::from_secs(1))
            .expect_err("nothing listens there");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert!(err.contains("not reachable within 1 s"), "{err}");
        assert!(wait_until_reachable("nonsense", Duration::from_secs(1)).is_err());
    }
}
