//! Connection set-up authentication: HMAC-SHA256 challenge-response over
//! fresh nonces from both sides. The secret never goes on the wire, a
//! recorded exchange cannot be replayed (the other side's nonce changes), and
//! each side proves itself to the other (the client does not hand KV data to
//! an impostor receiver, the server does not accept writes from a stranger).

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::wire::NONCE_LEN;

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"kvbridge-tcp/1 client";
const SERVER_LABEL: &[u8] = b"kvbridge-tcp/1 server";
/// Label of the engine wire v2 client proof, which also covers the
/// client's announcement (its incarnation and session id).
const CLIENT_LABEL_V2: &[u8] = b"kvbridge-tcp/2 client";

/// A fresh random nonce.
pub(crate) fn nonce() -> [u8; NONCE_LEN] {
    rand::random()
}

fn mac(secret: &[u8], label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

fn parts<'a>(first: &'a [u8], second: &'a [u8], inc: &'a [u8; 8]) -> [&'a [u8]; 3] {
    [first, second, inc]
}

/// The client's proof: binds the server's nonce (freshness), its own nonce and the incarnation.
pub(crate) fn client_proof(
    secret: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
) -> [u8; NONCE_LEN] {
    let inc = incarnation.to_le_bytes();
    mac(
        secret,
        CLIENT_LABEL,
        &parts(server_nonce, client_nonce, &inc),
    )
    .finalize()
    .into_bytes()
    .into()
}

/// The server's proof: binds the client's nonce (freshness), its own nonce and the incarnation.
pub(crate) fn server_proof(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
) -> [u8; NONCE_LEN] {
    let inc = incarnation.to_le_bytes();
    mac(
        secret,
        SERVER_LABEL,
        &parts(client_nonce, server_nonce, &inc),
    )
    .finalize()
    .into_bytes()
    .into()
}

/// Constant-time check of a client proof.
pub(crate) fn verify_client(
    secret: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    proof: &[u8; NONCE_LEN],
) -> bool {
    let inc = incarnation.to_le_bytes();
    mac(
        secret,
        CLIENT_LABEL,
        &parts(server_nonce, client_nonce, &inc),
    )
    .verify_slice(proof)
    .is_ok()
}

/// What a client announces about itself in its hello: bound into its
/// proof, so that in secret mode nobody can alter it in transit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Announce<'a> {
    /// The client engine's incarnation.
    pub incarnation: u64,
    /// The client engine's session id.
    pub session: &'a str,
}

fn announced_mac(
    secret: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    a: Announce<'_>,
) -> HmacSha256 {
    let inc = incarnation.to_le_bytes();
    let client_inc = a.incarnation.to_le_bytes();
    // Fixed-size fields, then the length-prefixed session id: unambiguous.
    let len = (a.session.len() as u64).to_le_bytes();
    mac(
        secret,
        CLIENT_LABEL_V2,
        &[
            server_nonce,
            client_nonce,
            &inc,
            &client_inc,
            &len,
            a.session.as_bytes(),
        ],
    )
}

/// The client's proof (wire v2): as [`client_proof`], also covering its announcement.
pub(crate) fn client_proof_announced(
    secret: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    announce: Announce<'_>,
) -> [u8; NONCE_LEN] {
    announced_mac(secret, server_nonce, client_nonce, incarnation, announce)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a client proof made by [`client_proof_announced`].
pub(crate) fn verify_client_announced(
    secret: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    announce: Announce<'_>,
    proof: &[u8; NONCE_LEN],
) -> bool {
    announced_mac(secret, server_nonce, client_nonce, incarnation, announce)
        .verify_slice(proof)
        .is_ok()
}

/// Constant-time check of a server proof.
pub(crate) fn verify_server(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    proof: &[u8; NONCE_LEN],
) -> bool {
    let inc = incarnation.to_le_bytes();
    mac(
        secret,
        SERVER_LABEL,
        &parts(client_nonce, server_nonce, &inc),
    )
    .verify_slice(proof)
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_secret_and_nonces() {
        let (cn, sn) = (nonce(), nonce());
        assert_ne!(cn, sn);
        let p = client_proof(b"s3cret", &sn, &cn, 5);
        assert!(verify_client(b"s3cret", &sn, &cn, 5, &p));
        assert!(!verify_client(b"other", &sn, &cn, 5, &p));
        assert!(!verify_client(b"s3cret", &cn, &sn, 5, &p));
        assert!(!verify_client(b"s3cret", &sn, &cn, 6, &p));
        let q = server_proof(b"s3cret", &cn, &sn, 5);
        assert!(verify_server(b"s3cret", &cn, &sn, 5, &q));
        assert!(!verify_client(b"s3cret", &sn, &cn, 5, &q), "labels differ");
    }

    #[test]
    fn the_announcement_is_covered_by_the_client_proof() {
        let (cn, sn) = (nonce(), nonce());
        let a = Announce {
            incarnation: 9,
            session: "10.0.0.1:7000",
        };
        let p = client_proof_announced(b"s3cret", &sn, &cn, 5, a);
        assert!(verify_client_announced(b"s3cret", &sn, &cn, 5, a, &p));
        let other_session = Announce {
            session: "10.0.0.2:7000",
            ..a
        };
        assert!(!verify_client_announced(
            b"s3cret",
            &sn,
            &cn,
            5,
            other_session,
            &p
        ));
        let other_incarnation = Announce {
            incarnation: 10,
            ..a
        };
        assert!(!verify_client_announced(
            b"s3cret",
            &sn,
            &cn,
            5,
            other_incarnation,
            &p
        ));
        assert!(!verify_client_announced(b"other", &sn, &cn, 5, a, &p));
        assert!(!verify_client(b"s3cret", &sn, &cn, 5, &p), "labels differ");
    }
}
