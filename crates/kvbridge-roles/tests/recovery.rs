//! A session that fails is blacklisted, fails later rooms fast, and is
//! lifted by the probe loop once it answers again; aux over zmq; metrics.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use kvbridge_engine::{
    Batch, BatchHandle, MemError, Region, Target, TransferEngine, TransferError,
};
use kvbridge_roles::KvPoll;
use kvbridge_roles::synthetic::{RankPools, RankSpec};

/// A real engine whose transfers and probes fail while `down` is set.
#[derive(Debug)]
struct Flaky {
    inner: Arc<dyn TransferEngine>,
    down: Arc<AtomicBool>,
}

impl TransferEngine for Flaky {
    fn session_id(&self) -> &str {
        self.inner.session_id()
    }
    unsafe fn batch_register(&self, regions: &[(u64, u64)]) -> Result<(), MemError> {
        // SAFETY: forwarded under the caller's own guarantee.
        unsafe { self.inner.batch_register(regions) }
    }
    fn batch_deregister(&self, addrs: &[u64]) -> Result<(), MemError> {
        self.inner.batch_deregister(addrs)
    }
    fn submit(&self, target: Target<'_>, batch: Batch<'_>) -> BatchHandle {
        if self.down.load(Ordering::SeqCst) {
            // Fail through the real engine: a session nobody listens on.
            let first = match batch {
                Batch::Blocks(b) => Batch::Blocks(&b[..b.len().min(1)]),
                Batch::Runs(r) => Batch::Runs(&r[..r.len().min(1)]),
            };
            return self.inner.submit(Target::any("127.0.0.1:1"), first);
        }
        self.inner.submit(target, batch)
    }
    fn probe(&self, session: &str) -> Result<(), TransferError> {
        if self.down.load(Ordering::SeqCst) {
            self.inner.probe("127.0.0.1:1")
        } else {
            self.inner.probe(session)
        }
    }
    fn registered_regions(&self) -> Vec<Region> {
        self.inner.registered_regions()
    }
    fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.inner.read_local(addr, out)
    }
    fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        self.inner.write_local(addr, data)
    }
}

const T: Duration = Duration::from_secs(20);
const RANK: RankSpec = RankSpec::SINGLE;

fn room(
    prefill: &kvbridge_roles::PrefillManager,
    pools: &mut RankPools,
    decode: &kvbridge_roles::DecodeManager,
    addr: &str,
    room: u64,
) -> (KvPoll, KvPoll) {
    let mut rx = decode.receiver(addr, room);
    rx.init(0);
    rx.send_metadata(&[1, 2], 0, &[], None);
    pools.fill(room, &[3, 4], 0);
    let mut tx = prefill.sender(room);
    tx.init(2, Some(0));
    wait_for(T, KvPoll::WaitingForInput, || tx.poll());
    tx.send(&[3, 4], None, None).unwrap();
    let p = wait_terminal(T, || tx.poll());
    let d = wait_terminal(T, || rx.poll());
    tx.clear();
    rx.clear();
    (p, d)
}

#[test]
fn probe_lifts_the_blacklist_when_the_session_answers_again() {
    let bs = bootstrap();
    let addr = bs.local_addr().to_string();
    let model = tiny_model(false, 2);
    let mut ppools = RankPools::new(model.clone(), RANK, 8, 2).unwrap();
    let dpools = RankPools::new(model, RANK, 8, 2).unwrap();
    let down = Arc::new(AtomicBool::new(false));
    let engine = Arc::new(Flaky {
        inner: tcp_engine(),
        down: down.clone(),
    });
    let mut config = prefill_config(bs.local_addr(), 1, 0);
    config.probe.interval = Duration::from_millis(100);
    config.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let prefill = start_prefill(config, ppools.kv_args(), engine);
    let decode = start_decode(decode_config(1), dpools.kv_args(), tcp_engine());
    assert_eq!(
        room(&prefill, &mut ppools, &decode, &addr, 1),
        (KvPoll::Success, KvPoll::Success)
    );
    down.store(true, Ordering::SeqCst);
    assert_eq!(
        room(&prefill, &mut ppools, &decode, &addr, 2),
        (KvPoll::Failed, KvPoll::Failed)
    );
    assert!(prefill.is_blacklisted(decode.session_id()));
    // While blacklisted, rooms fail fast without touching the engine.
    let (p, _) = room(&prefill, &mut ppools, &decode, &addr, 3);
    assert_eq!(p, KvPoll::Failed);
    assert!(prefill.metrics().failures_for("session_blacklisted") >= 1);
    down.store(false, Ordering::SeqCst);
    let deadline = std::time::Instant::now() + T;
    while prefill.is_blacklisted(decode.session_id()) {
        assert!(
            std::time::Instant::now() < deadline,
            "probe never recovered the session"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(prefill.metrics().session_recoveries.get(), 1);
    assert_eq!(
        room(&prefill, &mut ppools, &decode, &addr, 4),
        (KvPoll::Success, KvPoll::Success)
    );
    // The metrics endpoint serves sglang's counter.
    let metrics_addr = prefill.metrics_addr().unwrap();
    let body = ureq_get(&format!("http://{metrics_addr}/metrics"));
    assert!(
        body.contains("sglang:failed_session_recoveries_total 1"),
        "{body}"
    );
    assert!(body.contains("kvbridge_transfer_bytes_total"), "{body}");
    prefill.teardown();
    decode.teardown();
}

fn ureq_get(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_once('/').unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn aux_over_zmq_arrives_before_the_status() {
    let bs = bootstrap();
    let addr = bs.local_addr().to_string();
    let model = tiny_model(true, 2);
    let mut ppools = RankPools::new(model.clone(), RANK, 8, 4).unwrap();
    let dpools = RankPools::new(model, RANK, 8, 4).unwrap();
    let mut config = prefill_config(bs.local_addr(), 1, 0);
    config.send_aux_tcp = true;
    let prefill = start_prefill(config, ppools.kv_args(), tcp_engine());
    let decode = start_decode(decode_config(1), dpools.kv_args(), tcp_engine());
    for r in 0..5u64 {
        let mut rx = decode.receiver(&addr, r);
        rx.init(0);
        rx.send_metadata(&[r as i32], 3, &[], None);
        ppools.fill(r, &[5], 1);
        let mut tx = prefill.sender(r);
        tx.init(1, Some(1));
        wait_for(T, KvPoll::WaitingForInput, || tx.poll());
        tx.send(&[5], None, None).unwrap();
        assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Success);
        // Success is only seen after the AUX_DATA frames before it were applied.
        assert_eq!(dpools.verify(r, &[r as i32], 3).mismatched, 0);
        tx.clear();
        rx.clear();
    }
    prefill.teardown();
    decode.teardown();
}

/// A decode rank that registers again with the same buffers from the same
/// engine incarnation (it dropped its cache of the prefill's address, as
/// when the prefill's bootstrap server missed heartbeats) has not
/// restarted: its room in flight still completes, byte-exact.
#[test]
fn an_unchanged_re_registration_keeps_rooms_in_flight() {
    let mut c = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    let addr = c.bootstrap.local_addr().to_string();
    let (decode, dpools) = &c.decode[0];
    let mut rx = decode.receiver(&addr, 5);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[7, 8], 1, &[], None);
    let (prefill, ppools) = &mut c.prefill[0];
    ppools.fill(5, &[1, 2], 1);
    let mut tx = prefill.sender(5);
    tx.init(2, Some(1));
    assert_eq!(
        wait_for(Duration::from_secs(10), KvPoll::WaitingForInput, || tx
            .poll()),
        KvPoll::WaitingForInput
    );
    // The same registration again, as the decode would send it.
    let again = dpools.kv_args().registration(
        "127.0.0.1",
        decode.rank_port(),
        decode.session_id(),
        decode.engine_incarnation(),
    );
    let (_ctx, sock) = rogue_socket(prefill.rank_port());
    sock.send_multipart(again.encode().iter().map(|f| f.as_ref()), 0)
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    tx.send(&[1, 2], None, None).unwrap();
    assert_eq!(
        wait_terminal(Duration::from_secs(10), || tx.poll()),
        KvPoll::Success
    );
    assert_eq!(
        wait_terminal(Duration::from_secs(10), || rx.poll()),
        KvPoll::Success
    );
    assert_eq!(dpools.verify(5, &[7, 8], 1).mismatched, 0);
    c.shutdown();
}
