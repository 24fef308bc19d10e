//! The zmq control plane: one PULL socket a role receives on, and a pool
//! of PUSH sockets to peers, as sglang's managers use them.
//!
//! zmq sockets are not thread-safe, so each PUSH socket sits behind its own
//! lock and the PULL socket belongs to one receiving thread. Receives poll
//! with a timeout so the thread notices teardown. With a cluster secret
//! every socket speaks CURVE (the `curve` module); inbound messages are capped in
//! size; a send from a thread that must never block
//! ([`PushPool::try_send`]) drops the message, counted, when the peer's
//! queue is full.

mod curve;
mod monitor;
mod nacl;
mod push;

pub use curve::{ControlContext, ControlSecurity};
pub use push::PushPool;

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use thiserror::Error;

/// A control-plane failure.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ControlError {
    /// zmq refused an operation.
    #[error("zmq {op} on {endpoint}: {source}")]
    Zmq {
        /// What was attempted (bind, connect, send, recv).
        op: &'static str,
        /// The endpoint involved.
        endpoint: String,
        /// zmq's error.
        source: zmq::Error,
    },
    /// The bound endpoint could not be read back.
    #[error("cannot read the bound endpoint of {0}")]
    Endpoint(String),
    /// A cluster secret is set but libzmq was built without CURVE.
    #[error(
        "a cluster secret is set but this build's libzmq has no CURVE support; \
         rebuild with the workspace's .cargo/config.toml"
    )]
    NoCurve,
    /// A control-plane thread could not be started.
    #[error("cannot start a control-plane thread: {0}")]
    Thread(#[source] std::io::Error),
    /// Every allowed PUSH socket is open (one per peer endpoint).
    #[error(
        "cannot open a control socket to {endpoint}: all {max} are open, one per peer \
         endpoint (raise SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS / zmq_max_sockets)"
    )]
    TooManySockets {
        /// The endpoint that would have needed one more.
        endpoint: String,
        /// The cap.
        max: usize,
    },
}

/// Control sockets a rank may open to peers by default (sglang's
/// `SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS` default).
pub const DEFAULT_MAX_SOCKETS: usize = 16384;

/// PUSH sockets per zmq context: below libzmq's default cap of 1023
/// sockets per context, with room for the rank's own PULL and ZAP sockets.
pub(crate) const SOCKETS_PER_CONTEXT: usize = 1000;

/// Largest inbound control message by default (`ZMQ_MAXMSGSIZE`): far above
/// any legitimate frame (a 1 M-page transfer request is 4 MiB).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 << 20;

/// How long a connection to an inbox may take to finish its zmq handshake
/// (`ZMQ_HANDSHAKE_IVL`; libzmq's default is 30 s). A member's takes
/// milliseconds; a stranger's (which in secret mode never completes) is
/// closed after this, freeing what it sent before authentication (libzmq
/// accepts one frame of up to the message limit even then).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Messages a PUSH socket queues for one peer before sends fail (`ZMQ_SNDHWM`).
pub const SEND_QUEUE_MESSAGES: i32 = 1000;

/// How long [`PushPool::try_send`] waits for another thread's send to the
/// same peer to finish (non-blocking sends finish in microseconds).
pub(crate) const BUSY_WAIT: Duration = Duration::from_millis(100);

/// `socket.method(args)` with a zmq error mapped to [`ControlError::Zmq`]
/// naming the method and `endpoint`.
macro_rules! zmq_call {
    ($socket:ident . $method:ident ( $($arg:expr),* ), $endpoint:expr) => {
        $socket
            .$method($($arg),*)
            .map_err($crate::control::zmq_err(stringify!($method), $endpoint))
    };
}
pub(crate) use zmq_call;

pub(crate) fn zmq_err<'a>(
    op: &'static str,
    endpoint: &'a str,
) -> impl FnOnce(zmq::Error) -> ControlError + 'a {
    move |source| ControlError::Zmq {
        op,
        endpoint: endpoint.to_owned(),
        source,
    }
}

/// `tcp://host:port`, bracketing IPv6 hosts.
pub fn tcp_endpoint(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

/// A bound PULL socket that one thread receives multipart messages on.
pub struct PullSocket {
    socket: zmq::Socket,
    port: u16,
    watch: monitor::HandshakeWatch,
    /// The receive timeout last set on the socket (ms; -1 before any).
    timeout_ms: AtomicI32,
}

impl std::fmt::Debug for PullSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullSocket")
            .field("port", &self.port)
            .finish()
    }
}

impl PullSocket {
    /// Binds a PULL socket on `host`, on `port` or (0) a free port, secured
    /// as `control` says; a peer sending a frame over `max_message_bytes`
    /// is disconnected.
    pub fn bind(
        control: &ControlContext,
        host: &str,
        port: u16,
        max_message_bytes: usize,
    ) -> Result<Self, ControlError> {
        let context = control.context();
        let socket = zmq_call!(context.socket(zmq::PULL), host)?;
        control.security().apply_server(&socket, host)?;
        let handshake = i32::try_from(HANDSHAKE_TIMEOUT.as_millis()).unwrap_or(i32::MAX);
        zmq_call!(socket.set_handshake_ivl(handshake), host)?;
        let max = i64::try_from(max_message_bytes).unwrap_or(i64::MAX);
        zmq_call!(socket.set_maxmsgsize(max), host)?;
        let wanted = if port == 0 {
            if host.contains(':') {
                format!("tcp://[{host}]:*")
            } else {
                format!("tcp://{host}:*")
            }
        } else {
            tcp_endpoint(host, port)
        };
        if host.contains(':') {
            zmq_call!(socket.set_ipv6(true), &wanted)?;
        }
        zmq_call!(socket.set_linger(0), &wanted)?;
        zmq_call!(socket.bind(&wanted), &wanted)?;
        let bound = socket
            .get_last_endpoint()
            .ok()
            .and_then(Result::ok)
            .ok_or_else(|| ControlError::Endpoint(wanted.clone()))?;
        let port = bound
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| ControlError::Endpoint(bound.clone()))?;
        let watch = monitor::HandshakeWatch::start(context, &socket, &bound)?;
        Ok(Self {
            socket,
            port,
            watch,
            timeout_ms: AtomicI32::new(-1),
        })
    }

    /// Handshakes to this inbox that failed or timed out so far (libzmq
    /// closed each); logged once per burst.
    pub fn handshake_failures(&self) -> u64 {
        self.watch.failures()
    }

    /// The port the socket is bound to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Waits up to `timeout` for one multipart message.
    ///
    /// A blocking receive under the socket's receive timeout: a message
    /// already queued is taken without a system call, and an empty socket
    /// waits in one `poll` (a `zmq_poll` first would add two per message).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Vec<Vec<u8>>>, ControlError> {
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        let flags = if ms == 0 {
            zmq::DONTWAIT
        } else {
            if self.timeout_ms.load(Ordering::Relaxed) != ms {
                self.socket
                    .set_rcvtimeo(ms)
                    .map_err(zmq_err("set_rcvtimeo", "pull socket"))?;
                self.timeout_ms.store(ms, Ordering::Relaxed);
            }
            0
        };
        match self.socket.recv_multipart(flags) {
            Ok(frames) => Ok(Some(frames)),
            Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => Ok(None),
            Err(e) => Err(zmq_err("recv", "pull socket")(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// Queued messages come whole and in order, an empty socket waits up to
    /// the timeout asked (none for zero), and a long wait after a zero one
    /// still blocks until a message arrives.
    #[test]
    fn a_pull_socket_takes_queued_messages_and_waits_at_most_its_timeout() {
        let ctx = ControlContext::new(ControlSecurity::open()).unwrap();
        let pull = PullSocket::bind(&ctx, "127.0.0.1", 0, DEFAULT_MAX_MESSAGE_BYTES).unwrap();
        let endpoint = tcp_endpoint("127.0.0.1", pull.port());
        assert_eq!(pull.recv_timeout(Duration::ZERO).unwrap(), None);
        let t = Instant::now();
        assert_eq!(pull.recv_timeout(Duration::from_millis(60)).unwrap(), None);
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "waited {:?}",
            t.elapsed()
        );

        let push = PushPool::new(&ctx, Duration::from_secs(5));
        for i in 0..3u8 {
            push.send(&endpoint, [vec![b'm', i], vec![i; 3]]).unwrap();
        }
        for i in 0..3u8 {
            let got = pull.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(got, Some(vec![vec![b'm', i], vec![i; 3]]));
        }
        assert_eq!(pull.recv_timeout(Duration::ZERO).unwrap(), None);

        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            push.send(&endpoint, [b"late".to_vec()]).unwrap();
            push
        });
        let got = pull.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(got, Some(vec![b"late".to_vec()]));
        drop(late.join().unwrap());
    }
}
