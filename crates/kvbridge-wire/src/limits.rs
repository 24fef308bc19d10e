//! Bounds that decoding enforces on hostile input.

/// Upper bounds on the sizes a decoded message may claim.
///
/// Decoding borrows arrays and payloads from the received frames, so these
/// limits do not protect the decoder's own memory (it allocates nothing
/// proportional to the input); they protect whoever acts on the message, and
/// reject absurd values early with a typed error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest text field (endpoint, session id, IP address), in bytes.
    pub max_text_len: usize,
    /// Longest failure reason in a status message, in bytes.
    pub max_reason_len: usize,
    /// Most elements in one packed integer array.
    pub max_array_len: usize,
    /// Most inner lists in one `pack_int_lists` frame.
    pub max_lists: usize,
    /// Largest `AUX_DATA` / `STATE_DATA` payload, in bytes.
    pub max_payload_len: usize,
}

impl Limits {
    /// The defaults: generous for any real model, small enough to refuse nonsense.
    pub const DEFAULT: Limits = Limits {
        max_text_len: 4096,
        max_reason_len: 64 * 1024,
        // 64 M pages is far beyond any context length times any page size.
        max_array_len: 64 << 20,
        max_lists: 4096,
        max_payload_len: 1 << 30,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}
