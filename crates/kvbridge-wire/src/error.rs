//! Typed decoding errors.

use thiserror::Error;

/// Why a multipart message could not be decoded.
///
/// Every variant names the field (sglang's name) it was found in, so a log
/// line says what the peer got wrong. Decoding never panics: every malformed
/// input maps to one of these.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The message had no frames at all.
    #[error("empty message: no frames")]
    Empty,
    /// Fewer frames than the message kind requires.
    #[error("{kind}: expected at least {min} frames, got {got}")]
    FrameCount {
        /// The message kind (`register`, `transfer`, `abort`, ...).
        kind: &'static str,
        /// The smallest frame count this kind accepts.
        min: usize,
        /// The frame count received.
        got: usize,
    },
    /// The first frame is neither a known tag nor `None` nor a decimal room.
    #[error("first frame is neither a message tag, `None`, nor a decimal room")]
    BadRoom,
    /// A known message kind arrived at the side it never travels to.
    #[error("a `{kind}` message travels to {travels_to}, not to {received_by}")]
    WrongDirection {
        /// The message kind recognised from the first frame.
        kind: &'static str,
        /// The side the kind travels to.
        travels_to: &'static str,
        /// The side that received it.
        received_by: &'static str,
    },
    /// An ASCII integer frame that is not `0|[1-9][0-9]*` (with a leading
    /// `-` only where the field is signed) or does not fit its type.
    #[error("field `{field}`: bad integer: {reason}")]
    BadInteger {
        /// The field name.
        field: &'static str,
        /// What is wrong with it.
        reason: IntegerError,
    },
    /// A text frame that must be ASCII is not.
    #[error("field `{field}`: not ASCII")]
    NotAscii {
        /// The field name.
        field: &'static str,
    },
    /// A packed array whose byte length is not a multiple of its element size.
    #[error("field `{field}`: {len} bytes is not a multiple of the element size {width}")]
    Misaligned {
        /// The field name.
        field: &'static str,
        /// The frame length in bytes.
        len: usize,
        /// The element size in bytes.
        width: usize,
    },
    /// A declared payload length that differs from the payload's real length.
    #[error("field `{field}`: declared length {declared} but payload has {actual} bytes")]
    PayloadLength {
        /// The field name.
        field: &'static str,
        /// The length the header declares.
        declared: u64,
        /// The payload's real length.
        actual: u64,
    },
    /// A field longer than the configured [`Limits`](crate::Limits) allow.
    #[error("field `{field}`: {len} exceeds the limit {limit}")]
    Oversized {
        /// The field name.
        field: &'static str,
        /// The length or count found.
        len: u64,
        /// The limit it exceeds.
        limit: u64,
    },
    /// A `pack_int_lists` frame whose header does not match its body.
    #[error("field `{field}`: malformed packed list: {reason}")]
    BadPackedLists {
        /// The field name.
        field: &'static str,
        /// What is wrong with the header or body.
        reason: &'static str,
    },
    /// A fixed-width binary frame with the wrong length.
    #[error("field `{field}`: expected {expected} bytes, got {got}")]
    BadWidth {
        /// The field name.
        field: &'static str,
        /// The accepted length(s), as text.
        expected: &'static str,
        /// The length received.
        got: usize,
    },
    /// A KV status number outside sglang's `KVPoll` values.
    #[error("field `status`: {0} is not a KVPoll value (0..=4)")]
    UnknownStatus(u64),
    /// A transfer request with kv indices but no aux index (or the reverse
    /// half of the dummy marker).
    #[error("field `dst_aux_index`: missing in a non-dummy transfer request")]
    MissingAuxIndex,
}

/// What is wrong with an ASCII integer frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum IntegerError {
    /// The frame is empty where a value is required.
    #[error("empty")]
    Empty,
    /// A character other than a digit (or a leading `-` where allowed).
    #[error("not a decimal number")]
    NotDecimal,
    /// A leading zero (`05`), which sglang never writes.
    #[error("leading zero")]
    LeadingZero,
    /// The value does not fit the field's type.
    #[error("out of range")]
    OutOfRange,
}
