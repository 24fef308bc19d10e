//! The authenticated handshake every transport runs when a connection is
//! set up, minus the transport's own framing around it:
//!
//! ```text
//! C->S Hello      magic | version u16 | flags u16 | client nonce [32] | (transport's announcement)
//! S->C Challenge  magic | version u16 | flags u16 | incarnation u64 | server nonce [32] | server proof [32]
//! C->S Response   client proof [32] | (transport's request)
//! ```
//!
//! With a cluster secret both sides prove it (HMAC over both nonces and
//! the server's incarnation; [`auth`]); the server proves itself first,
//! only to a client that says it holds the secret, and a client checks that
//! proof before it proves itself. An announcement of the client (its
//! session id and incarnation) is bound into its proof when given.
//!
//! **Never:** reads or writes a socket (callers do, within their
//! deadlines), or accepts a proof it did not check in constant time.

use super::auth::{self, Announce, Transcript};
use super::wire::{Challenge, FLAG_SECRET, NONCE_LEN};
use crate::{ErrorKind, TransferError};

/// One handshake protocol: the magic both messages open with, the version
/// spoken, and how errors name the peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Proto {
    /// First bytes of the hello and the challenge.
    pub magic: [u8; 4],
    /// The version this side speaks.
    pub version: u16,
    /// What the peer must be ("tcp engine"), for errors.
    pub peer: &'static str,
    /// What the version numbers ("protocol"), for errors.
    pub versioned: &'static str,
}

/// The flags of a side that holds `secret` (or none).
pub(crate) fn flags(secret: Option<&[u8]>) -> u16 {
    if secret.is_some() { FLAG_SECRET } else { 0 }
}

/// Server side: the challenge answering a hello with `client_flags` and
/// `client_nonce`: a fresh nonce and, when both sides hold a secret, the
/// server's proof (zeros otherwise).
pub(crate) fn challenge(
    proto: Proto,
    secret: Option<&[u8]>,
    incarnation: u64,
    client_flags: u16,
    client_nonce: &[u8; NONCE_LEN],
) -> Challenge {
    let nonce = auth::nonce();
    let transcript = Transcript {
        server_nonce: &nonce,
        client_nonce,
        incarnation,
        announce: None,
    };
    let proof = match secret {
        Some(s) if client_flags & FLAG_SECRET != 0 => transcript.server_proof(s),
        _ => [0u8; NONCE_LEN],
    };
    Challenge {
        version: proto.version,
        flags: flags(secret),
        incarnation,
        nonce,
        proof,
    }
}

/// Server side: whether the client's `proof` answers challenge `ch` (sent
/// to a hello with `client_nonce`), covering `announce` when given.
/// Constant time.
pub(crate) fn verify(
    secret: &[u8],
    ch: &Challenge,
    client_nonce: &[u8; NONCE_LEN],
    announce: Option<Announce<'_>>,
    proof: &[u8; NONCE_LEN],
) -> bool {
    let transcript = Transcript {
        server_nonce: &ch.nonce,
        client_nonce,
        incarnation: ch.incarnation,
        announce,
    };
    transcript.verify_client(secret, proof)
}

/// Client side: decode the server's challenge (to our hello with
/// `hello_nonce`), check its version and, with a secret, its proof; the
/// challenge and our proof (zeros without a secret), covering `announce`
/// when given.
pub(crate) fn respond(
    proto: Proto,
    session: &str,
    secret: Option<&[u8]>,
    hello_nonce: &[u8; NONCE_LEN],
    challenge: &[u8; super::wire::CHALLENGE_LEN],
    announce: Option<Announce<'_>>,
) -> Result<(Challenge, [u8; NONCE_LEN]), TransferError> {
    let err = |kind, d: String| TransferError::new(session, None, kind, d);
    let ch = Challenge::decode_as(proto.magic, challenge).ok_or_else(|| {
        err(
            ErrorKind::Refused,
            format!("peer is not a kvbridge {}", proto.peer),
        )
    })?;
    if ch.version != proto.version {
        return Err(err(
            ErrorKind::Refused,
            format!(
                "peer speaks {} version {}, we speak {}",
                proto.versioned, ch.version, proto.version
            ),
        ));
    }
    let Some(s) = secret else {
        return Ok((ch, [0u8; NONCE_LEN]));
    };
    if ch.flags & FLAG_SECRET == 0 {
        return Err(err(ErrorKind::Auth, "peer has no cluster secret".into()));
    }
    let transcript = Transcript {
        server_nonce: &ch.nonce,
        client_nonce: hello_nonce,
        incarnation: ch.incarnation,
        announce,
    };
    if !transcript.verify_server(s, &ch.proof) {
        return Err(err(
            ErrorKind::Auth,
            "peer failed to prove the cluster secret".into(),
        ));
    }
    let proof = transcript.client_proof(s);
    Ok((ch, proof))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Proto = Proto {
        magic: *b"TEST",
        version: 3,
        peer: "test peer",
        versioned: "test",
    };

    #[test]
    fn both_sides_prove_the_secret() {
        let cn = auth::nonce();
        let ann = Announce {
            incarnation: 4,
            session: "h:1",
        };
        let ch = challenge(P, Some(b"s"), 9, FLAG_SECRET, &cn);
        let (back, proof) = respond(P, "x", Some(b"s"), &cn, &ch.encode_as(P.magic), Some(ann))
            .expect("same secret");
        assert_eq!(back, ch);
        assert!(verify(b"s", &ch, &cn, Some(ann), &proof));
        assert!(!verify(b"s", &ch, &cn, None, &proof));
        let e = respond(P, "x", Some(b"t"), &cn, &ch.encode_as(P.magic), None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Auth);
        let open = challenge(P, None, 9, FLAG_SECRET, &cn);
        let e = respond(P, "x", Some(b"s"), &cn, &open.encode_as(P.magic), None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Auth);
        let e = respond(P, "x", None, &cn, &ch.encode_as(*b"XXXX"), None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Refused);
        // No proof for a client that claims no secret.
        assert_eq!(challenge(P, Some(b"s"), 9, 0, &cn).proof, [0u8; NONCE_LEN]);
    }
}
