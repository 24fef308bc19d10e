//! The verifiable pattern: every byte's value follows from where it sits in
//! the model (room, layer, K/V, token, global head, state position), so a
//! receiver holding any slice of it checks exactly the bytes it should have.

use kvbridge_plan::rng::{GOLDEN as STEP, mix};
use serde::{Deserialize, Serialize};

/// Bytes checked and bytes wrong in a verification.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verified {
    /// Bytes compared.
    pub bytes: u64,
    /// Bytes that differed from the expected pattern.
    pub mismatched: u64,
}

impl std::ops::AddAssign for Verified {
    fn add_assign(&mut self, rhs: Self) {
        self.bytes += rhs.bytes;
        self.mismatched += rhs.mismatched;
    }
}

impl Verified {
    /// Adds the comparison of `got` with the pattern of `seed`.
    pub(super) fn check(&mut self, seed: u64, got: Option<&[u8]>, len: usize) {
        match got {
            Some(got) => {
                self.bytes += got.len() as u64;
                self.mismatched += slice_mismatches(seed, got);
            }
            None => self.mismatched += len as u64,
        }
    }
}

/// The first word of one head slice's pattern, from `(room, layer, kv, token, head)`.
pub(super) fn slice_seed(room: u64, layer: u64, kv: u64, token: u64, head: u64) -> u64 {
    mix(room ^ mix((layer << 1 | kv) ^ mix(token.wrapping_mul(0x1_0000_0001) ^ (head << 40))))
}

/// The first word of one state unit's pattern: `component`, its buffer
/// `shape`, `layer`, a position (token or row) and an element (head or unit).
pub(super) fn state_seed(
    room: u64,
    component: u64,
    shape: u64,
    layer: u64,
    pos: u64,
    elem: u64,
) -> u64 {
    let tag = 0x5747_0000_0000 ^ (component << 24) ^ (shape << 16) ^ layer;
    mix(room ^ mix(tag ^ mix(pos.wrapping_mul(0x1_0000_0001) ^ (elem << 40))))
}

/// The pattern of one slice: words `seed + j * STEP`, little-endian.
pub(super) fn slice_pattern(seed: u64, out: &mut [u8]) {
    for (j, chunk) in out.chunks_mut(8).enumerate() {
        let word = seed
            .wrapping_add((j as u64).wrapping_mul(STEP))
            .to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// Bytes of `got` that differ from the pattern with `seed`.
pub(super) fn slice_mismatches(seed: u64, got: &[u8]) -> u64 {
    let mut words = got.chunks_exact(8);
    let mut bad = 0u64;
    let mut j = 0u64;
    for w in &mut words {
        let want = seed.wrapping_add(j.wrapping_mul(STEP));
        let have = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        if have != want {
            bad += (have ^ want)
                .to_le_bytes()
                .iter()
                .filter(|b| **b != 0)
                .count() as u64;
        }
        j += 1;
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        let want = seed.wrapping_add(j.wrapping_mul(STEP)).to_le_bytes();
        bad += tail.iter().zip(want).filter(|(a, b)| **a != *b).count() as u64;
    }
    bad
}

/// The pattern of aux buffer `buffer`'s slot for `room`.
pub(super) fn aux_pattern(room: u64, buffer: u64, out: &mut [u8]) {
    let base = mix(room.wrapping_mul(31) ^ buffer ^ 0xa0a0);
    for (j, chunk) in out.chunks_mut(8).enumerate() {
        let word = mix(base.wrapping_add(j as u64)).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// Byte offset of item `index` of `item` bytes, if it fits.
pub(super) fn item_offset(index: i64, item: u64) -> Option<usize> {
    usize::try_from(u64::try_from(index).ok()?.checked_mul(item)?).ok()
}
