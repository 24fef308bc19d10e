//! The zmq control plane: one PULL socket a role receives on, and a pool
//! of PUSH sockets to peers, as sglang's managers use them.
//!
//! zmq sockets are not thread-safe, so each PUSH socket sits behind its own
//! lock and the PULL socket belongs to one receiving thread. Receives poll
//! with a timeout so the thread notices teardown.

use std::collections::HashMap;
use std::sync::Arc;
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
}

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
    /// Binds a PULL socket on `host`, on `port` or (0) a free port.
    pub fn bind(context: &zmq::Context, host: &str, port: u16) -> Result<Self, ControlError> {
        let socket = context.socket(zmq::PULL).map_err(zmq_err("socket", host))?;
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
            socket
                .set_ipv6(true)
                .map_err(zmq_err("set_ipv6", &wanted))?;
        }
        socket
            .set_linger(0)
            .map_err(zmq_err("set_linger", &wanted))?;
        socket.bind(&wanted).map_err(zmq_err("bind", &wanted))?;
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

/// PUSH sockets to peers, one per endpoint, created on first use.
pub struct PushPool {
    context: zmq::Context,
    send_timeout: Duration,
    sockets: Mutex<HashMap<String, Arc<Mutex<zmq::Socket>>>>,
}

impl std::fmt::Debug for PushPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushPool")
            .field("endpoints", &self.sockets.lock().len())
            .finish()
    }
}

impl PushPool {
    /// A pool whose sends give up after `send_timeout` (zmq `SNDTIMEO`).
    pub fn new(context: zmq::Context, send_timeout: Duration) -> Self {
        Self {
            context,
            send_timeout,
            sockets: Mutex::new(HashMap::new()),
        }
    }

    fn socket(&self, endpoint: &str) -> Result<Arc<Mutex<zmq::Socket>>, ControlError> {
        let mut sockets = self.sockets.lock();
        if let Some(s) = sockets.get(endpoint) {
            return Ok(s.clone());
        }
        let socket = self
            .context
            .socket(zmq::PUSH)
            .map_err(zmq_err("socket", endpoint))?;
        if endpoint.contains('[') {
            socket
                .set_ipv6(true)
                .map_err(zmq_err("set_ipv6", endpoint))?;
        }
        let ms = i32::try_from(self.send_timeout.as_millis()).unwrap_or(i32::MAX);
        socket
            .set_sndtimeo(ms)
            .map_err(zmq_err("set_sndtimeo", endpoint))?;
        socket
            .set_linger(0)
            .map_err(zmq_err("set_linger", endpoint))?;
        socket
            .set_tcp_keepalive(1)
            .map_err(zmq_err("set_tcp_keepalive", endpoint))?;
        socket
            .connect(endpoint)
            .map_err(zmq_err("connect", endpoint))?;
        let socket = Arc::new(Mutex::new(socket));
        sockets.insert(endpoint.to_owned(), socket.clone());
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

    /// Closes the socket to `endpoint` (a peer known to be gone).
    pub fn disconnect(&self, endpoint: &str) {
        self.sockets.lock().remove(endpoint);
    }

    /// Closes every socket.
    pub fn close_all(&self) {
        self.sockets.lock().clear();
    }
}
