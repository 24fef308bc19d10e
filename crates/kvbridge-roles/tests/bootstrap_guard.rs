//! The bootstrap server's trust boundary: signed writes in secret mode,
//! range checks, no silent replacement of a live prefill, body limits, and
//! the prefill's signing registration client.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use kvbridge_engine::ClusterSecret;
use kvbridge_roles::bootstrap::auth::{WriteAuth, unix_now};
use kvbridge_roles::bootstrap::client::{Refresh, refresh_registration, register_with_bootstrap};
use kvbridge_roles::bootstrap::{
    BootstrapConfig, BootstrapLimits, BootstrapServer, DEFAULT_MAX_BODY_BYTES,
};
use kvbridge_roles::{ParallelRank, PrefillConfig, StartError};
use serde_json::{Value, json};

const INFO: &str =
    "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::from_text(text, "test").unwrap()
}

fn server(secret: Option<ClusterSecret>) -> BootstrapServer {
    let config = BootstrapConfig {
        secret,
        ..BootstrapConfig::default()
    };
    BootstrapServer::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap()
}

/// A one-rank (tp 1) registration at `port`.
fn reg(port: u16) -> Value {
    json!({
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
        "rank_port": port, "page_size": 16, "kv_cache_dtype": "auto"
    })
}

/// `(status, body)` of one request; `headers` are added as given.
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    headers: &[(&str, String)],
) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .into();
    let url = format!("http://{addr}{path}");
    let mut resp = match method {
        "GET" => {
            let mut r = agent.get(&url);
            for (k, v) in headers {
                r = r.header(*k, v);
            }
            r.call().unwrap()
        }
        _ => {
            let mut r = if method == "PUT" {
                agent.put(&url)
            } else {
                agent.post(&url)
            };
            for (k, v) in headers {
                r = r.header(*k, v);
            }
            r.send(body).unwrap()
        }
    };
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap_or_default())
}

/// Headers signing `body` for `method path` to `bs` with `auth` at `time`.
fn signed(
    bs: &BootstrapServer,
    auth: &WriteAuth,
    method: &str,
    path: &str,
    body: &[u8],
    time: u64,
) -> Vec<(&'static str, String)> {
    let nonce = format!("{:032x}", rand::random::<u128>());
    let h = auth.sign_at(bs.instance_id(), method, path, time, &nonce, body);
    h.pairs()
        .iter()
        .map(|(k, v)| (*k, (*v).to_owned()))
        .collect()
}

fn route_of(addr: SocketAddr) -> (u16, String) {
    call(
        addr,
        "GET",
        "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
        b"",
        &[],
    )
}

#[test]
fn secret_mode_refuses_unsigned_stale_forged_and_replayed_writes() {
    let key = secret("bootstrap-guard-secret-1");
    let bs = server(Some(key.clone()));
    let addr = bs.local_addr();
    let auth = WriteAuth::new(&key);
    let forger = WriteAuth::new(&secret("bootstrap-guard-other-secret"));
    let body = serde_json::to_vec(&reg(17000)).unwrap();
    let now = unix_now();
    let refused = [
        Vec::new(),
        signed(&bs, &forger, "PUT", "/route", &body, now),
        signed(&bs, &auth, "PUT", "/route", &body, now - 301),
        signed(&bs, &auth, "PUT", "/route", &body, now + 400),
        signed(&bs, &auth, "POST", "/route", &body, now),
        signed(&bs, &auth, "PUT", "/route", b"{}", now),
    ];
    for headers in &refused {
        let (status, text) = call(addr, "PUT", "/route", &body, headers);
        assert_eq!(status, 401, "{text}");
    }
    // Nothing was registered; reads stay open.
    assert!(!bs.is_ready());
    assert_eq!(call(addr, "GET", "/health", b"", &[]).0, 200);
    let (status, text) = call(addr, "GET", INFO, b"", &[]);
    assert_eq!((status, text.contains("0 workers")), (503, true), "{text}");

    let good = signed(&bs, &auth, "PUT", "/route", &body, now);
    assert_eq!(call(addr, "PUT", "/route", &body, &good).0, 200);
    assert!(bs.is_ready());
    // The same signed request again is a replay.
    assert_eq!(call(addr, "PUT", "/route", &body, &good).0, 401);
    assert_eq!(call(addr, "GET", INFO, b"", &[]).0, 200);

    // register_dp_rank is a write too; query_dp_ranks a read.
    let dp = br#"{"bootstrap_room": 42, "dp_rank": 0}"#;
    assert_eq!(call(addr, "POST", "/register_dp_rank", dp, &[]).0, 401);
    let (_, map) = call(
        addr,
        "POST",
        "/query_dp_ranks",
        br#"{"bootstrap_rooms": [42]}"#,
        &[],
    );
    assert_eq!(serde_json::from_str::<Value>(&map).unwrap(), json!({}));
    let h = signed(&bs, &auth, "POST", "/register_dp_rank", dp, now);
    assert_eq!(call(addr, "POST", "/register_dp_rank", dp, &h).0, 200);
    let (_, map) = call(
        addr,
        "POST",
        "/query_dp_ranks",
        br#"{"bootstrap_rooms": [42]}"#,
        &[],
    );
    assert_eq!(
        serde_json::from_str::<Value>(&map).unwrap(),
        json!({"42": 0})
    );
    assert_eq!(bs.stats().unauthorized, refused.len() as u64 + 2);
}

#[test]
fn out_of_range_values_are_refused_without_state_change() {
    let bs = server(None);
    let addr = bs.local_addr();
    let spoiled: Vec<Value> = {
        let spoil = |key: &str, v: Value| {
            let mut r = reg(17000);
            r[key] = v;
            r
        };
        let mut missing = reg(17000);
        missing.as_object_mut().unwrap().remove("pp_size");
        vec![
            missing,
            spoil("attn_tp_size", json!(0)),
            spoil("pp_size", json!(5000)),
            spoil("attn_dp_size", json!(0)),
            spoil("attn_tp_rank", json!(1)),
            spoil("system_dp_rank", json!(3)),
            spoil("rank_port", json!(0)),
            spoil("rank_port", json!(70000)),
            spoil("page_size", json!(0)),
            spoil("rank_ip", json!("")),
            spoil("rank_ip", json!("10.0.0.1:80/x")),
            spoil("attn_tp_size", json!(-1)),
        ]
    };
    for body in &spoiled {
        let (status, text) = call(addr, "PUT", "/route", body.to_string().as_bytes(), &[]);
        assert!(matches!(status, 400 | 422), "{status} {text} for {body}");
        assert!(!text.is_empty());
    }
    let (status, text) = call(addr, "GET", INFO, b"", &[]);
    assert_eq!((status, text.contains("0 workers")), (503, true), "{text}");
    assert_eq!(bs.stats().invalid, spoiled.len() as u64);

    // A topology other than the first registration's is a conflict.
    assert_eq!(
        call(
            addr,
            "PUT",
            "/route",
            reg(17000).to_string().as_bytes(),
            &[]
        )
        .0,
        200
    );
    let mut wider = reg(17001);
    wider["attn_tp_size"] = json!(2);
    wider["attn_tp_rank"] = json!(1);
    let (status, text) = call(addr, "PUT", "/route", wider.to_string().as_bytes(), &[]);
    assert_eq!(status, 409, "{text}");
    assert_eq!(bs.stats().conflicts, 1);

    // A DP rank at or above the server's DP size (1).
    let dp = br#"{"bootstrap_room": 7, "dp_rank": 1}"#;
    assert_eq!(call(addr, "POST", "/register_dp_rank", dp, &[]).0, 422);
    let dp = br#"{"bootstrap_room": 7}"#;
    assert_eq!(call(addr, "POST", "/register_dp_rank", dp, &[]).0, 400);
    let (_, map) = call(
        addr,
        "POST",
        "/query_dp_ranks",
        br#"{"bootstrap_rooms": [7]}"#,
        &[],
    );
    assert_eq!(serde_json::from_str::<Value>(&map).unwrap(), json!({}));
    assert_eq!(bs.stats().invalid, spoiled.len() as u64 + 2);
}

#[test]
fn open_mode_never_replaces_a_live_prefill() {
    let bs = server(None);
    let addr = bs.local_addr();
    let live = TcpListener::bind("127.0.0.1:0").unwrap();
    let old_port = live.local_addr().unwrap().port();
    let put = |port: u16| call(addr, "PUT", "/route", reg(port).to_string().as_bytes(), &[]);
    assert_eq!(put(old_port).0, 200);
    // The same address again is an idempotent re-registration.
    assert_eq!(put(old_port).0, 200);
    let (status, text) = put(old_port.wrapping_add(1).max(1));
    assert_eq!(status, 409, "{text}");
    assert!(text.contains(&old_port.to_string()), "{text}");
    assert!(
        route_of(addr)
            .1
            .contains(&format!("\"rank_port\":{old_port}"))
    );
    assert_eq!((bs.stats().conflicts, bs.stats().replacements), (1, 0));

    // The old prefill is gone (nothing accepts at its address): a restart.
    drop(live);
    let new_port = old_port.wrapping_add(1).max(1);
    assert_eq!(put(new_port).0, 200);
    assert!(
        route_of(addr)
            .1
            .contains(&format!("\"rank_port\":{new_port}"))
    );
    assert_eq!(bs.stats().replacements, 1);
}

#[test]
fn secret_mode_lets_a_signed_restart_replace_the_address() {
    let key = secret("bootstrap-guard-secret-2");
    let bs = server(Some(key.clone()));
    let addr = bs.local_addr();
    let auth = WriteAuth::new(&key);
    let live = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = live.local_addr().unwrap().port();
    for p in [port, port.wrapping_add(1).max(1)] {
        let body = serde_json::to_vec(&reg(p)).unwrap();
        let h = signed(&bs, &auth, "PUT", "/route", &body, unix_now());
        assert_eq!(call(addr, "PUT", "/route", &body, &h).0, 200);
        assert!(route_of(addr).1.contains(&format!("\"rank_port\":{p}")));
    }
    assert_eq!(bs.stats().replacements, 1);
}

#[test]
fn large_and_slow_bodies_are_refused() {
    let config = BootstrapConfig {
        limits: BootstrapLimits {
            body_timeout: Duration::from_millis(300),
            ..BootstrapLimits::default()
        },
        ..BootstrapConfig::default()
    };
    let bs = BootstrapServer::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let addr = bs.local_addr();
    let mut big = reg(17000);
    big["kv_layout"] = json!("x".repeat(DEFAULT_MAX_BODY_BYTES));
    assert_eq!(
        call(addr, "PUT", "/route", big.to_string().as_bytes(), &[]).0,
        413
    );

    let mut slow = TcpStream::connect(addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = Instant::now();
    slow.write_all(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        .unwrap();
    let mut answer = [0u8; 64];
    let n = slow.read(&mut answer).unwrap();
    assert!(
        answer[..n].starts_with(b"HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&answer[..n])
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    let stats = bs.stats();
    assert_eq!((stats.body_too_large, stats.body_timeouts), (1, 1));
    assert!(!bs.is_ready());
}

fn prefill_config(addr: SocketAddr, secret: Option<ClusterSecret>) -> PrefillConfig {
    PrefillConfig {
        bootstrap_addr: addr.to_string(),
        rank: ParallelRank::default(),
        secret,
        ..PrefillConfig::default()
    }
}

#[test]
fn the_prefill_registration_client_signs_in_secret_mode() {
    let key = secret("bootstrap-guard-secret-3");
    let bs = server(Some(key.clone()));
    let stopped = AtomicBool::new(false);
    let started = Instant::now();
    let unsigned = register_with_bootstrap(
        &prefill_config(bs.local_addr(), None),
        16,
        17000,
        "127.0.0.1:17001",
        &stopped,
    );
    assert!(
        matches!(&unsigned, Err(StartError::Bootstrap { reason, .. }) if reason.contains("401")),
        "{unsigned:?}"
    );
    let wrong = Some(secret("bootstrap-guard-wrong-secret"));
    assert!(
        register_with_bootstrap(
            &prefill_config(bs.local_addr(), wrong),
            16,
            17000,
            "127.0.0.1:17001",
            &stopped
        )
        .is_err()
    );
    // A 401 fails at once rather than after the 30 s of retries.
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!bs.is_ready());
    register_with_bootstrap(
        &prefill_config(bs.local_addr(), Some(key)),
        16,
        17000,
        "127.0.0.1:17001",
        &stopped,
    )
    .unwrap();
    assert!(bs.is_ready());

    // Open mode: the same client, unsigned, as sglang's.
    let open = server(None);
    register_with_bootstrap(
        &prefill_config(open.local_addr(), None),
        16,
        17000,
        "127.0.0.1:17001",
        &stopped,
    )
    .unwrap();
    assert!(open.is_ready());
}

/// sglang keeps a rank's IP verbatim, e.g. a link-local IPv6 address with
/// its zone id: the server accepts it over HTTP and answers it unchanged.
#[test]
fn a_zoned_ipv6_rank_ip_is_kept_verbatim() {
    let bs = server(None);
    let addr = bs.local_addr();
    let mut body = reg(17000);
    body["rank_ip"] = json!("fe80::1%eth0");
    let (status, text) = call(
        addr,
        "PUT",
        "/route",
        &serde_json::to_vec(&body).unwrap(),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let (status, text) = route_of(addr);
    assert_eq!(status, 200, "{text}");
    let rank: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(rank["rank_ip"], "fe80::1%eth0", "{text}");
    assert_eq!(rank["rank_port"], 17000);
    bs.shutdown();
}

/// A signed registration of another endpoint replayed into this rank's
/// slot (captured at another bootstrap server of the cluster, or before a
/// restart: this server never saw its nonce) is taken back by the prefill's
/// refresh, which checks that the slot names it rather than trusting any 200.
#[test]
fn the_prefill_refresh_takes_a_replayed_slot_back() {
    let key = secret("bootstrap-guard-secret-4");
    let bs = server(Some(key.clone()));
    let addr = bs.local_addr();
    let config = prefill_config(addr, Some(key.clone()));
    let stopped = AtomicBool::new(false);
    register_with_bootstrap(&config, 16, 17000, "127.0.0.1:17001", &stopped).unwrap();
    assert_eq!(
        refresh_registration(&config, 16, 17000, "127.0.0.1:17001"),
        Ok(Refresh::Present)
    );
    // The replay: another endpoint's signed registration for the same slot.
    let body = serde_json::to_vec(&reg(17500)).unwrap();
    let h = signed(
        &bs,
        &WriteAuth::new(&key),
        "PUT",
        "/route",
        &body,
        unix_now(),
    );
    assert_eq!(call(addr, "PUT", "/route", &body, &h).0, 200);
    assert!(route_of(addr).1.contains("\"rank_port\":17500"));
    assert_eq!(
        refresh_registration(&config, 16, 17000, "127.0.0.1:17001"),
        Ok(Refresh::Reclaimed)
    );
    let (status, route) = route_of(addr);
    assert_eq!(status, 200);
    assert!(route.contains("\"rank_port\":17000"), "{route}");
    // A new incarnation of the same endpoint (another engine session) is
    // not this rank either.
    assert_eq!(
        refresh_registration(&config, 16, 17000, "127.0.0.1:17002"),
        Ok(Refresh::Reclaimed)
    );
    assert_eq!(
        refresh_registration(&config, 16, 17000, "127.0.0.1:17002"),
        Ok(Refresh::Present)
    );
}

/// A signed write names the bootstrap server instance it was made for: a
/// capture replayed to another server of the cluster, or to the same
/// address after a restart, is refused there and changes nothing; the
/// prefill's client learns each server's instance and registers with both.
#[test]
fn a_signed_write_is_refused_by_every_other_server_instance() {
    let key = secret("bootstrap-guard-secret-5");
    let a = server(Some(key.clone()));
    let b = server(Some(key.clone()));
    let body = serde_json::to_vec(&reg(17600)).unwrap();
    let captured = signed(
        &a,
        &WriteAuth::new(&key),
        "PUT",
        "/route",
        &body,
        unix_now(),
    );
    assert_eq!(
        call(a.local_addr(), "PUT", "/route", &body, &captured).0,
        200
    );
    let (status, text) = call(b.local_addr(), "PUT", "/route", &body, &captured);
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("another bootstrap server instance"), "{text}");
    assert_eq!(route_of(b.local_addr()).0, 503, "nothing registered at b");
    // A restart: a new instance on the same address.
    let at = a.local_addr();
    a.shutdown();
    let config = BootstrapConfig {
        secret: Some(key.clone()),
        ..BootstrapConfig::default()
    };
    let restarted = BootstrapServer::start_with(at, config).unwrap();
    assert_eq!(call(at, "PUT", "/route", &body, &captured).0, 401);
    // The honest client signs for whichever instance answers.
    let stopped = AtomicBool::new(false);
    for bs in [&b, &restarted] {
        let config = prefill_config(bs.local_addr(), Some(key.clone()));
        register_with_bootstrap(&config, 16, 17000, "127.0.0.1:17001", &stopped).unwrap();
        assert!(bs.is_ready());
    }
    b.shutdown();
    restarted.shutdown();
}
