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
    // still speaks CURVE and delivers, and past the cap the error names
    // the setting.
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
    let err = push
        .send(&endpoint(&inboxes[6].1), [&b"one too many"[..]])
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS"),
        "{err}"
    );
    // A closed socket frees its place (in its own context).
    push.disconnect(&endpoint(&inboxes[0].1));
    push.send(&endpoint(&inboxes[6].1), [&b"now"[..]]).unwrap();
    assert_eq!((push.open(), push.contexts()), (6, 3));
    assert_eq!(
        receive(&inboxes[6].1, Duration::from_secs(10)),
        Some(vec![b"now".to_vec()])
    );
    push.close_all();
}

/// The process's resident memory, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kb * 1024
}

/// Strangers without the secret open connections to a secret-mode inbox,
/// start a CURVE handshake and send all but the last byte of one large
/// frame instead of HELLO: libzmq holds it (up to the message limit)
/// before authentication. The handshake deadline closes them, freeing it,
/// in seconds rather than libzmq's 30.
#[test]
fn a_strangers_stalled_handshake_is_closed_and_its_memory_freed() {
    use std::io::{Read, Write};
    const FRAME: usize = 24 << 20;
    const STRANGERS: usize = 6;
    let s = secret("a-cluster-secret-of-some-length");
    let (_ctx, pull) = inbox(ControlSecurity::from_secret(Some(&s)));
    let before = rss();
    let mut greeting = vec![0xffu8, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    let mut mechanism = b"CURVE".to_vec();
    mechanism.resize(20, 0);
    greeting.extend_from_slice(&mechanism);
    greeting.resize(64, 0);
    let payload = vec![0x41u8; FRAME];
    let mut conns = Vec::new();
    for _ in 0..STRANGERS {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", pull.port())).unwrap();
        c.write_all(&greeting).unwrap();
        let mut theirs = [0u8; 64];
        c.read_exact(&mut theirs).unwrap();
        // A command frame (long size) of FRAME bytes instead of HELLO.
        let mut head = vec![0x06u8];
        head.extend_from_slice(&(FRAME as u64).to_be_bytes());
        c.write_all(&head).unwrap();
        c.write_all(&payload[1..]).unwrap();
        conns.push(c);
    }
    drop(payload);
    std::thread::sleep(Duration::from_millis(300));
    let held = rss().saturating_sub(before);
    // Each connection is closed by the handshake deadline (3 s).
    let started = std::time::Instant::now();
    for c in &mut conns {
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 64];
        let end = c.read(&mut buf);
        assert!(
            matches!(end, Ok(0) | Err(_)),
            "the stranger's connection was not closed: {end:?}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "closed only after {:?}",
        started.elapsed()
    );
    drop(conns);
    std::thread::sleep(Duration::from_millis(300));
    let after = rss().saturating_sub(before);
    assert!(
        held > (FRAME as u64) * 2,
        "the strangers' frames were not held ({} MiB): the attack is not reproduced",
        held >> 20
    );
    assert!(
        after < FRAME as u64,
        "{} MiB still held after the handshakes closed (held {} MiB meanwhile)",
        after >> 20,
        held >> 20
    );
}
