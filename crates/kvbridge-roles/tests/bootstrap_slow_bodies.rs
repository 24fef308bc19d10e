//! Slow bodies against the bootstrap server: more connections than it
//! serves at once each send a write's head and then never the body. In
//! secret mode a stranger's write is refused at its head (the signature
//! covers the headers and the body's digest), before a byte of the body is
//! read; in open mode at most `max_pending_bodies` bodies are waited for and
//! the rest are refused at once. Either way `GET /health` keeps answering.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvbridge_engine::ClusterSecret;
use kvbridge_roles::bootstrap::auth::{SERVER_HEADER, WriteAuth};
use kvbridge_roles::bootstrap::{BootstrapConfig, BootstrapLimits, BootstrapServer};

const CAP: usize = 48;
const SLOW: usize = CAP + 24;

fn start(secret: Option<ClusterSecret>, pending_bodies: usize) -> BootstrapServer {
    let config = BootstrapConfig {
        secret,
        limits: BootstrapLimits {
            max_connections: CAP,
            max_pending_bodies: pending_bodies,
            ..BootstrapLimits::default()
        },
        ..BootstrapConfig::default()
    };
    BootstrapServer::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap()
}

/// A `PUT /route` head announcing a 4 KiB body, with `extra` header lines;
/// the body never follows.
fn slow_write(addr: SocketAddr, extra: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let head = format!(
        "PUT /route HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 4096\r\n{extra}\r\n{{"
    );
    s.write_all(head.as_bytes()).unwrap();
    s
}

/// What the server did with a connection within a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heard {
    /// Answered with this status.
    Status(u16),
    /// Closed it without an answer.
    Closed,
    /// Nothing yet: it is waiting for us.
    Silent,
}

/// What the server sent on `s` within `wait`.
fn heard(s: &mut TcpStream, wait: Duration) -> Heard {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    let mut closed = false;
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    let line = String::from_utf8_lossy(&got);
    match line.split_whitespace().nth(1).and_then(|c| c.parse().ok()) {
        Some(code) => Heard::Status(code),
        None if closed => Heard::Closed,
        None => Heard::Silent,
    }
}

fn answer(s: &mut TcpStream, wait: Duration) -> Option<u16> {
    match heard(s, wait) {
        Heard::Status(code) => Some(code),
        _ => None,
    }
}

/// `GET /health` answers 200 within 2 s, on a fresh connection.
fn healthy(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return false;
    };
    let req = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).is_ok() && answer(&mut s, Duration::from_secs(2)) == Some(200)
}

#[test]
fn secret_mode_refuses_a_strangers_write_before_its_body() {
    let key = ClusterSecret::from_text("slow-bodies-cluster-secret", "test").unwrap();
    let bs = start(Some(key), 64);
    let addr = bs.local_addr();
    // A stranger's headers: none, or a signature under another secret.
    let forger =
        WriteAuth::new(&ClusterSecret::from_text("not-the-cluster-secret", "test").unwrap());
    let forged: String = forger
        .sign(bs.instance_id(), "PUT", "/route", b"{}")
        .pairs()
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let started = Instant::now();
    let mut conns: Vec<TcpStream> = (0..SLOW)
        .map(|i| slow_write(addr, if i % 2 == 0 { "" } else { &forged }))
        .collect();
    // Each is refused at its head (401), or closed by the connection cap
    // when more arrive than it serves; none waits for its body.
    let heard: Vec<Heard> = conns
        .iter_mut()
        .map(|s| heard(s, Duration::from_secs(3)))
        .collect();
    let refused = heard.iter().filter(|h| **h == Heard::Status(401)).count();
    assert!(
        heard
            .iter()
            .all(|h| matches!(h, Heard::Status(401) | Heard::Closed)),
        "{heard:?}"
    );
    assert!(refused >= CAP, "{refused} refused: {heard:?}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "refusals waited for bodies: {:?}",
        started.elapsed()
    );
    let up = (0..10).filter(|_| healthy(addr)).count();
    assert_eq!(up, 10, "health checks answered while {SLOW} writes hang");
    assert_eq!(bs.stats().unauthorized, refused as u64);
    drop(conns);
    bs.shutdown();
}

#[test]
fn open_mode_waits_for_a_few_bodies_only() {
    const PENDING: usize = 4;
    let bs = start(None, PENDING);
    let addr = bs.local_addr();
    let mut conns: Vec<TcpStream> = (0..SLOW).map(|_| slow_write(addr, "")).collect();
    // Every write past the first few is refused at once (503, or closed
    // by the connection cap); the few wait for their bodies (and time out
    // after the body timeout).
    let heard: Vec<Heard> = conns
        .iter_mut()
        .map(|s| heard(s, Duration::from_millis(1500)))
        .collect();
    let waiting = heard.iter().filter(|h| **h == Heard::Silent).count();
    let busy = heard.iter().filter(|h| **h == Heard::Status(503)).count();
    assert!(
        waiting <= PENDING,
        "{waiting} of {SLOW} bodies waited for: {heard:?}"
    );
    assert!(
        busy >= CAP - PENDING,
        "only {busy} of {SLOW} refused with 503: {heard:?}"
    );
    let up = (0..10).filter(|_| healthy(addr)).count();
    assert_eq!(up, 10, "health checks answered while {SLOW} writes hang");
    drop(conns);
    bs.shutdown();
}

#[test]
fn every_answer_names_the_server_instance() {
    let a = start(None, 64);
    let b = start(None, 64);
    assert_ne!(a.instance_id(), b.instance_id());
    let mut s = TcpStream::connect(a.local_addr()).unwrap();
    let req = format!(
        "GET /health HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        a.local_addr()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let named = format!("{SERVER_HEADER}: {}", a.instance_id());
    assert!(text.to_ascii_lowercase().contains(&named), "{text}");
    a.shutdown();
    b.shutdown();
}
