//! The opening of a `--listen` bench target's control connection: a
//! challenge-response over fresh nonces from both sides, keyed with a key
//! derived from the cluster secret for this channel alone, before the target
//! says anything about itself (its `READY` line names its buffer's address).
//! Without `--auth` the same lines run with no proofs (open mode).
//!
//! - target → initiator: `CHALLENGE <server nonce>`;
//! - initiator → target: `HELLO <client nonce> <proof | ->`;
//! - target → initiator: `DENIED <why>` and the end, or the `READY` line
//!   with the target's own proof as a fifth word (`-` in open mode).
//!
//! Every line is capped at [`MAX_LINE`] bytes, and the opening must finish
//! within [`HANDSHAKE_TIMEOUT`].

use std::io::{BufRead, Read};
use std::time::Duration;

use anyhow::{Result, bail};
use kvbridge_engine::ClusterSecret;
use kvbridge_engine::secret::{derive_key, hex};

/// Longest control line either side reads (commands are a few words).
pub(super) const MAX_LINE: u64 = 4096;

/// How long a connection may take to prove itself before it is dropped.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Purpose label of the control channel's key.
const KEY_LABEL: &str = "bench-control";

/// Nonce bytes.
const NONCE_LEN: usize = 32;

/// The control channel's key, if the bench runs with `--auth`.
#[derive(Clone)]
pub(super) struct ControlKey(Option<ClusterSecret>);

impl std::fmt::Debug for ControlKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ControlKey(secret)"
        } else {
            "ControlKey(open)"
        })
    }
}

impl ControlKey {
    /// The key derived from `secret` (the bench's `--auth` secret), or open mode.
    pub fn new(secret: Option<&str>) -> Result<Self> {
        let Some(s) = secret else {
            return Ok(Self(None));
        };
        let key = derive_key(s.as_bytes(), KEY_LABEL);
        Ok(Self(Some(ClusterSecret::new(
            key.to_vec(),
            "bench control key",
        )?)))
    }

    fn proof(&self, who: &[u8], first: &[u8], second: &[u8]) -> String {
        match &self.0 {
            Some(k) => hex(&k.tag(&[who, first, second])),
            None => "-".to_owned(),
        }
    }

    fn check(&self, who: &[u8], first: &[u8], second: &[u8], proof: &str) -> bool {
        match &self.0 {
            Some(k) => unhex(proof).is_some_and(|p| k.verify(&[who, first, second], &p)),
            None => true,
        }
    }
}

/// A fresh nonce, hex.
pub(super) fn nonce() -> String {
    hex(&rand::random::<[u8; NONCE_LEN]>())
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn nonce_bytes(s: &str) -> Option<Vec<u8>> {
    unhex(s).filter(|b| b.len() == NONCE_LEN)
}

/// Reads one line of at most [`MAX_LINE`] bytes (without its newline);
/// `None` at the end of input. A longer line is an error, not a buffer.
pub(super) fn read_line(reader: &mut impl BufRead) -> Result<Option<String>> {
    let mut buf = Vec::new();
    let n = reader
        .by_ref()
        .take(MAX_LINE + 1)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') && n as u64 > MAX_LINE {
        bail!("a control line longer than {MAX_LINE} bytes");
    }
    while matches!(buf.last(), Some(b'\n' | b'\r')) {
        buf.pop();
    }
    Ok(Some(String::from_utf8(buf)?))
}

/// The target's side: checks the `HELLO` answering `server_nonce`; `Ok`
/// with the target's proof for its `READY` line, or why it is refused.
pub(super) fn accept_hello(key: &ControlKey, server_nonce: &str, line: &str) -> Result<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let ["HELLO", client_nonce, proof] = words.as_slice() else {
        bail!("expected HELLO <nonce> <proof>");
    };
    let (Some(sn), Some(cn)) = (nonce_bytes(server_nonce), nonce_bytes(client_nonce)) else {
        bail!("a malformed nonce");
    };
    if !key.check(b"client", &sn, &cn, proof) {
        bail!(
            "the cluster secret proof did not verify (start both ends with the same --auth secret)"
        );
    }
    Ok(key.proof(b"server", &cn, &sn))
}

/// The initiator's side: its `HELLO` line for `challenge`, and the client
/// nonce to check the target's proof against.
pub(super) fn hello(key: &ControlKey, challenge: &str) -> Result<(String, String)> {
    let words: Vec<&str> = challenge.split_whitespace().collect();
    let ["CHALLENGE", server_nonce] = words.as_slice() else {
        bail!("the target did not open with a challenge: {challenge:?}");
    };
    let Some(sn) = nonce_bytes(server_nonce) else {
        bail!("the target's challenge is malformed");
    };
    let cn = nonce();
    let cn_bytes = nonce_bytes(&cn).unwrap_or_default();
    let proof = key.proof(b"client", &sn, &cn_bytes);
    Ok((
        format!("HELLO {cn} {proof}"),
        format!("{server_nonce} {cn}"),
    ))
}

/// The initiator's check of the target's proof from its `READY` line.
pub(super) fn check_ready(key: &ControlKey, nonces: &str, proof: &str) -> Result<()> {
    let mut it = nonces.split(' ').filter_map(nonce_bytes);
    let (Some(sn), Some(cn)) = (it.next(), it.next()) else {
        bail!("internal: nonces lost");
    };
    if !key.check(b"server", &cn, &sn, proof) {
        bail!("the target did not prove the cluster secret (is it started with --auth?)");
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests unwrap what they construct
mod tests {
    use super::*;

    #[test]
    fn both_sides_prove_the_secret_and_a_stranger_cannot() {
        let key = ControlKey::new(Some("a-bench-secret-0123456789")).unwrap();
        let sn = nonce();
        let (line, nonces) = hello(&key, &format!("CHALLENGE {sn}")).unwrap();
        let server_proof = accept_hello(&key, &sn, &line).unwrap();
        check_ready(&key, &nonces, &server_proof).unwrap();

        let stranger = ControlKey::new(Some("another-secret-0123456789")).unwrap();
        let (bad, _) = hello(&stranger, &format!("CHALLENGE {sn}")).unwrap();
        assert!(accept_hello(&key, &sn, &bad).is_err());
        let open = ControlKey::new(None).unwrap();
        let (none, nonces) = hello(&open, &format!("CHALLENGE {sn}")).unwrap();
        assert!(accept_hello(&key, &sn, &none).is_err());
        // An open target's READY carries no proof: a secret initiator refuses it.
        assert!(check_ready(&key, &nonces, "-").is_err());
        // A recorded HELLO does not answer another challenge.
        assert!(accept_hello(&key, &nonce(), &line).is_err());
    }

    #[test]
    fn lines_are_capped() {
        let long = vec![b'x'; MAX_LINE as usize + 10];
        assert!(read_line(&mut &long[..]).is_err());
        let mut ok = &b"QUIT\r\nnext\n"[..];
        assert_eq!(read_line(&mut ok).unwrap().as_deref(), Some("QUIT"));
        assert_eq!(read_line(&mut ok).unwrap().as_deref(), Some("next"));
        assert_eq!(read_line(&mut ok).unwrap(), None);
    }
}
