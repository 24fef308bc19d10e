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
mod nacl;

pub use curve::{ControlContext, ControlSecurity};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
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
const SOCKETS_PER_CONTEXT: usize = 1000;

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
const BUSY_WAIT: Duration = Duration::from_millis(100);

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

fn zmq_err<'a>(
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
            .ok_or(ControlError::Endpoint(bound))?;
        Ok(Self { socket, port })
    }

    /// The port the socket is bound to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Waits up to `timeout` for one multipart message.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Vec<Vec<u8>>>, ControlError> {
        let ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
        match self.socket.poll(zmq::POLLIN, ms) {
            Ok(0) => Ok(None),
            Ok(_) => match self.socket.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => Ok(Some(frames)),
                Err(zmq::Error::EAGAIN) => Ok(None),
                Err(e) => Err(zmq_err("recv", "pull socket")(e)),
            },
            Err(zmq::Error::EINTR) => Ok(None),
            Err(e) => Err(zmq_err("poll", "pull socket")(e)),
        }
    }
}

/// PUSH sockets to peers, one per endpoint, created on first use. libzmq
/// caps a context at 1023 sockets; past `SOCKETS_PER_CONTEXT` the pool
/// opens further contexts (client sockets need no ZAP handler), up to
/// `max_sockets` sockets in all.
pub struct PushPool {
    context: zmq::Context,
    security: ControlSecurity,
    send_timeout: Duration,
    max_sockets: usize,
    per_context: usize,
    sockets: Mutex<Sockets>,
    dropped: AtomicU64,
}

/// The open sockets, each with the index of its context (0: the rank's),
/// the sockets open per context, and the extra contexts. Sockets drop
/// before their contexts (field order).
#[derive(Default)]
struct Sockets {
    by_endpoint: HashMap<String, (usize, Arc<Mutex<zmq::Socket>>)>,
    open: Vec<usize>,
    extra: Vec<zmq::Context>,
}

impl Sockets {
    fn remove(&mut self, endpoint: &str) {
        if let Some((ctx, _)) = self.by_endpoint.remove(endpoint)
            && let Some(n) = self.open.get_mut(ctx)
        {
            *n = n.saturating_sub(1);
        }
    }
}

impl std::fmt::Debug for PushPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sockets = self.sockets.lock();
        f.debug_struct("PushPool")
            .field("endpoints", &sockets.by_endpoint.len())
            .field("contexts", &(1 + sockets.extra.len()))
            .finish()
    }
}

impl PushPool {
    /// A pool of sockets secured as `control` says, whose sends give up
    /// after `send_timeout` (zmq `SNDTIMEO`), at most
    /// [`DEFAULT_MAX_SOCKETS`] of them.
    pub fn new(control: &ControlContext, send_timeout: Duration) -> Self {
        Self::with_limits(
            control,
            send_timeout,
            DEFAULT_MAX_SOCKETS,
            SOCKETS_PER_CONTEXT,
        )
    }

    /// [`PushPool::new`] with at most `max_sockets` sockets.
    pub fn capped(control: &ControlContext, send_timeout: Duration, max_sockets: usize) -> Self {
        Self::with_limits(control, send_timeout, max_sockets, SOCKETS_PER_CONTEXT)
    }

    /// [`PushPool::new`] with at most `max_sockets` sockets, `per_context`
    /// in each zmq context (tests use small numbers).
    pub fn with_limits(
        control: &ControlContext,
        send_timeout: Duration,
        max_sockets: usize,
        per_context: usize,
    ) -> Self {
        Self {
            context: control.context().clone(),
            security: control.security().clone(),
            send_timeout,
            max_sockets,
            per_context: per_context.clamp(1, SOCKETS_PER_CONTEXT),
            sockets: Mutex::new(Sockets::default()),
            dropped: AtomicU64::new(0),
        }
    }

    /// The zmq contexts the pool uses (the rank's own and any extra).
    pub fn contexts(&self) -> usize {
        1 + self.sockets.lock().extra.len()
    }

    fn socket(&self, endpoint: &str) -> Result<Arc<Mutex<zmq::Socket>>, ControlError> {
        let mut sockets = self.sockets.lock();
        if let Some((_, s)) = sockets.by_endpoint.get(endpoint) {
            return Ok(s.clone());
        }
        if sockets.by_endpoint.len() >= self.max_sockets {
            return Err(ControlError::TooManySockets {
                endpoint: endpoint.to_owned(),
                max: self.max_sockets,
            });
        }
        // The first context with room: the rank's own, then the extras,
        // opening one more when all are full.
        let per = self.per_context;
        let slot = match sockets.open.iter().position(|&n| n < per) {
            Some(i) => i,
            None => sockets.open.len(),
        };
        if slot >= sockets.open.len() {
            sockets.open.push(0);
        }
        while sockets.extra.len() < slot {
            sockets.extra.push(zmq::Context::new());
        }
        let context = match slot {
            0 => self.context.clone(),
            i => sockets.extra[i - 1].clone(),
        };
        let socket = zmq_call!(context.socket(zmq::PUSH), endpoint)?;
        if endpoint.contains('[') {
            zmq_call!(socket.set_ipv6(true), endpoint)?;
        }
        self.security.apply_client(&socket, endpoint)?;
        zmq_call!(socket.set_sndhwm(SEND_QUEUE_MESSAGES), endpoint)?;
        let ms = i32::try_from(self.send_timeout.as_millis()).unwrap_or(i32::MAX);
        zmq_call!(socket.set_sndtimeo(ms), endpoint)?;
        zmq_call!(socket.set_linger(0), endpoint)?;
        zmq_call!(socket.set_tcp_keepalive(1), endpoint)?;
        zmq_call!(socket.connect(endpoint), endpoint)?;
        let socket = Arc::new(Mutex::new(socket));
        sockets
            .by_endpoint
            .insert(endpoint.to_owned(), (slot, socket.clone()));
        sockets.open[slot] += 1;
        Ok(socket)
    }

    /// Sends one multipart message to `endpoint` (`tcp://host:port`).
    pub fn send<I, F>(&self, endpoint: &str, frames: I) -> Result<(), ControlError>
    where
        I: IntoIterator<Item = F>,
        F: Into<zmq::Message>,
    {
        let socket = self.socket(endpoint)?;
        let guard = socket.lock();
        guard
            .send_multipart(frames, 0)
            .map_err(zmq_err("send", endpoint))
    }

    /// Sends without ever blocking, for threads that serve every peer (an
    /// inbox): when `endpoint`'s queue is full the message is dropped,
    /// counted and logged (once per burst), and `false` returned.
    pub fn try_send<I, F>(&self, endpoint: &str, frames: I) -> bool
    where
        I: IntoIterator<Item = F>,
        F: Into<zmq::Message>,
    {
        let socket = match self.socket(endpoint) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%endpoint, error = %e, "cannot open a control socket; message dropped");
                return false;
            }
        };
        let Some(guard) = socket.try_lock_for(BUSY_WAIT) else {
            // Another thread has been sending to this peer for a while (and
            // may be blocked on it): never wait behind it for long.
            self.note_dropped(endpoint, "socket busy");
            return false;
        };
        match guard.send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => true,
            Err(e) => {
                drop(guard);
                self.note_dropped(endpoint, &e.to_string());
                false
            }
        }
    }

    fn note_dropped(&self, endpoint: &str, why: &str) {
        let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(%endpoint, why, dropped_total = n, "control message dropped: peer not keeping up");
        }
    }

    /// Messages [`PushPool::try_send`] dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Closes the socket to `endpoint` (a peer known to be gone).
    pub fn disconnect(&self, endpoint: &str) {
        self.sockets.lock().remove(endpoint);
    }

    /// Sockets open now.
    pub fn open(&self) -> usize {
        self.sockets.lock().by_endpoint.len()
    }

    /// Closes every socket.
    pub fn close_all(&self) {
        let mut sockets = self.sockets.lock();
        sockets.by_endpoint.clear();
        sockets.open.iter_mut().for_each(|n| *n = 0);
    }
}
