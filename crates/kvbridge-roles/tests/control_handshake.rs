//! A stranger's zmq handshake that never finishes is closed within the
//! inbox's handshake deadline, and what libzmq buffered for it before
//! authentication is freed. Alone in its binary: it measures the process's
//! resident memory.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvbridge_engine::ClusterSecret;
use kvbridge_roles::control::{
    ControlContext, ControlSecurity, DEFAULT_MAX_MESSAGE_BYTES, PullSocket,
};

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::from_text(text, "test").unwrap()
}

fn inbox(security: ControlSecurity) -> (ControlContext, PullSocket) {
    let ctx = ControlContext::new(security).unwrap();
    let pull = PullSocket::bind(&ctx, "127.0.0.1", 0, DEFAULT_MAX_MESSAGE_BYTES).unwrap();
    (ctx, pull)
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
