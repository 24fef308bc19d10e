//! kvbridge's own messages, beyond sglang's protocol.
//!
//! **Owns:** the frames of messages only kvbridge ranks exchange, and only
//! after the receiver announced it takes them (a trailing frame of its
//! registration, which sglang ignores).
//! **Never:** replaces a message of the reference for a peer that did not
//! announce the extension: an sglang rank always gets sglang's frames.
//! These messages are not part of `kvbridge wire`'s message kinds.

use std::borrow::Cow;

use crate::codec::{FrameCursor, Frames, int_frame, parse_u64};
use crate::error::DecodeError;
use crate::limits::Limits;
use crate::packed::PackedArray;

/// First frame of a room's aux slots sent together over zmq.
pub const AUX_BATCH_TAG: &[u8] = b"KVBRIDGE_AUX_BATCH";

/// Trailing registration frame: this decode rank takes [`AuxBatch`].
pub const AUX_BATCH_CAPABILITY: &[u8] = b"kvbridge-aux-batch";

/// Every aux slot of one room in one message, in place of one `AUX_DATA`
/// per aux buffer: `[tag, room, aux_index, buffer indices (packed u32),
/// lengths (packed u32), the slots' bytes back to back]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AuxBatch<'a> {
    /// The room.
    pub room: u64,
    /// The decode aux slot every buffer's bytes go to.
    pub aux_index: u64,
    buffers: PackedArray<'a, u32>,
    lengths: PackedArray<'a, u32>,
    data: Cow<'a, [u8]>,
}

impl<'a> AuxBatch<'a> {
    /// All six frames are required.
    pub const MIN_FRAMES: usize = 6;

    /// A batch of `slots` (`(buffer index, bytes)`, in order); `None` when a
    /// slot or their total does not fit the `u32` lengths the frames carry.
    pub fn from_slots(room: u64, aux_index: u64, slots: &[(u32, &[u8])]) -> Option<Self> {
        let mut buffers = Vec::with_capacity(slots.len());
        let mut lengths = Vec::with_capacity(slots.len());
        let mut data = Vec::with_capacity(slots.iter().map(|(_, d)| d.len()).sum());
        for (buffer, bytes) in slots {
            buffers.push(*buffer);
            lengths.push(u32::try_from(bytes.len()).ok()?);
            data.extend_from_slice(bytes);
        }
        u32::try_from(data.len()).ok()?;
        Some(Self {
            room,
            aux_index,
            buffers: buffers.into(),
            lengths: lengths.into(),
            data: Cow::Owned(data),
        })
    }

    /// Decodes a batch: as many lengths as buffer indices, at least one,
    /// at most `limits.max_lists`, and lengths that add up to the payload.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("aux_batch", frames, Self::MIN_FRAMES)?;
        if c.req(0) != AUX_BATCH_TAG {
            return Err(DecodeError::BadRoom);
        }
        let buffers = PackedArray::<u32>::decode("buffers", c.req(3), limits)?;
        let lengths = PackedArray::<u32>::decode("lengths", c.req(4), limits)?;
        let data = c.req(5);
        if buffers.is_empty() || buffers.len() > limits.max_lists {
            return Err(DecodeError::Oversized {
                field: "buffers",
                len: buffers.len() as u64,
                limit: limits.max_lists as u64,
            });
        }
        if data.len() > limits.max_payload_len {
            return Err(DecodeError::Oversized {
                field: "data",
                len: data.len() as u64,
                limit: limits.max_payload_len as u64,
            });
        }
        let declared: u64 = lengths.iter().map(u64::from).sum();
        if lengths.len() != buffers.len() || declared != data.len() as u64 {
            return Err(DecodeError::PayloadLength {
                field: "data",
                declared,
                actual: data.len() as u64,
            });
        }
        Ok(Self {
            room: parse_u64("room", c.req(1))?,
            aux_index: parse_u64("aux_index", c.req(2))?,
            buffers,
            lengths,
            data: Cow::Borrowed(data),
        })
    }

    /// The six frames.
    pub fn encode(&self) -> Frames<'_> {
        vec![
            Cow::Borrowed(AUX_BATCH_TAG),
            int_frame(self.room),
            int_frame(self.aux_index),
            Cow::Borrowed(self.buffers.as_bytes()),
            Cow::Borrowed(self.lengths.as_bytes()),
            Cow::Borrowed(&self.data[..]),
        ]
    }

    /// The slots, `(buffer index, bytes)`, in order.
    pub fn slots(&self) -> impl Iterator<Item = (u32, &[u8])> + '_ {
        let mut rest: &[u8] = &self.data;
        self.buffers
            .iter()
            .zip(self.lengths.iter())
            .map(move |(buffer, len)| {
                // Decoding checked that the lengths add up to the payload.
                let at = (len as usize).min(rest.len());
                let (slot, tail) = rest.split_at(at);
                rest = tail;
                (buffer, slot)
            })
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.buffers.len()
    }

    /// Whether the batch holds no slot.
    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn owned(frames: Frames<'_>) -> Vec<Vec<u8>> {
        frames.into_iter().map(Cow::into_owned).collect()
    }

    proptest! {
        /// What is built decodes back to the same slots, and re-encodes to
        /// the same frames.
        #[test]
        fn a_batch_round_trips(
            room in any::<u64>(),
            aux in any::<u64>(),
            slots in proptest::collection::vec(
                (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..200)), 1..12),
        ) {
            let refs: Vec<(u32, &[u8])> = slots.iter().map(|(b, d)| (*b, d.as_slice())).collect();
            let batch = AuxBatch::from_slots(room, aux, &refs).unwrap();
            let frames = owned(batch.encode());
            let back = AuxBatch::decode(&frames, &Limits::DEFAULT).unwrap();
            prop_assert_eq!(back.room, room);
            prop_assert_eq!(back.aux_index, aux);
            let got: Vec<(u32, Vec<u8>)> = back.slots().map(|(b, d)| (b, d.to_vec())).collect();
            prop_assert_eq!(&got, &slots);
            prop_assert_eq!(owned(back.encode()), frames);
        }

        /// Lengths that do not add up to the payload are refused.
        #[test]
        fn lengths_must_add_up(extra in 1usize..64, short in any::<bool>()) {
            let batch = AuxBatch::from_slots(1, 2, &[(0, &[7u8; 64][..]), (1, &[8u8; 64][..])]).unwrap();
            let mut frames = owned(batch.encode());
            if short {
                frames[5].truncate(128 - extra);
            } else {
                frames[5].extend(std::iter::repeat_n(0u8, extra));
            }
            let refused = matches!(
                AuxBatch::decode(&frames, &Limits::DEFAULT),
                Err(DecodeError::PayloadLength { .. })
            );
            prop_assert!(refused);
        }
    }

    #[test]
    fn malformed_batches_are_refused() {
        let batch = AuxBatch::from_slots(1, 2, &[(0, &[1u8; 8][..])]).unwrap();
        let good = owned(batch.encode());
        let limits = Limits::DEFAULT;
        // Too few frames, another tag, a non-decimal room.
        assert!(AuxBatch::decode(&good[..5], &limits).is_err());
        let mut tag = good.clone();
        tag[0] = b"AUX_DATA".to_vec();
        assert!(AuxBatch::decode(&tag, &limits).is_err());
        let mut room = good.clone();
        room[1] = b"x1".to_vec();
        assert!(AuxBatch::decode(&room, &limits).is_err());
        // Lengths for another count of buffers, a misaligned array, none.
        let mut count = good.clone();
        count[4] = [8u32, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert!(AuxBatch::decode(&count, &limits).is_err());
        let mut misaligned = good.clone();
        misaligned[3].push(0);
        assert!(AuxBatch::decode(&misaligned, &limits).is_err());
        let mut none = good.clone();
        none[3].clear();
        none[4].clear();
        none[5].clear();
        assert!(AuxBatch::decode(&none, &limits).is_err());
        // More slots than the limit.
        let tight = Limits {
            max_lists: 1,
            ..Limits::DEFAULT
        };
        let two = AuxBatch::from_slots(1, 2, &[(0, &[1u8][..]), (1, &[2u8][..])]).unwrap();
        assert!(AuxBatch::decode(&owned(two.encode()), &tight).is_err());
        assert!(AuxBatch::decode(&good, &limits).is_ok());
    }
}
