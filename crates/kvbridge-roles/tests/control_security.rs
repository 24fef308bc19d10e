//! The control plane in secret mode: only cluster members' messages reach
//! an inbox (zmq CURVE with keys derived from the secret, plus the ZAP
//! check of the client key); open mode stays plain zmq, as sglang speaks it.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvbridge_engine::ClusterSecret;
use kvbridge_roles::control::{
    ControlContext, ControlSecurity, DEFAULT_MAX_MESSAGE_BYTES, PullSocket, PushPool,
};

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::from_text(text, "test").unwrap()
}

fn inbox(security: ControlSecurity) -> (ControlContext, PullSocket) {
    let ctx = ControlContext::new(security).unwrap();
    let pull = PullSocket::bind(&ctx, "127.0.0.1", 0, DEFAULT_MAX_MESSAGE_BYTES).unwrap();
    (ctx, pull)
}

fn endpoint(pull: &PullSocket) -> String {
    format!("tcp://127.0.0.1:{}", pull.port())
}

/// Receives for up to `wait`, returning what arrived.
fn receive(pull: &PullSocket, wait: Duration) -> Option<Vec<Vec<u8>>> {
    pull.recv_timeout(wait).unwrap()
}

#[test]
fn members_with_the_secret_talk() {
    let s = secret("a-cluster-secret-of-some-length");
    let (_ctx, pull) = inbox(ControlSecurity::from_secret(Some(&s)));
    let sender_ctx = ControlContext::new(ControlSecurity::from_secret(Some(&s))).unwrap();
    let push = PushPool::new(&sender_ctx, Duration::from_secs(2));
    push.send(&endpoint(&pull), [&b"room"[..], b"42"]).unwrap();
    let got = receive(&pull, Duration::from_secs(10)).expect("member's message arrives");
    assert_eq!(got, vec![b"room".to_vec(), b"42".to_vec()]);
    push.close_all();
}

#[test]
fn strangers_reach_no_inbox() {
    let s = secret("a-cluster-secret-of-some-length");
    let (ctx, pull) = inbox(ControlSecurity::from_secret(Some(&s)));
    let to = endpoint(&pull);

    // No secret at all (what a stock zmq peer speaks).
    let open_ctx = ControlContext::new(ControlSecurity::open()).unwrap();
    let open = PushPool::new(&open_ctx, Duration::from_millis(200));
    let _ = open.send(&to, [&b"forged"[..]]);
    // Another secret: another server key, the handshake cannot complete.
    let other_ctx = ControlContext::new(ControlSecurity::from_secret(Some(&secret(
        "not-the-cluster-secret",
    ))))
    .unwrap();
    let other = PushPool::new(&other_ctx, Duration::from_millis(200));
    let _ = other.send(&to, [&b"forged"[..]]);
    // The right server key (it is public) but a key pair of its own: the
    // ZAP handler refuses the client key.
    let raw_ctx = zmq::Context::new();
    let raw = raw_ctx.socket(zmq::PUSH).unwrap();
    let own = zmq::CurveKeyPair::new().unwrap();
    let server_key = ControlSecurity::from_secret(Some(&s)).public_key().unwrap();
    raw.set_curve_serverkey(&server_key).unwrap();
    raw.set_curve_publickey(&own.public_key).unwrap();
    raw.set_curve_secretkey(&own.secret_key).unwrap();
    raw.set_linger(0).unwrap();
    raw.connect(&to).unwrap();
    let _ = raw.send("forged", zmq::DONTWAIT);

    assert_eq!(
        receive(&pull, Duration::from_secs(2)),
        None,
        "nothing forged arrives"
    );
    assert!(
        ctx.refused() >= 1,
        "the ZAP handler refused the stranger's key"
    );
    // Every failed handshake is counted (and logged once per burst).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while pull.handshake_failures() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        pull.handshake_failures() >= 2,
        "{}",
        pull.handshake_failures()
    );
    drop(raw);
    open.close_all();
    other.close_all();
}

#[test]
fn open_mode_stays_plain_zmq() {
    let (_ctx, pull) = inbox(ControlSecurity::open());
    let raw_ctx = zmq::Context::new();
    let raw = raw_ctx.socket(zmq::PUSH).unwrap();
    raw.set_linger(1000).unwrap();
    raw.connect(&endpoint(&pull)).unwrap();
    raw.send_multipart([&b"a"[..], b"b"], 0).unwrap();
    let got = receive(&pull, Duration::from_secs(10)).expect("plain zmq arrives");
    assert_eq!(got.len(), 2);
}

#[test]
fn oversized_messages_are_not_delivered() {
    let ctx = ControlContext::new(ControlSecurity::open()).unwrap();
    let pull = PullSocket::bind(&ctx, "127.0.0.1", 0, 1024).unwrap();
    let raw_ctx = zmq::Context::new();
    let raw = raw_ctx.socket(zmq::PUSH).unwrap();
    raw.set_linger(1000).unwrap();
    raw.connect(&endpoint(&pull)).unwrap();
    raw.send(vec![0u8; 4096], 0).unwrap();
    assert_eq!(receive(&pull, Duration::from_secs(1)), None);
}

#[test]
fn try_send_never_blocks_on_a_peer_that_does_not_read() {
    // A peer that accepts the connection and never reads: the queue
    // (send high-water mark plus socket buffers) fills, then messages are
    // dropped and counted instead of blocking the caller.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let ctx = ControlContext::new(ControlSecurity::open()).unwrap();
    let push = PushPool::new(&ctx, Duration::from_secs(30));
    let to = format!("tcp://127.0.0.1:{port}");
    let big = vec![7u8; 64 << 10];
    let mut sent = 0u64;
    for _ in 0..20_000 {
        if push.try_send(&to, [big.as_slice()]) {
            sent += 1;
        }
    }
    assert!(push.dropped() > 0, "a full queue drops instead of blocking");
    assert!(sent > 0);
    push.close_all();
}

#[test]
fn sockets_past_one_context_spill_into_more_up_to_the_cap() {
    // Past a context's share the pool opens another (libzmq caps a context
    // at 1023 sockets; sglang raises it with ZMQ_MAX_SOCKETS): every socket
    // still speaks CURVE and delivers; past the cap the least recently
    // used socket is closed for the new endpoint.
    let s = secret("a-cluster-secret-of-some-length");
    let inboxes: Vec<_> = (0..7)
        .map(|_| inbox(ControlSecurity::from_secret(Some(&s))))
        .collect();
    let sender_ctx = ControlContext::new(ControlSecurity::from_secret(Some(&s))).unwrap();
    let push = PushPool::with_limits(&sender_ctx, Duration::from_secs(2), 6, 2);
    for (i, (_, pull)) in inboxes.iter().take(6).enumerate() {
        push.send(&endpoint(pull), [format!("{i}").into_bytes()])
            .unwrap();
    }
    assert_eq!((push.open(), push.contexts()), (6, 3));
    for (i, (_, pull)) in inboxes.iter().take(6).enumerate() {
        let got = receive(pull, Duration::from_secs(10)).expect("delivered");
        assert_eq!(got, vec![format!("{i}").into_bytes()]);
    }
    // Inbox 0 is used again, so inbox 1's socket is the oldest.
    push.send(&endpoint(&inboxes[0].1), [&b"again"[..]])
        .unwrap();
    push.send(&endpoint(&inboxes[6].1), [&b"seventh"[..]])
        .unwrap();
    assert_eq!((push.open(), push.evicted(), push.contexts()), (6, 1, 3));
    assert_eq!(
        receive(&inboxes[6].1, Duration::from_secs(10)),
        Some(vec![b"seventh".to_vec()])
    );
    // The evicted endpoint reopens on its next send.
    push.send(&endpoint(&inboxes[1].1), [&b"back"[..]]).unwrap();
    assert_eq!(
        receive(&inboxes[1].1, Duration::from_secs(10)),
        Some(vec![b"back".to_vec()])
    );
    assert_eq!((push.open(), push.evicted()), (6, 2));
    push.close_all();
}

/// Messages naming ever new endpoints (in open mode anyone may send them)
/// open no more sockets than the cap, and a peer first reached after they
/// filled it still gets a socket and keeps delivering through the flood
/// (reopened when it was the oldest).
#[test]
fn made_up_endpoints_do_not_grow_the_socket_pool() {
    let (_ctx, pull) = inbox(ControlSecurity::open());
    let sender_ctx = ControlContext::new(ControlSecurity::open()).unwrap();
    let push = PushPool::with_limits(&sender_ctx, Duration::from_millis(200), 32, 1000);
    let live = endpoint(&pull);
    for i in 0..600u32 {
        // Closed ports on loopback: connect attempts that never succeed.
        let junk = format!("tcp://127.0.0.1:{}", 1 + i);
        push.try_send(&junk, [&b"x"[..]]);
        if i >= 60 && i % 27 == 0 {
            push.send(&live, [i.to_le_bytes().to_vec()]).unwrap();
        }
        assert!(push.open() <= 32);
    }
    let mut got = 0;
    while receive(&pull, Duration::from_secs(5)).is_some() {
        got += 1;
        if got == 20 {
            break;
        }
    }
    assert_eq!(got, 20, "every message to the live peer arrived");
    assert!(push.evicted() >= 600 - 32);
    push.close_all();
}
