//! Which of a room's prefill ranks sent a message (secret mode): every
//! message a prefill rank sends a decode rank ends with a MAC under their
//! pair key, so a member that serves none of the room's ranks cannot
//! conclude it, acknowledge its abort, write its slots or drive its
//! staging chunks. Open mode takes messages as named, as sglang does.
//!
//! **Owns:** the check and its drop counters (`staging_unbound` for staging
//! messages, `unbound` for the rest). **Never:** decides what a bound
//! message may do; the inbox and staging handlers do.

use kvbridge_wire::{MAC_LEN, PairKey};

use super::Shared;
use crate::seal::Digest;

/// A message's MAC and, in secret mode, the digest it is checked against
/// (taken once, however many of the room's keys are tried).
pub(crate) struct Bound {
    digest: Option<Digest>,
    mac: Option<[u8; MAC_LEN]>,
}

impl Bound {
    /// `frames` (the message without its MAC frame) and `mac`, as `shared`
    /// checks them: digested only in secret mode and when a MAC came.
    pub fn new(shared: &Shared, frames: &[Vec<u8>], mac: Option<[u8; MAC_LEN]>) -> Self {
        let digest = (shared.pair_keys.is_some() && mac.is_some()).then(|| Digest::of(frames));
        Self { digest, mac }
    }

    /// The first of `keys` whose MAC the message carries.
    fn signer<'k>(&self, keys: impl IntoIterator<Item = &'k PairKey>) -> Option<usize> {
        let (digest, mac) = (self.digest.as_ref()?, self.mac.as_ref()?);
        digest.signer(keys, mac)
    }
}

/// Who sent a staging message for a room.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Writer {
    /// Open mode: unbound, as sglang sends it; trusted as named.
    Named,
    /// Secret mode: the room's prefill rank (index into its `prefills`)
    /// whose pair key verifies the message's MAC.
    Rank(usize),
}

/// The sender of a staging message among the room's `prefills`
/// (`(pp rank, endpoint)`); `None` (secret mode) when no pair key of the
/// room's ranks verifies it: a forgery, or a member speaking for a room it
/// does not serve. Counted and logged.
pub(crate) fn staging_writer(
    shared: &Shared,
    prefills: &[(u64, String)],
    bound: &Bound,
    (kind, room, chunk): (&'static str, u64, u64),
) -> Option<Writer> {
    let Some(keys) = &shared.pair_keys else {
        return Some(Writer::Named);
    };
    let keys: Vec<PairKey> = prefills.iter().map(|(_, e)| keys.for_prefill(e)).collect();
    let found = bound.signer(&keys);
    if found.is_none() {
        shared.metrics.dropped("staging_unbound");
        tracing::warn!(
            room,
            chunk,
            kind,
            mac = bound.mac.is_some(),
            "dropping a staging message no prefill rank of the room sent (no MAC under its pair key)"
        );
    }
    found.map(Writer::Rank)
}

/// Whether a room message (status, `ABORT_ACK`, `STATE_DATA`, `AUX_DATA`)
/// carries the MAC of one of `keys` (the ranks that may send it); always in
/// open mode. An unbound one is counted and logged.
pub(crate) fn from_ranks<'k>(
    shared: &Shared,
    keys: impl IntoIterator<Item = &'k PairKey>,
    bound: &Bound,
    (kind, room): (&'static str, u64),
) -> bool {
    if shared.pair_keys.is_none() || bound.signer(keys).is_some() {
        return true;
    }
    shared.metrics.dropped("unbound");
    tracing::warn!(
        room,
        kind,
        mac = bound.mac.is_some(),
        "dropping a message no prefill rank of the room sent (no MAC under its pair key)"
    );
    false
}
