//! Signed bootstrap writes (secret mode): the one helper both sides use, the
//! prefill's registration client to sign and the bootstrap server to check.
//!
//! A write carries three headers:
//!
//! * `X-Kvbridge-Time`: the sender's clock, unix seconds (decimal);
//! * `X-Kvbridge-Nonce`: 16 to 64 hex digits, fresh per request;
//! * `X-Kvbridge-Auth`: 64 hex digits, HMAC-SHA256 under the key
//!   `secret.derive("bootstrap")` of
//!   `"kvbridge/1 bootstrap write\n" METHOD "\n" PATH "\n" TIME "\n" NONCE "\n" BODY`,
//!   where PATH is the request target as sent (path and query) and BODY the
//!   exact body bytes.
//!
//! The server refuses a write whose time is more than [`MAX_CLOCK_SKEW`] off
//! its own clock, and one whose tag it has already accepted within that
//! window (a replay).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvbridge_engine::ClusterSecret;
use kvbridge_engine::secret::{hex, unhex};
use thiserror::Error;

/// Header with the sender's unix time in seconds.
pub const TIME_HEADER: &str = "x-kvbridge-time";
/// Header with the request's nonce (hex).
pub const NONCE_HEADER: &str = "x-kvbridge-nonce";
/// Header with the request's tag (hex HMAC-SHA256).
pub const AUTH_HEADER: &str = "x-kvbridge-auth";
/// Largest difference between the sender's time and the server's.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(300);
/// The label of the key derived from the cluster secret for bootstrap writes.
pub const KEY_LABEL: &str = "bootstrap";
/// Most accepted tags remembered against replays; beyond, writes get 503.
pub const MAX_REMEMBERED_TAGS: usize = 65536;

const DOMAIN: &[u8] = b"kvbridge/1 bootstrap write\n";

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
    /// The same signed request was already accepted.
    #[error("replayed request")]
    Replayed,
    /// Too many recent writes to remember (the server answers 503).
    #[error("too many recent signed writes to remember; retry later")]
    Busy,
}

/// The three headers of a signed write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedHeaders {
    /// `X-Kvbridge-Time`.
    pub time: String,
    /// `X-Kvbridge-Nonce`.
    pub nonce: String,
    /// `X-Kvbridge-Auth`.
    pub auth: String,
}

impl SignedHeaders {
    /// `(name, value)` pairs, ready for an HTTP client.
    pub fn pairs(&self) -> [(&'static str, &str); 3] {
        [
            (TIME_HEADER, self.time.as_str()),
            (NONCE_HEADER, self.nonce.as_str()),
            (AUTH_HEADER, self.auth.as_str()),
        ]
    }
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

    fn parts<'a>(
        method: &'a str,
        path: &'a str,
        time: &'a str,
        nonce: &'a str,
        body: &'a [u8],
    ) -> [&'a [u8]; 10] {
        [
            DOMAIN,
            method.as_bytes(),
            b"\n",
            path.as_bytes(),
            b"\n",
            time.as_bytes(),
            b"\n",
            nonce.as_bytes(),
            b"\n",
            body,
        ]
    }

    /// Signs a write made now with a fresh nonce.
    pub fn sign(&self, method: &str, path: &str, body: &[u8]) -> SignedHeaders {
        self.sign_at(method, path, unix_now(), &fresh_nonce(), body)
    }

    /// Signs a write with the given time and nonce.
    pub fn sign_at(
        &self,
        method: &str,
        path: &str,
        time: u64,
        nonce: &str,
        body: &[u8],
    ) -> SignedHeaders {
        let time = time.to_string();
        let tag = self.key.tag(&Self::parts(method, path, &time, nonce, body));
        SignedHeaders {
            time,
            nonce: nonce.to_owned(),
            auth: hex(&tag),
        }
    }

    /// Checks a write's headers against its method, target and body at
    /// server time `now`; returns its tag and time (for the replay check).
    #[allow(clippy::too_many_arguments)]
    pub fn verify(
        &self,
        method: &str,
        path: &str,
        time: Option<&str>,
        nonce: Option<&str>,
        auth: Option<&str>,
        body: &[u8],
        now: u64,
    ) -> Result<([u8; 32], u64), AuthError> {
        let time = time.ok_or(AuthError::Missing(TIME_HEADER))?;
        let nonce = nonce.ok_or(AuthError::Missing(NONCE_HEADER))?;
        let auth = auth.ok_or(AuthError::Missing(AUTH_HEADER))?;
        if time.is_empty() || time.len() > 20 || !time.bytes().all(|b| b.is_ascii_digit()) {
            return Err(AuthError::Malformed(TIME_HEADER));
        }
        let sent: u64 = time
            .parse()
            .map_err(|_| AuthError::Malformed(TIME_HEADER))?;
        if !(16..=64).contains(&nonce.len()) || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(AuthError::Malformed(NONCE_HEADER));
        }
        let tag: [u8; 32] = unhex(auth)
            .and_then(|t| <[u8; 32]>::try_from(t).ok())
            .ok_or(AuthError::Malformed(AUTH_HEADER))?;
        if sent.abs_diff(now) > MAX_CLOCK_SKEW.as_secs() {
            return Err(AuthError::Skew { sent, now });
        }
        if !self
            .key
            .verify(&Self::parts(method, path, time, nonce, body), &tag)
        {
            return Err(AuthError::BadTag);
        }
        Ok((tag, sent))
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

    #[test]
    fn signed_writes_verify_and_tampering_fails() {
        let a = auth();
        let h = a.sign_at("PUT", "/route", 1000, "00112233445566778899", b"{}");
        let ok = |m: &str, p: &str, t: &str, b: &[u8], now: u64| {
            a.verify(m, p, Some(t), Some(&h.nonce), Some(&h.auth), b, now)
        };
        assert!(ok("PUT", "/route", "1000", b"{}", 1100).is_ok());
        assert_eq!(
            ok("POST", "/route", "1000", b"{}", 1000),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            ok("PUT", "/routes", "1000", b"{}", 1000),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            ok("PUT", "/route", "1001", b"{}", 1000),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            ok("PUT", "/route", "1000", b"{ }", 1000),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            ok("PUT", "/route", "1000", b"{}", 1000 + 301),
            Err(AuthError::Skew {
                sent: 1000,
                now: 1301
            })
        );
        assert_eq!(
            ok("PUT", "/route", "-5", b"{}", 1000),
            Err(AuthError::Malformed(TIME_HEADER))
        );
        let other = WriteAuth::new(
            &ClusterSecret::from_text("0123456789abcdef-other", "t")
                .unwrap_or_else(|e| panic!("secret: {e}")),
        );
        assert_eq!(
            other.verify(
                "PUT",
                "/route",
                Some("1000"),
                Some(&h.nonce),
                Some(&h.auth),
                b"{}",
                1000
            ),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            a.verify(
                "PUT",
                "/route",
                None,
                Some(&h.nonce),
                Some(&h.auth),
                b"{}",
                1000
            ),
            Err(AuthError::Missing(TIME_HEADER))
        );
        assert_eq!(
            a.verify(
                "PUT",
                "/route",
                Some("1000"),
                Some("xyz"),
                Some(&h.auth),
                b"{}",
                1000
            ),
            Err(AuthError::Malformed(NONCE_HEADER))
        );
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
