//! The session layer: what every transport shares, written once.
//!
//! * Session ids: `host:port` derived from the configuration
//!   ([`session_id`]) and resolved back to an address ([`resolve`]).
//! * The authenticated handshake ([`handshake`], [`auth`]): hello,
//!   challenge, proof; mutual HMAC-SHA256 over fresh nonces, the serving
//!   side's incarnation (and, on the engine wire, the client's announced
//!   session id and incarnation) bound into the proofs.
//! * The engine wire ([`wire`]): handshake messages, request headers,
//!   descriptors and acks; byte I/O on raw sockets with deadlines ([`io`]).
//! * The control protocol a peer uses to copy into our memory without a
//!   request per batch ([`control`], [`holds`]): export tables, leases,
//!   revocations and releases.
//! * The accept loop every transport's listener runs ([`server`]): the
//!   connection cap, the back-off when `accept` runs out of resources, a
//!   handler thread per connection; and the rate limit of repeated
//!   warnings ([`burst`]).
//!
//! **Owns:** these protocols and their limits. **Never:** knows which
//! transport moves the payload (TCP, CUDA IPC, UCX build on it; it imports
//! none of them), touches registered memory itself, or trusts a length or
//! proof from a peer before checking it.

pub(crate) mod auth;
pub(crate) mod burst;
pub(crate) mod control;
pub(crate) mod handshake;
pub(crate) mod holds;
pub(crate) mod io;
pub(crate) mod server;
pub(crate) mod wire;

use std::net::{SocketAddr, ToSocketAddrs};

use crate::{EngineConfig, ErrorKind, TransferError};

/// The session id (`host:port`) an engine listening on `port` with `cfg`
/// announces: `advertise_host`, else `listen_host`; an IPv6 host is
/// bracketed. Refused (`InvalidInput`) when that host is unspecified
/// (`0.0.0.0`, `::`): peers could not dial it.
pub(crate) fn session_id(cfg: &EngineConfig, port: u16) -> std::io::Result<String> {
    let host = cfg.advertise_host.as_deref().unwrap_or(&cfg.listen_host);
    if host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
    {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "listening on an unspecified address needs advertise_host",
        ));
    }
    Ok(if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

/// Parse and resolve a `host:port` session id.
pub(crate) fn resolve(session: &str) -> Result<SocketAddr, TransferError> {
    let bad = |d: &str| TransferError::new(session, None, ErrorKind::InvalidArgument, d);
    if !session.contains(':') {
        return Err(bad("session id is not host:port"));
    }
    session
        .to_socket_addrs()
        .map_err(|e| TransferError::new(session, None, ErrorKind::Unreachable, e.to_string()))?
        .next()
        .ok_or_else(|| bad("session id resolves to no address"))
}

/// The error of a call made after the engine shut down.
pub(crate) fn shutdown_error(session: &str) -> TransferError {
    TransferError::new(session, None, ErrorKind::Shutdown, "engine is shut down")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_are_derived_once() {
        let mut cfg = EngineConfig::default();
        assert_eq!(session_id(&cfg, 7).unwrap(), "127.0.0.1:7");
        cfg.listen_host = "0.0.0.0".into();
        assert!(session_id(&cfg, 7).is_err());
        cfg.advertise_host = Some("::1".into());
        assert_eq!(session_id(&cfg, 7).unwrap(), "[::1]:7");
        assert_eq!(
            resolve("nohost").unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert!(resolve("127.0.0.1:9").is_ok());
    }
}
