//! Connection set-up, both sides: hello (with the client's announcement of
//! its session id and incarnation), challenge, proof, verdict. The whole
//! exchange must finish within the connect timeout (a total deadline, not
//! one per read), and nothing but the handshake is read or answered before
//! the verdict: in secret mode a client that did not prove the secret gets
//! the challenge and a refusal, nothing else.

use std::os::fd::RawFd;
use std::time::Instant;

use super::stats::bump;
use super::{Inner, TransferError};
use crate::ErrorKind;
use crate::session::auth::{self, Announce};
use crate::session::handshake::{self, Proto};
use crate::session::io::{self, Budget};
use crate::session::wire::{self, Hello};

/// The engine wire's handshake.
const ENGINE: Proto = Proto {
    magic: wire::MAGIC,
    version: wire::VERSION,
    peer: "tcp engine",
    versioned: "protocol",
};

/// The peer at the other end of an accepted connection, as it announced
/// itself (covered by its proof in secret mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerId {
    /// Its session id (`host:port`).
    pub session: String,
    /// Its incarnation.
    pub incarnation: u64,
}

/// Why the server side of a handshake ended without a usable connection.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// Refused (and counted) by us: bad hello, version, proof or fenced.
    Refused,
    /// The connection failed (timed out, closed, aborted by shutdown).
    Io(std::io::Error),
}

impl From<std::io::Error> for Refusal {
    fn from(e: std::io::Error) -> Self {
        Refusal::Io(e)
    }
}

/// Count a malformed (or other-version) hello and log it (rate-limited).
fn bad_hello(inner: &Inner, what: &str) -> Refusal {
    bump(&inner.stats.bad_frames);
    if let Some(suppressed) = inner.stats.log_bad_frame.hit() {
        tracing::warn!(
            what,
            suppressed,
            "connection with a malformed hello dropped"
        );
    }
    Refusal::Refused
}

/// Server side: by `deadline`, the peer proves itself (in secret mode) and
/// is not fenced. Admission into [`super::fence::Fences`] is the caller's.
pub(crate) fn server(inner: &Inner, fd: RawFd, deadline: Instant) -> Result<PeerId, Refusal> {
    let stop = || inner.is_shutdown();
    let mut b = Budget::new(deadline, inner.cfg.connect_timeout(), &stop);
    let mut hb = [0u8; wire::HELLO_LEN];
    io::read_exact_by(fd, &mut hb, &mut b)?;
    let Some((version, flags, client_nonce)) = Hello::decode_prefix(&hb) else {
        return Err(bad_hello(inner, "no kvbridge magic"));
    };
    let secret = inner.secret.as_deref();
    let ch = handshake::challenge(ENGINE, secret, inner.incarnation, flags, &client_nonce);
    if version != wire::VERSION {
        // Its hello may be laid out differently: answer with our version
        // (the client reports the mismatch) and read nothing more.
        io::write_all_by(fd, &ch.encode(), &mut b)?;
        return Err(bad_hello(inner, "another protocol version"));
    }
    let mut ab = [0u8; wire::ANNOUNCE_LEN];
    io::read_exact_by(fd, &mut ab, &mut b)?;
    let Some((incarnation, len)) = Hello::decode_announce(&ab) else {
        return Err(bad_hello(inner, "bad session id length"));
    };
    let mut sb = vec![0u8; len];
    io::read_exact_by(fd, &mut sb, &mut b)?;
    let Ok(session) = String::from_utf8(sb) else {
        return Err(bad_hello(inner, "session id is not UTF-8"));
    };
    io::write_all_by(fd, &ch.encode(), &mut b)?;
    let mut rb = [0u8; wire::RESPONSE_LEN];
    io::read_exact_by(fd, &mut rb, &mut b)?;
    let announce = Announce {
        incarnation,
        session: &session,
    };
    if let Some(s) = secret
        && !handshake::verify(s, &ch, &client_nonce, Some(announce), &rb)
    {
        bump(&inner.stats.auth_failures);
        if let Some(suppressed) = inner.stats.log_auth.hit() {
            tracing::warn!(
                claimed = %session,
                suppressed,
                "data connection failed cluster-secret authentication; dropped"
            );
        }
        io::write_all_by(fd, &wire::encode_verdict(wire::VERDICT_AUTH), &mut b)?;
        return Err(Refusal::Refused);
    }
    Ok(PeerId {
        session,
        incarnation,
    })
}

/// Send the final verdict of an accepted handshake (`VERDICT_OK` or
/// `VERDICT_FENCED`) within `deadline`.
pub(crate) fn verdict(
    inner: &Inner,
    fd: RawFd,
    deadline: Instant,
    status: u32,
) -> std::io::Result<()> {
    let stop = || inner.is_shutdown();
    let mut b = Budget::new(deadline, inner.cfg.connect_timeout(), &stop);
    io::write_all_by(fd, &wire::encode_verdict(status), &mut b)
}

/// Client side, on a connected socket: announce ourselves, check the
/// server's proof, prove ourselves; the peer's incarnation.
pub(crate) fn client(inner: &Inner, session: &str, fd: RawFd) -> Result<u64, TransferError> {
    let err = |kind, d: String| TransferError::new(session, None, kind, d);
    let io_err = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::TimedOut {
            err(
                ErrorKind::Timeout,
                "handshake not done within the connect timeout".into(),
            )
        } else {
            TransferError::from_io(session, None, &e)
        }
    };
    let stop = || inner.is_shutdown();
    let timeout = inner.cfg.connect_timeout();
    let mut b = Budget::new(Instant::now() + timeout, timeout, &stop);
    let secret = inner.secret.as_deref();
    let hello = Hello {
        version: wire::VERSION,
        flags: handshake::flags(secret),
        nonce: auth::nonce(),
        incarnation: inner.incarnation,
        session: inner.session.clone(),
    };
    io::write_all_by(fd, &hello.encode(), &mut b).map_err(io_err)?;
    let mut cb = [0u8; wire::CHALLENGE_LEN];
    io::read_exact_by(fd, &mut cb, &mut b).map_err(io_err)?;
    let announce = Announce {
        incarnation: inner.incarnation,
        session: &inner.session,
    };
    let (ch, proof) =
        handshake::respond(ENGINE, session, secret, &hello.nonce, &cb, Some(announce))?;
    io::write_all_by(fd, &proof, &mut b).map_err(io_err)?;
    let mut vb = [0u8; wire::VERDICT_LEN];
    io::read_exact_by(fd, &mut vb, &mut b).map_err(|e| {
        if ch.flags & wire::FLAG_SECRET != 0 && secret.is_none() {
            err(ErrorKind::Auth, "peer requires a cluster secret".into())
        } else {
            io_err(e)
        }
    })?;
    match wire::decode_verdict(&vb) {
        wire::VERDICT_OK => Ok(ch.incarnation),
        wire::VERDICT_AUTH => Err(err(
            ErrorKind::Auth,
            "peer refused our cluster secret proof".into(),
        )),
        wire::VERDICT_FENCED => Err(err(
            ErrorKind::Refused,
            format!(
                "peer has fenced this engine ({}): it accepts no writes from it",
                inner.session
            ),
        )),
        v => Err(err(
            ErrorKind::Refused,
            format!("peer refused the connection ({v})"),
        )),
    }
}
