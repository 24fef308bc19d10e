//! Socket-level security of the control plane: zmq CURVE with one key pair
//! derived from the cluster secret, so the frames themselves stay sglang's.
//!
//! Every cluster member derives the same key pair. A receiving (PULL)
//! socket is a CURVE server holding it; a sending (PUSH) socket is a CURVE
//! client that must know the server's public key, which is never sent on
//! the wire and can only be derived from the secret. On top of that a ZAP
//! handler admits only clients whose long-term key is the cluster key (the
//! client proves it holds the secret half in the handshake). Without the
//! secret a peer cannot complete the handshake, so nothing it sends reaches
//! an inbox; with it, every frame is encrypted and authenticated.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use kvbridge_engine::ClusterSecret;

use super::{ControlError, nacl, zmq_call};

/// The ZAP domain our server sockets name.
const ZAP_DOMAIN: &str = "kvbridge";
/// Where libzmq asks the ZAP handler of a context.
const ZAP_ENDPOINT: &str = "inproc://zeromq.zap.01";

/// The cluster's CURVE key pair.
#[derive(Clone, PartialEq, Eq)]
struct CurveKeys {
    public: [u8; 32],
    secret: [u8; 32],
}

/// How the control plane's sockets authenticate: CURVE with the cluster
/// key pair, or sglang-compatible open mode.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ControlSecurity {
    keys: Option<CurveKeys>,
}

impl std::fmt::Debug for ControlSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.keys.is_some() {
            "ControlSecurity(curve)"
        } else {
            "ControlSecurity(open)"
        })
    }
}

impl ControlSecurity {
    /// Open mode: no authentication (what stock sglang peers speak).
    pub fn open() -> Self {
        Self::default()
    }

    /// CURVE keys derived from `secret`; open mode when `None`.
    pub fn from_secret(secret: Option<&ClusterSecret>) -> Self {
        Self {
            keys: secret.map(|s| {
                let secret = s.derive("zmq-curve");
                CurveKeys {
                    public: nacl::public_key(&secret),
                    secret,
                }
            }),
        }
    }

    /// The cluster's CURVE public key (secret mode). Knowing it is not
    /// enough to connect: the ZAP handler also wants the secret half.
    pub fn public_key(&self) -> Option<[u8; 32]> {
        self.keys.as_ref().map(|k| k.public)
    }

    /// Whether sockets authenticate with the cluster secret.
    pub fn is_secret(&self) -> bool {
        self.keys.is_some()
    }

    /// Makes `socket` a CURVE server (a receiving socket).
    pub(super) fn apply_server(&self, socket: &zmq::Socket, at: &str) -> Result<(), ControlError> {
        let Some(k) = &self.keys else {
            return Ok(());
        };
        zmq_call!(socket.set_zap_domain(ZAP_DOMAIN), at)?;
        zmq_call!(socket.set_curve_server(true), at)?;
        zmq_call!(socket.set_curve_secretkey(&k.secret), at)
    }

    /// Makes `socket` a CURVE client of a cluster server (a sending socket).
    pub(super) fn apply_client(&self, socket: &zmq::Socket, at: &str) -> Result<(), ControlError> {
        let Some(k) = &self.keys else {
            return Ok(());
        };
        zmq_call!(socket.set_curve_serverkey(&k.public), at)?;
        zmq_call!(socket.set_curve_publickey(&k.public), at)?;
        zmq_call!(socket.set_curve_secretkey(&k.secret), at)
    }
}

/// A zmq context with, in secret mode, its ZAP handler thread; the handler
/// stops (and its socket closes) before the context is dropped.
pub struct ControlContext {
    context: zmq::Context,
    security: ControlSecurity,
    zap: Option<Zap>,
    refused: Arc<AtomicU64>,
}

struct Zap {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlContext")
            .field("security", &self.security)
            .field("refused", &self.refused.load(Ordering::Relaxed))
            .finish()
    }
}

impl ControlContext {
    /// A context for `security`; in secret mode its ZAP handler is running
    /// before this returns, so no connection is ever admitted unchecked.
    pub fn new(security: ControlSecurity) -> Result<Self, ControlError> {
        nacl::link();
        let context = zmq::Context::new();
        let refused = Arc::new(AtomicU64::new(0));
        let zap = match &security.keys {
            None => None,
            Some(keys) => {
                if !zmq::has("curve").unwrap_or(false) {
                    return Err(ControlError::NoCurve);
                }
                let socket = zmq_call!(context.socket(zmq::REP), ZAP_ENDPOINT)?;
                zmq_call!(socket.set_linger(0), ZAP_ENDPOINT)?;
                zmq_call!(socket.bind(ZAP_ENDPOINT), ZAP_ENDPOINT)?;
                let stop = Arc::new(AtomicBool::new(false));
                let (s, r, public) = (stop.clone(), refused.clone(), keys.public);
                let thread = std::thread::Builder::new()
                    .name("kvb-zap".into())
                    .spawn(move || serve_zap(&socket, &public, &s, &r))
                    .map_err(ControlError::Thread)?;
                Some(Zap {
                    stop,
                    thread: Some(thread),
                })
            }
        };
        Ok(Self {
            context,
            security,
            zap,
            refused,
        })
    }

    /// The zmq context.
    pub fn context(&self) -> &zmq::Context {
        &self.context
    }

    /// How sockets of this context authenticate.
    pub fn security(&self) -> &ControlSecurity {
        &self.security
    }

    /// Connections the ZAP handler refused (wrong or missing cluster key).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Drop for ControlContext {
    fn drop(&mut self) {
        if let Some(zap) = &mut self.zap {
            zap.stop.store(true, Ordering::SeqCst);
            if let Some(t) = zap.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// Answers ZAP requests (RFC 27) until `stop`: admits CURVE clients whose
/// long-term public key is the cluster key, refuses everything else.
fn serve_zap(socket: &zmq::Socket, public: &[u8; 32], stop: &AtomicBool, refused: &AtomicU64) {
    while !stop.load(Ordering::SeqCst) {
        match socket.poll(zmq::POLLIN, 100) {
            Ok(0) | Err(zmq::Error::EINTR) => continue,
            Ok(_) => {}
            Err(_) => return,
        }
        let frames = match socket.recv_multipart(zmq::DONTWAIT) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => continue,
            Err(_) => return,
        };
        let request_id = frames.get(1).cloned().unwrap_or_default();
        let admitted = frames.first().map(Vec::as_slice) == Some(b"1.0")
            && frames.get(5).map(Vec::as_slice) == Some(b"CURVE")
            && frames.get(6).map(Vec::as_slice) == Some(public.as_slice());
        if !admitted {
            let n = refused.fetch_add(1, Ordering::Relaxed);
            let address = frames
                .get(3)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .unwrap_or_default();
            if n.is_power_of_two() || n == 0 {
                tracing::warn!(
                    %address,
                    refused = n + 1,
                    "control-plane connection without the cluster key refused"
                );
            }
        }
        let (code, text): (&[u8], &[u8]) = if admitted {
            (b"200", b"OK")
        } else {
            (b"400", b"not a cluster member")
        };
        let reply: [&[u8]; 6] = [b"1.0", &request_id, code, text, b"", b""];
        if let Err(e) = socket.send_multipart(reply, 0) {
            tracing::debug!(error = %e, "cannot answer a ZAP request");
        }
    }
}
