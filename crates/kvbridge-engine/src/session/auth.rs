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

/// What both proofs of one handshake bind: the two nonces (freshness), the
/// server's incarnation and, on the engine wire (v2), the client's
/// announcement (its client proof then takes another label).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Transcript<'a> {
    /// The server's nonce.
    pub server_nonce: &'a [u8; NONCE_LEN],
    /// The client's nonce.
    pub client_nonce: &'a [u8; NONCE_LEN],
    /// The server's incarnation.
    pub incarnation: u64,
    /// The client's announcement, when the protocol has one.
    pub announce: Option<Announce<'a>>,
}

impl Transcript<'_> {
    fn client_mac(&self, secret: &[u8]) -> HmacSha256 {
        let inc = self.incarnation.to_le_bytes();
        let (sn, cn) = (self.server_nonce, self.client_nonce);
        let Some(a) = self.announce else {
            return mac(secret, CLIENT_LABEL, &[sn, cn, &inc]);
        };
        let client_inc = a.incarnation.to_le_bytes();
        // Fixed-size fields, then the length-prefixed session id: unambiguous.
        let len = (a.session.len() as u64).to_le_bytes();
        let parts: [&[u8]; 6] = [sn, cn, &inc, &client_inc, &len, a.session.as_bytes()];
        mac(secret, CLIENT_LABEL_V2, &parts)
    }

    fn server_mac(&self, secret: &[u8]) -> HmacSha256 {
        let inc = self.incarnation.to_le_bytes();
        mac(
            secret,
            SERVER_LABEL,
            &[self.client_nonce, self.server_nonce, &inc],
        )
    }

    /// The client's proof.
    pub(crate) fn client_proof(&self, secret: &[u8]) -> [u8; NONCE_LEN] {
        self.client_mac(secret).finalize().into_bytes().into()
    }

    /// Constant-time check of a client proof.
    pub(crate) fn verify_client(&self, secret: &[u8], proof: &[u8; NONCE_LEN]) -> bool {
        self.client_mac(secret).verify_slice(proof).is_ok()
    }

    /// The server's proof.
    pub(crate) fn server_proof(&self, secret: &[u8]) -> [u8; NONCE_LEN] {
        self.server_mac(secret).finalize().into_bytes().into()
    }

    /// Constant-time check of a server proof.
    pub(crate) fn verify_server(&self, secret: &[u8], proof: &[u8; NONCE_LEN]) -> bool {
        self.server_mac(secret).verify_slice(proof).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t<'a>(
        server_nonce: &'a [u8; NONCE_LEN],
        client_nonce: &'a [u8; NONCE_LEN],
        incarnation: u64,
        announce: Option<Announce<'a>>,
    ) -> Transcript<'a> {
        Transcript {
            server_nonce,
            client_nonce,
            incarnation,
            announce,
        }
    }

    #[test]
    fn proofs_verify_only_with_the_same_secret_and_nonces() {
        let (cn, sn) = (nonce(), nonce());
        assert_ne!(cn, sn);
        let p = t(&sn, &cn, 5, None).client_proof(b"s3cret");
        assert!(t(&sn, &cn, 5, None).verify_client(b"s3cret", &p));
        assert!(!t(&sn, &cn, 5, None).verify_client(b"other", &p));
        assert!(!t(&cn, &sn, 5, None).verify_client(b"s3cret", &p));
        assert!(!t(&sn, &cn, 6, None).verify_client(b"s3cret", &p));
        let q = t(&sn, &cn, 5, None).server_proof(b"s3cret");
        assert!(t(&sn, &cn, 5, None).verify_server(b"s3cret", &q));
        assert!(
            !t(&sn, &cn, 5, None).verify_client(b"s3cret", &q),
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
        let p = t(&sn, &cn, 5, Some(a)).client_proof(b"s3cret");
        assert!(t(&sn, &cn, 5, Some(a)).verify_client(b"s3cret", &p));
        let other_session = Announce {
            session: "10.0.0.2:7000",
            ..a
        };
        assert!(!t(&sn, &cn, 5, Some(other_session)).verify_client(b"s3cret", &p));
        let other_incarnation = Announce {
            incarnation: 10,
            ..a
        };
        assert!(!t(&sn, &cn, 5, Some(other_incarnation)).verify_client(b"s3cret", &p));
        assert!(!t(&sn, &cn, 5, Some(a)).verify_client(b"other", &p));
        assert!(
            !t(&sn, &cn, 5, None).verify_client(b"s3cret", &p),
            "labels differ"
        );
    }
}
