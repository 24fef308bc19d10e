//! The accept side every transport shares: one loop takes connections off a
//! listener, closes at once those past the transport's cap (counted, and
//! warned of once per quiet period), backs off when `accept` runs out of
//! descriptors or memory instead of spinning, and hands each connection to
//! the transport's handler on a thread of its own. The connection's slot is
//! given back when its handler returns, however it ends.
//!
//! **Owns:** accepting, the connection cap, the back-off and their counters
//! ([`Gate`]). **Never:** reads or writes a connection (the handshake, the
//! deadlines and the idle timeouts are the handler's, through
//! [`super::io`] and [`super::handshake`]), or knows which transport it
//! serves.

use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::burst::Burst;
use super::io;

/// Poll tick while waiting for a connection (shutdown checks).
const TICK_MS: i32 = 200;
/// Back-off of the loop when `accept` runs out of resources.
const BACKOFF: Duration = Duration::from_millis(100);

/// What the accept loop counts.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Accepted connections whose handler runs now.
    pub open: AtomicU64,
    /// Connections closed at once because the cap was reached.
    pub refused: AtomicU64,
    /// `accept` failures for lack of resources (EMFILE, ENFILE, ENOBUFS,
    /// ENOMEM), each followed by a back-off.
    pub accept_errors: AtomicU64,
    log_refused: Burst,
}

/// A transport's side of the accept loop.
pub(crate) trait Service: Send + Sync + 'static {
    /// The transport, as logs name it.
    const WHAT: &'static str;
    /// The name of its handler threads.
    const THREAD: &'static str;

    /// Whether it shut down (the loop ends).
    fn is_shutdown(&self) -> bool;

    /// Most connections handled at once.
    fn max_connections(&self) -> usize;

    /// The loop's counters.
    fn gate(&self) -> &Gate;

    /// Registers an accepted connection before its handler starts; its id.
    fn admit(&self, _stream: &TcpStream) -> u64 {
        0
    }

    /// Handles connection `id`, accepted at `accepted_at`, on its own thread.
    fn serve(self: Arc<Self>, stream: TcpStream, id: u64, accepted_at: Instant);

    /// Undoes [`Service::admit`] when no handler thread could start.
    fn abandon(&self, _id: u64) {}
}

/// Gives a connection's slot back when its handler ends.
struct Slot<S: Service>(Arc<S>);

impl<S: Service> Drop for Slot<S> {
    fn drop(&mut self) {
        self.0.gate().open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether an `accept` error means "out of descriptors or memory": the
/// pending connection stays queued, so retrying at once would spin.
fn is_exhaustion(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Accepts connections for `service` until it shuts down.
pub(crate) fn accept_loop<S: Service>(service: Arc<S>, listener: TcpListener) {
    let fd = listener.as_raw_fd();
    // Resource errors in the current episode (logged once, at its start).
    let mut episode: u64 = 0;
    while !service.is_shutdown() {
        match io::wait_readable(fd, TICK_MS) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                tracing::warn!(what = S::WHAT, error = %e, "poll on listener failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        }
        if service.is_shutdown() {
            break;
        }
        match listener.accept() {
            Ok((stream, from)) => {
                if episode > 0 {
                    tracing::info!(what = S::WHAT, errors = episode, "accept works again");
                    episode = 0;
                }
                admit(&service, stream, from);
            }
            Err(e) if is_exhaustion(&e) => {
                service.gate().accept_errors.fetch_add(1, Ordering::Relaxed);
                if episode == 0 {
                    tracing::warn!(
                        what = S::WHAT,
                        error = %e,
                        "accept is out of resources; backing off (logged once per episode)"
                    );
                }
                episode += 1;
                std::thread::sleep(BACKOFF);
            }
            Err(e) => {
                if !service.is_shutdown() {
                    tracing::debug!(what = S::WHAT, error = %e, "accept failed");
                }
            }
        }
    }
}

/// Closes `stream` at once past the cap, else hands it to a handler thread.
fn admit<S: Service>(service: &Arc<S>, stream: TcpStream, from: std::net::SocketAddr) {
    let gate = service.gate();
    let open = gate.open.load(Ordering::Acquire);
    let max = service.max_connections();
    if open >= max as u64 {
        gate.refused.fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = gate.log_refused.hit() {
            tracing::warn!(
                what = S::WHAT,
                %from,
                open,
                max,
                suppressed,
                "connection limit reached; closing new connections at once"
            );
        }
        return;
    }
    gate.accepted.fetch_add(1, Ordering::Relaxed);
    gate.open.fetch_add(1, Ordering::AcqRel);
    tracing::debug!(what = S::WHAT, %from, "accepted connection");
    let id = service.admit(&stream);
    let (handler, at) = (service.clone(), Instant::now());
    let spawned = std::thread::Builder::new()
        .name(S::THREAD.into())
        .spawn(move || {
            let _slot = Slot(handler.clone());
            handler.serve(stream, id, at);
        });
    if let Err(e) = spawned {
        gate.open.fetch_sub(1, Ordering::AcqRel);
        service.abandon(id);
        tracing::warn!(what = S::WHAT, error = %e, "cannot spawn a connection thread; dropping connection");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests unwrap what they construct
mod tests {
    use std::io::{Read, Write};
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// Echoes one byte, or holds the connection until told to let go.
    #[derive(Debug, Default)]
    struct Echo {
        gate: Gate,
        stop: AtomicBool,
        hold: AtomicBool,
    }

    impl Service for Echo {
        const WHAT: &'static str = "echo";
        const THREAD: &'static str = "echo";

        fn is_shutdown(&self) -> bool {
            self.stop.load(Ordering::Acquire)
        }

        fn max_connections(&self) -> usize {
            2
        }

        fn gate(&self) -> &Gate {
            &self.gate
        }

        fn serve(self: Arc<Self>, mut stream: TcpStream, _id: u64, _at: Instant) {
            while self.hold.load(Ordering::Acquire) && !self.is_shutdown() {
                std::thread::sleep(Duration::from_millis(5));
            }
            let mut b = [0u8; 1];
            if stream.read_exact(&mut b).is_ok() {
                let _ = stream.write_all(&b);
            }
        }
    }

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let until = Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < until, "timed out waiting: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn connections_past_the_cap_are_closed_and_slots_come_back() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let echo = Arc::new(Echo::default());
        echo.hold.store(true, Ordering::Release);
        let e2 = echo.clone();
        let looped = std::thread::spawn(move || accept_loop(e2, l));
        let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
        wait_for("two held", || echo.gate.open.load(Ordering::Acquire) == 2);
        // The third is closed at once: it reads end-of-stream.
        let mut third = TcpStream::connect(addr).unwrap();
        third
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 1];
        assert_eq!(third.read(&mut b).unwrap_or(0), 0);
        assert_eq!(echo.gate.refused.load(Ordering::Relaxed), 1);
        // Released, the held ones are served and their slots given back.
        echo.hold.store(false, Ordering::Release);
        for mut s in held {
            s.write_all(b"x").unwrap();
            s.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"x");
        }
        wait_for("slots back", || echo.gate.open.load(Ordering::Acquire) == 0);
        assert_eq!(echo.gate.accepted.load(Ordering::Relaxed), 2);
        // A new connection is served again.
        let mut again = TcpStream::connect(addr).unwrap();
        again.write_all(b"y").unwrap();
        again.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"y");
        echo.stop.store(true, Ordering::Release);
        looped.join().unwrap();
    }
}
