//! kvbridge's trailing frames that bind staging messages to one decode ↔
//! prefill pair in secret mode: the pair key a decode rank hands each
//! prefill rank in its registration, and the MAC frame every staging
//! message (`STAGING_REQ`, `STAGING_RSP`, `CHUNK_READY`, `WATERMARK`) then
//! carries last. sglang never sends them and never reads past its own
//! frames.
//!
//! **Owns:** their framing only. Computing and checking a MAC belongs to
//! the role managers, which hold the keys.

use std::fmt;

/// Prefix of the pair-key frame of a registration.
pub const PAIR_KEY_PREFIX: &[u8] = b"kvbridge-pair-key=";
/// Prefix of the MAC frame that ends a bound staging message.
pub const MAC_PREFIX: &[u8] = b"kvbridge-mac=";
/// Bytes of a MAC.
pub const MAC_LEN: usize = 16;

/// The 32-byte key one decode rank shares with one prefill rank; never
/// printed.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct PairKey(pub [u8; 32]);

impl fmt::Debug for PairKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PairKey(..)")
    }
}

impl PairKey {
    /// The registration frame that carries the key.
    pub fn frame(&self) -> Vec<u8> {
        let mut frame = PAIR_KEY_PREFIX.to_vec();
        frame.extend_from_slice(&self.0);
        frame
    }

    /// The key in `frame`, if it is a pair-key frame of the right length.
    pub fn from_frame(frame: &[u8]) -> Option<Self> {
        let raw = frame.strip_prefix(PAIR_KEY_PREFIX)?;
        <[u8; 32]>::try_from(raw).ok().map(Self)
    }
}

/// The frame that carries `mac`.
pub fn mac_frame(mac: &[u8; MAC_LEN]) -> Vec<u8> {
    let mut frame = MAC_PREFIX.to_vec();
    frame.extend_from_slice(mac);
    frame
}

/// Splits a trailing MAC frame off `frames`: the message's own frames and
/// the MAC, or all of `frames` and `None` when the last is no MAC frame.
pub fn split_mac<F: AsRef<[u8]>>(frames: &[F]) -> (&[F], Option<[u8; MAC_LEN]>) {
    let Some((last, body)) = frames.split_last() else {
        return (frames, None);
    };
    let mac = last
        .as_ref()
        .strip_prefix(MAC_PREFIX)
        .and_then(|m| <[u8; MAC_LEN]>::try_from(m).ok());
    match mac {
        Some(mac) => (body, Some(mac)),
        None => (frames, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mac_frame_splits_off_and_nothing_else_does() {
        let mac = [7u8; MAC_LEN];
        let frames = vec![b"WATERMARK".to_vec(), b"1".to_vec(), mac_frame(&mac)];
        let (body, got) = split_mac(&frames);
        assert_eq!((body.len(), got), (2, Some(mac)));
        // A short or unprefixed last frame is the message's own.
        let mut short = MAC_PREFIX.to_vec();
        short.push(1);
        for last in [short, b"session".to_vec(), Vec::new()] {
            let frames = vec![b"WATERMARK".to_vec(), last];
            assert_eq!(split_mac(&frames), (&frames[..], None));
        }
        let none: [&[u8]; 0] = [];
        assert_eq!(split_mac(&none).1, None);
    }

    #[test]
    fn a_pair_key_round_trips_and_hides_in_debug() {
        let key = PairKey([9u8; 32]);
        assert_eq!(PairKey::from_frame(&key.frame()), Some(key));
        assert_eq!(PairKey::from_frame(&key.frame()[1..]), None);
        assert_eq!(PairKey::from_frame(&key.frame()[..40]), None);
        assert_eq!(format!("{key:?}"), "PairKey(..)");
    }
}
