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

/// What a client announces about itself in its hello: bound into its
/// proof, so that in secret mode nobody can alter it in transit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Announce<'a> {
    /// The client engine's incarnation.
    pub incarnation: u64,
    /// The client engine's session id.
    pub session: &'a str,
}

/// The client's MAC: the server's nonce (freshness), its own nonce and the
/// server's incarnation; with an announcement (engine wire v2) also the
/// client's incarnation and session id, under another label.
fn client_mac(
    secret: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    announce: Option<Announce<'_>>,
) -> HmacSha256 {
    let inc = incarnation.to_le_bytes();
    let Some(a) = announce else {
        return mac(secret, CLIENT_LABEL, &[server_nonce, client_nonce, &inc]);
    };
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

/// The server's MAC: the client's nonce (freshness), its own nonce and its incarnation.
fn server_mac(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
) -> HmacSha256 {
    let inc = incarnation.to_le_bytes();
    mac(secret, SERVER_LABEL, &[client_nonce, server_nonce, &inc])
}

/// The client's proof (see [`client_mac`] for what it binds).
pub(crate) fn client_proof(
    secret: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    announce: Option<Announce<'_>>,
) -> [u8; NONCE_LEN] {
    client_mac(secret, server_nonce, client_nonce, incarnation, announce)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a client proof made by [`client_proof`].
pub(crate) fn verify_client(
    secret: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    announce: Option<Announce<'_>>,
    proof: &[u8; NONCE_LEN],
) -> bool {
    client_mac(secret, server_nonce, client_nonce, incarnation, announce)
        .verify_slice(proof)
        .is_ok()
}

/// The server's proof: binds the client's nonce (freshness), its own nonce and the incarnation.
pub(crate) fn server_proof(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
) -> [u8; NONCE_LEN] {
    server_mac(secret, client_nonce, server_nonce, incarnation)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a server proof.
pub(crate) fn verify_server(
    secret: &[u8],
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
    incarnation: u64,
    proof: &[u8; NONCE_LEN],
) -> bool {
    server_mac(secret, client_nonce, server_nonce, incarnation)
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
        let p = client_proof(b"s3cret", &sn, &cn, 5, None);
        assert!(verify_client(b"s3cret", &sn, &cn, 5, None, &p));
        assert!(!verify_client(b"other", &sn, &cn, 5, None, &p));
        assert!(!verify_client(b"s3cret", &cn, &sn, 5, None, &p));
        assert!(!verify_client(b"s3cret", &sn, &cn, 6, None, &p));
        let q = server_proof(b"s3cret", &cn, &sn, 5);
        assert!(verify_server(b"s3cret", &cn, &sn, 5, &q));
        assert!(
            !verify_client(b"s3cret", &sn, &cn, 5, None, &q),
            "labels differ"
        );
    }

    #[test]
    fn the_announcement_is_covered_by_the_client_proof() {
        let (cn, sn) = (nonce(), nonce());
        let a = Announce {
            incarnation: 9,
            session: "10.0.0.1:7000",
        };
        let p = client_proof(b"s3cret", &sn, &cn, 5, Some(a));
        assert!(verify_client(b"s3cret", &sn, &cn, 5, Some(a), &p));
        let other_session = Announce {
            session: "10.0.0.2:7000",
            ..a
        };
        assert!(!verify_client(
            b"s3cret",
            &sn,
            &cn,
            5,
            Some(other_session),
            &p
        ));
        let other_incarnation = Announce {
            incarnation: 10,
            ..a
        };
        assert!(!verify_client(
            b"s3cret",
            &sn,
            &cn,
            5,
            Some(other_incarnation),
            &p
        ));
        assert!(!verify_client(b"other", &sn, &cn, 5, Some(a), &p));
        assert!(
            !verify_client(b"s3cret", &sn, &cn, 5, None, &p),
            "labels differ"
        );
    }
}
