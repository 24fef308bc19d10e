//! Signed bootstrap writes (secret mode): the one helper both sides use, the
//! prefill's registration client to sign and the bootstrap server to check.
//!
//! A write carries five headers:
//!
//! * `X-Kvbridge-Server`: the instance id of the bootstrap server the write
//!   is for, as that server announces it on every answer (the same header);
//! * `X-Kvbridge-Time`: the sender's clock, unix seconds (decimal);
//! * `X-Kvbridge-Nonce`: 16 to 64 hex digits, fresh per request;
//! * `X-Kvbridge-Body-Sha256`: 64 hex digits, SHA-256 of the exact body;
//! * `X-Kvbridge-Auth`: 64 hex digits, HMAC-SHA256 under the key
//!   `secret.derive("bootstrap")` of
//!   `"kvbridge/2 bootstrap write\n" METHOD "\n" PATH "\n" SERVER "\n" TIME "\n" NONCE "\n" BODY-SHA256`,
//!   where PATH is the request target as sent (path and query).
//!
//! The tag covers the headers only, so the server checks it before it reads
//! a byte of the body (a stranger's write is refused at its head), then
//! checks the body against its digest. It refuses a write signed for
//! another server instance (another server of the cluster, or this one
//! before a restart), one whose time is more than [`MAX_CLOCK_SKEW`] off its
//! own clock, and one whose tag it has already accepted (a replay).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvbridge_engine::ClusterSecret;
use kvbridge_engine::secret::{hex, unhex};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use thiserror::Error;

/// Header with the sender's unix time in seconds.
pub const TIME_HEADER: &str = "x-kvbridge-time";
/// Header with the request's nonce (hex).
pub const NONCE_HEADER: &str = "x-kvbridge-nonce";
/// Header with the request's tag (hex HMAC-SHA256).
pub const AUTH_HEADER: &str = "x-kvbridge-auth";
/// Header with the hex SHA-256 of the request's body.
pub const BODY_HEADER: &str = "x-kvbridge-body-sha256";
/// Header with a bootstrap server's instance id: on every answer, and on a
/// signed write (the instance it was signed for).
pub const SERVER_HEADER: &str = "x-kvbridge-server";
/// Largest difference between the sender's time and the server's.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(300);
/// The label of the key derived from the cluster secret for bootstrap writes.
pub const KEY_LABEL: &str = "bootstrap";
/// Most accepted tags remembered against replays; beyond, writes get 503.
pub const MAX_REMEMBERED_TAGS: usize = 65536;

const DOMAIN: &[u8] = b"kvbridge/2 bootstrap write\n";

/// Why a write's signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum AuthError {
    /// A header is absent.
    #[error("missing {0} header")]
    Missing(&'static str),
    /// A header is not in its format.
    #[error("malformed {0} header")]
    Malformed(&'static str),
    /// The time is too far from the server's clock.
    #[error("request time {sent} is more than {} s from the server's time {now}", MAX_CLOCK_SKEW.as_secs())]
    Skew {
        /// The time the request carries.
        sent: u64,
        /// The server's time.
        now: u64,
    },
    /// The tag does not match.
    #[error("bad signature")]
    BadTag,
    /// Signed for another bootstrap server instance (another server, or
    /// this one before a restart).
    #[error("signed for another bootstrap server instance")]
    OtherServer,
    /// The body is not the one the signature names.
    #[error("the body does not match its signed digest")]
    BodyMismatch,
    /// The same signed request was already accepted.
    #[error("replayed request")]
    Replayed,
    /// Too many recent writes to remember (the server answers 503).
    #[error("too many recent signed writes to remember; retry later")]
    Busy,
}

/// The headers of a signed write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedHeaders {
    /// `X-Kvbridge-Server`.
    pub server: String,
    /// `X-Kvbridge-Time`.
    pub time: String,
    /// `X-Kvbridge-Nonce`.
    pub nonce: String,
    /// `X-Kvbridge-Body-Sha256`.
    pub body_sha256: String,
    /// `X-Kvbridge-Auth`.
    pub auth: String,
}

impl SignedHeaders {
    /// `(name, value)` pairs, ready for an HTTP client.
    pub fn pairs(&self) -> [(&'static str, &str); 5] {
        [
            (SERVER_HEADER, self.server.as_str()),
            (TIME_HEADER, self.time.as_str()),
            (NONCE_HEADER, self.nonce.as_str()),
            (BODY_HEADER, self.body_sha256.as_str()),
            (AUTH_HEADER, self.auth.as_str()),
        ]
    }
}

/// A write's signature headers as received (absent ones `None`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Presented<'a> {
    /// `X-Kvbridge-Server`.
    pub server: Option<&'a str>,
    /// `X-Kvbridge-Time`.
    pub time: Option<&'a str>,
    /// `X-Kvbridge-Nonce`.
    pub nonce: Option<&'a str>,
    /// `X-Kvbridge-Body-Sha256`.
    pub body_sha256: Option<&'a str>,
    /// `X-Kvbridge-Auth`.
    pub auth: Option<&'a str>,
}

/// A write whose head verified: what its body and the replay check need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifiedHead {
    /// The write's tag (remembered against replays).
    pub tag: [u8; 32],
    /// The sender's time.
    pub sent: u64,
    body_sha256: [u8; 32],
}

impl VerifiedHead {
    /// Checks that `body` is the body the head was signed with.
    pub fn check_body(&self, body: &[u8]) -> Result<(), AuthError> {
        let digest: [u8; 32] = Sha256::digest(body).into();
        if bool::from(digest.ct_eq(&self.body_sha256)) {
            Ok(())
        } else {
            Err(AuthError::BodyMismatch)
        }
    }
}

/// A fresh random bootstrap server instance id (32 hex digits).
pub fn new_server_id() -> String {
    hex(&rand::random::<[u8; 16]>())
}

/// Signs and checks bootstrap writes with the key derived from the cluster
/// secret (redacted in `Debug`, as the secret).
#[derive(Debug, Clone)]
pub struct WriteAuth {
    key: ClusterSecret,
}

/// Seconds since the unix epoch by the local clock (0 before 1970).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A nonce unique to this process and call: pid, clock and a counter.
fn fresh_nonce() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{:08x}{nanos:016x}{n:08x}", std::process::id())
}

impl WriteAuth {
    /// The signer/checker for `secret`'s bootstrap key.
    pub fn new(secret: &ClusterSecret) -> Self {
        let key = ClusterSecret::new(secret.derive(KEY_LABEL).to_vec(), "bootstrap key")
            .unwrap_or_else(|_| unreachable!("a derived key has 32 bytes, a valid secret length"));
        Self { key }
    }

    fn parts<'a>(method: &'a str, path: &'a str, h: [&'a str; 4]) -> [&'a [u8]; 12] {
        let [server, time, nonce, body] = h;
        [
            DOMAIN,
            method.as_bytes(),
            b"\n",
            path.as_bytes(),
            b"\n",
            server.as_bytes(),
            b"\n",
            time.as_bytes(),
            b"\n",
            nonce.as_bytes(),
            b"\n",
            body.as_bytes(),
        ]
    }

    /// Signs a write made now with a fresh nonce, for server instance
    /// `server`.
    pub fn sign(&self, server: &str, method: &str, path: &str, body: &[u8]) -> SignedHeaders {
        self.sign_at(server, method, path, unix_now(), &fresh_nonce(), body)
    }

    /// Signs a write with the given time and nonce.
    pub fn sign_at(
        &self,
        server: &str,
        method: &str,
        path: &str,
        time: u64,
        nonce: &str,
        body: &[u8],
    ) -> SignedHeaders {
        let time = time.to_string();
        let body_sha256 = hex(&Sha256::digest(body));
        let tag = self.key.tag(&Self::parts(
            method,
            path,
            [server, &time, nonce, &body_sha256],
        ));
        SignedHeaders {
            server: server.to_owned(),
            time,
            nonce: nonce.to_owned(),
            body_sha256,
            auth: hex(&tag),
        }
    }

    /// Checks a write's head (its method, target and signature headers)
    /// for server instance `server` at server time `now`, before its body
    /// is read.
    pub fn verify_head(
        &self,
        server: &str,
        method: &str,
        path: &str,
        h: &Presented<'_>,
        now: u64,
    ) -> Result<VerifiedHead, AuthError> {
        let for_server = h.server.ok_or(AuthError::Missing(SERVER_HEADER))?;
        let time = h.time.ok_or(AuthError::Missing(TIME_HEADER))?;
        let nonce = h.nonce.ok_or(AuthError::Missing(NONCE_HEADER))?;
        let body = h.body_sha256.ok_or(AuthError::Missing(BODY_HEADER))?;
        let auth = h.auth.ok_or(AuthError::Missing(AUTH_HEADER))?;
        if time.is_empty() || time.len() > 20 || !time.bytes().all(|b| b.is_ascii_digit()) {
            return Err(AuthError::Malformed(TIME_HEADER));
        }
        let sent: u64 = time
            .parse()
            .map_err(|_| AuthError::Malformed(TIME_HEADER))?;
        if !(16..=64).contains(&nonce.len()) || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(AuthError::Malformed(NONCE_HEADER));
        }
        let digest = |v: &str| unhex(v).and_then(|t| <[u8; 32]>::try_from(t).ok());
        let tag = digest(auth).ok_or(AuthError::Malformed(AUTH_HEADER))?;
        let body_sha256 = digest(body).ok_or(AuthError::Malformed(BODY_HEADER))?;
        if sent.abs_diff(now) > MAX_CLOCK_SKEW.as_secs() {
            return Err(AuthError::Skew { sent, now });
        }
        if !self.key.verify(
            &Self::parts(method, path, [for_server, time, nonce, body]),
            &tag,
        ) {
            return Err(AuthError::BadTag);
        }
        // A genuine signature for another instance: a replay from
        // elsewhere, or a client that has not learnt our id yet.
        if for_server != server {
            return Err(AuthError::OtherServer);
        }
        Ok(VerifiedHead {
            tag,
            sent,
            body_sha256,
        })
    }

    /// [`WriteAuth::verify_head`] and [`VerifiedHead::check_body`] at once.
    pub fn verify(
        &self,
        server: &str,
        method: &str,
        path: &str,
        h: &Presented<'_>,
        body: &[u8],
        now: u64,
    ) -> Result<VerifiedHead, AuthError> {
        let head = self.verify_head(server, method, path, h, now)?;
        head.check_body(body)?;
        Ok(head)
    }
}

/// The tags of writes accepted within the clock-skew window.
#[derive(Debug, Default)]
pub struct ReplayGuard {
    seen: HashMap<[u8; 32], u64>,
}

impl ReplayGuard {
    /// Remembers `tag` (sent at `sent`), or refuses it as a replay; entries
    /// whose time is out of the window are forgotten first (a replay of
    /// them fails the time check).
    pub fn admit(&mut self, tag: [u8; 32], sent: u64, now: u64) -> Result<(), AuthError> {
        let window = MAX_CLOCK_SKEW.as_secs();
        if self.seen.contains_key(&tag) {
            return Err(AuthError::Replayed);
        }
        if self.seen.len() >= MAX_REMEMBERED_TAGS {
            self.seen.retain(|_, t| t.saturating_add(window) >= now);
            if self.seen.len() >= MAX_REMEMBERED_TAGS {
                return Err(AuthError::Busy);
            }
        }
        self.seen.insert(tag, sent);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> WriteAuth {
        let secret = ClusterSecret::from_text("0123456789abcdef-test", "t")
            .unwrap_or_else(|e| panic!("secret: {e}"));
        WriteAuth::new(&secret)
    }

    const SERVER: &str = "0123456789abcdef0123456789abcdef";

    fn presented(h: &SignedHeaders) -> Presented<'_> {
        Presented {
            server: Some(&h.server),
            time: Some(&h.time),
            nonce: Some(&h.nonce),
            body_sha256: Some(&h.body_sha256),
            auth: Some(&h.auth),
        }
    }

    #[test]
    fn signed_writes_verify_and_tampering_fails() {
        let a = auth();
        let h = a.sign_at(SERVER, "PUT", "/route", 1000, "00112233445566778899", b"{}");
        let p = presented(&h);
        let ok = |m: &str, path: &str, p: &Presented<'_>, b: &[u8], now: u64| {
            a.verify(SERVER, m, path, p, b, now).map(|_| ())
        };
        assert!(ok("PUT", "/route", &p, b"{}", 1100).is_ok());
        assert_eq!(
            ok("POST", "/route", &p, b"{}", 1000),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            ok("PUT", "/routes", &p, b"{}", 1000),
            Err(AuthError::BadTag)
        );
        let later = Presented {
            time: Some("1001"),
            ..p
        };
        assert_eq!(
            ok("PUT", "/route", &later, b"{}", 1000),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            ok("PUT", "/route", &p, b"{ }", 1000),
            Err(AuthError::BodyMismatch)
        );
        let body = hex(&Sha256::digest(b"{ }"));
        let rebodied = Presented {
            body_sha256: Some(&body),
            ..p
        };
        assert_eq!(
            ok("PUT", "/route", &rebodied, b"{ }", 1000),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            ok("PUT", "/route", &p, b"{}", 1000 + 301),
            Err(AuthError::Skew {
                sent: 1000,
                now: 1301
            })
        );
        let negative = Presented {
            time: Some("-5"),
            ..p
        };
        assert_eq!(
            ok("PUT", "/route", &negative, b"{}", 1000),
            Err(AuthError::Malformed(TIME_HEADER))
        );
        let other = WriteAuth::new(
            &ClusterSecret::from_text("0123456789abcdef-other", "t")
                .unwrap_or_else(|e| panic!("secret: {e}")),
        );
        assert_eq!(
            other
                .verify(SERVER, "PUT", "/route", &p, b"{}", 1000)
                .map(|_| ()),
            Err(AuthError::BadTag)
        );
        for missing in [
            Presented { time: None, ..p },
            Presented { server: None, ..p },
            Presented {
                body_sha256: None,
                ..p
            },
        ] {
            assert!(matches!(
                ok("PUT", "/route", &missing, b"{}", 1000),
                Err(AuthError::Missing(_))
            ));
        }
        let bad_nonce = Presented {
            nonce: Some("xyz"),
            ..p
        };
        assert_eq!(
            ok("PUT", "/route", &bad_nonce, b"{}", 1000),
            Err(AuthError::Malformed(NONCE_HEADER))
        );
    }

    #[test]
    fn a_write_signed_for_another_server_instance_is_refused() {
        let a = auth();
        let h = a.sign_at(SERVER, "PUT", "/route", 1000, "00112233445566778899", b"{}");
        let p = presented(&h);
        assert!(a.verify(SERVER, "PUT", "/route", &p, b"{}", 1000).is_ok());
        let other = new_server_id();
        assert_eq!(
            a.verify(&other, "PUT", "/route", &p, b"{}", 1000)
                .map(|_| ()),
            Err(AuthError::OtherServer)
        );
        // Re-addressing the write to the other instance breaks the tag.
        let moved = Presented {
            server: Some(&other),
            ..p
        };
        assert_eq!(
            a.verify(&other, "PUT", "/route", &moved, b"{}", 1000)
                .map(|_| ()),
            Err(AuthError::BadTag)
        );
        assert_ne!(new_server_id(), new_server_id());
    }

    #[test]
    fn replays_are_refused() {
        let mut g = ReplayGuard::default();
        assert_eq!(g.admit([1; 32], 100, 100), Ok(()));
        assert_eq!(g.admit([1; 32], 100, 150), Err(AuthError::Replayed));
        assert_eq!(g.admit([2; 32], 100, 150), Ok(()));
        assert_ne!(fresh_nonce(), fresh_nonce());
    }
}
