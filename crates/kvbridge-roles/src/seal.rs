//! Control messages bound to the decode ↔ prefill pair that exchanges them
//! (secret mode). Every cluster member holds the secret, so the control
//! plane's CURVE keys say only "a member sent this". A decode rank
//! therefore hands each prefill rank its own pair key in its registration
//! (encrypted by CURVE, seen by that prefill rank only), and both sides end
//! every room message with a MAC under it: the staging messages
//! (`STAGING_REQ`, `STAGING_RSP`, `CHUNK_READY`, `WATERMARK`), transfer
//! requests and ABORTs, and status, `ABORT_ACK`, `STATE_DATA` and
//! `AUX_DATA`. A member that serves none of a pair's rooms cannot produce
//! one; a prefill rank cannot speak for another prefill rank.
//!
//! **Owns:** the pair keys and the MAC. **Never:** decides what a message
//! may do once bound; the inboxes do.

use hmac::{Hmac, Mac};
use kvbridge_wire::{Frames, MAC_LEN, PairKey, mac_frame};
use sha2::{Digest as _, Sha256};
use std::borrow::Cow;

type HmacSha256 = Hmac<Sha256>;

/// A decode rank's source of pair keys: one random secret per manager, one
/// derived key per prefill rank endpoint.
pub(crate) struct PairKeys([u8; 32]);

impl std::fmt::Debug for PairKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PairKeys(..)")
    }
}

impl PairKeys {
    /// A fresh random source (a restarted decode hands out new keys).
    pub(crate) fn generate() -> Self {
        Self(rand::random())
    }

    /// The key for the prefill rank at `endpoint` (as we address it).
    pub(crate) fn for_prefill(&self, endpoint: &str) -> PairKey {
        let mut m = hmac(&self.0);
        m.update(b"kvbridge/1 pair key ");
        m.update(endpoint.as_bytes());
        PairKey(m.finalize().into_bytes().into())
    }
}

fn hmac(key: &[u8]) -> HmacSha256 {
    <HmacSha256 as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes any key length"))
}

/// What a MAC covers: SHA-256 of every frame, length-prefixed (no two
/// framings of the same bytes share it). Computed once per message however
/// many pair keys it is checked against.
#[derive(Debug)]
pub struct Digest([u8; 32]);

impl Digest {
    /// The digest of `frames`.
    pub fn of<F: AsRef<[u8]>>(frames: &[F]) -> Self {
        let mut h = Sha256::new();
        for f in frames {
            let f = f.as_ref();
            h.update((f.len() as u64).to_le_bytes());
            h.update(f);
        }
        Self(h.finalize().into())
    }

    fn mac(&self, key: &PairKey) -> HmacSha256 {
        let mut m = hmac(&key.0);
        m.update(b"kvbridge/2 pair mac");
        m.update(&self.0);
        m
    }

    /// Whether `mac` is this message's MAC under `key` (constant time).
    pub fn verifies(&self, key: &PairKey, mac: &[u8; MAC_LEN]) -> bool {
        self.mac(key).verify_truncated_left(mac).is_ok()
    }

    /// The first of `keys` under which `mac` verifies.
    pub fn signer<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k PairKey>,
        mac: &[u8; MAC_LEN],
    ) -> Option<usize> {
        keys.into_iter().position(|k| self.verifies(k, mac))
    }
}

/// Appends the MAC frame of `frames` under `key`, when there is a key.
pub fn seal<'a>(key: Option<&PairKey>, mut frames: Frames<'a>) -> Frames<'a> {
    if let Some(key) = key {
        let tag = Digest::of(&frames).mac(key).finalize().into_bytes();
        let mut mac = [0u8; MAC_LEN];
        mac.copy_from_slice(&tag[..MAC_LEN]);
        frames.push(Cow::Owned(mac_frame(&mac)));
    }
    frames
}

/// Whether `mac` is the MAC of `frames` under `key` (constant time).
pub fn verify<F: AsRef<[u8]>>(key: &PairKey, frames: &[F], mac: &[u8; MAC_LEN]) -> bool {
    Digest::of(frames).verifies(key, mac)
}

#[cfg(test)]
mod tests {
    use kvbridge_wire::split_mac;

    use super::*;

    #[test]
    fn a_sealed_message_verifies_under_its_pair_key_only() {
        let keys = PairKeys::generate();
        let (a, b) = (
            keys.for_prefill("tcp://10.0.0.1:1"),
            keys.for_prefill("tcp://10.0.0.1:2"),
        );
        assert_ne!(a, b, "each prefill rank has its own key");
        let frames: Frames<'_> = vec![Cow::Borrowed(b"WATERMARK"), Cow::Borrowed(b"3")];
        let sealed = seal(Some(&a), frames.clone());
        let (body, mac) = split_mac(&sealed);
        let mac = mac.unwrap();
        assert!(verify(&a, body, &mac));
        assert!(!verify(&b, body, &mac), "another pair's key");
        assert!(!verify(
            &PairKeys::generate().for_prefill("tcp://10.0.0.1:1"),
            body,
            &mac
        ));
        // Re-framed bytes ("WATERMARK3" as one frame) do not verify.
        let joined: [&[u8]; 1] = [b"WATERMARK3"];
        assert!(!verify(&a, &joined, &mac));
        assert_eq!(seal(None, frames.clone()), frames);
    }
}
