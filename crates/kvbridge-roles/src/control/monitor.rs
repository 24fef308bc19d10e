//! Watches an inbox's zmq connections through a libzmq socket monitor:
//! counts the handshakes that fail or time out (a stranger without the
//! secret, a member with another one, a connection that never says HELLO)
//! and logs them once per burst, so a flood of unauthenticated connections
//! is never silent. libzmq closes each such connection itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{ControlError, zmq_call};

/// Quiet time after which a burst of failed handshakes is logged again.
const LOG_QUIET: Duration = Duration::from_secs(10);
/// How often the watcher checks for shutdown while no event comes.
const TICK_MS: i64 = 10;

/// The events that end a handshake without a peer.
fn is_failure(event: u16) -> bool {
    [
        zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL,
        zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL,
        zmq::SocketEvent::HANDSHAKE_FAILED_AUTH,
    ]
    .iter()
    .any(|e| *e as u16 == event)
}

/// A thread that reads one socket's monitor events until dropped.
pub(crate) struct HandshakeWatch {
    stop: Arc<AtomicBool>,
    failures: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl HandshakeWatch {
    /// Starts watching `socket` (of `context`), labelled `what` in logs.
    pub(crate) fn start(
        context: &zmq::Context,
        socket: &zmq::Socket,
        what: &str,
    ) -> Result<Self, ControlError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let endpoint = format!(
            "inproc://kvb-inbox-monitor-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mask = zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL as i32
            | zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL as i32
            | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH as i32;
        zmq_call!(socket.monitor(&endpoint, mask), &endpoint)?;
        let pair = zmq_call!(context.socket(zmq::PAIR), &endpoint)?;
        zmq_call!(pair.set_linger(0), &endpoint)?;
        zmq_call!(pair.connect(&endpoint), &endpoint)?;
        let stop = Arc::new(AtomicBool::new(false));
        let failures = Arc::new(AtomicU64::new(0));
        let (s, f, what) = (stop.clone(), failures.clone(), what.to_owned());
        let thread = std::thread::Builder::new()
            .name("kvb-zmq-monitor".into())
            .spawn(move || watch(&pair, &s, &f, &what))
            .map_err(ControlError::Thread)?;
        Ok(Self {
            stop,
            failures,
            thread: Some(thread),
        })
    }

    /// Handshakes that failed or timed out so far.
    pub(crate) fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }
}

impl Drop for HandshakeWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch(pair: &zmq::Socket, stop: &AtomicBool, failures: &AtomicU64, what: &str) {
    let mut logged: Option<Instant> = None;
    let mut unlogged = 0u64;
    while !stop.load(Ordering::SeqCst) {
        match pair.poll(zmq::POLLIN, TICK_MS) {
            Ok(n) if n > 0 => {}
            _ => continue,
        }
        let Ok(frames) = pair.recv_multipart(zmq::DONTWAIT) else {
            continue;
        };
        // Frame 0: the event (u16, little endian) and its value (u32).
        let event = frames
            .first()
            .and_then(|f| f.get(..2))
            .map(|b| u16::from_le_bytes([b[0], b[1]]));
        if !event.is_some_and(is_failure) {
            continue;
        }
        let total = failures.fetch_add(1, Ordering::Relaxed) + 1;
        unlogged += 1;
        let now = Instant::now();
        if logged.is_none_or(|t| now.duration_since(t) >= LOG_QUIET) {
            tracing::warn!(
                inbox = what,
                failed = unlogged,
                total,
                "zmq handshakes to this inbox failed or timed out (peers without the cluster \
                 secret, or connections that never authenticate); libzmq closed them"
            );
            logged = Some(now);
            unlogged = 0;
        }
    }
}
