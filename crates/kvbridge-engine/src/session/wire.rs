//! The engine wire (TCP engine data connections and CUDA IPC control
//! connections): handshake messages, request headers, descriptors and
//! acks. Little-endian, fixed sizes, strictly decoded. The UCX side channel
//! opens with the same hello prefix and challenge under its own magic.
//!
//! ```text
//! connection set-up (client = the side that sends data)
//!   C->S Hello      magic "KVBT" | version u16 | flags u16 | client nonce [32] |
//!                   client incarnation u64 | session length u16 | client session id
//!                   (its own "host:port", UTF-8, 1..=MAX_SESSION_LEN bytes)
//!   S->C Challenge  magic | version | flags | incarnation u64 | server nonce [32] | server proof [32]
//!   C->S Response   client proof [32]
//!   S->C Verdict    status u32 (ok, auth, version, fenced) | reserved u32
//!   (the client's proof covers its announced incarnation and session id;
//!   the whole set-up must finish within the connect timeout)
//! then requests, each answered in order by one ack:
//!   C->S Header     op u8 | reserved [3] | count u32 | seq u64 | payload bytes u64
//!        Write: count x (dst u64, len u64), then the payload (the blocks' bytes in order)
//!        Check: count x (dst u64, len u64), no payload (destinations of a whole batch)
//!        WriteRuns: count x (dst u64, len u64, copies u64, dst stride u64), then
//!               the payload: every run's copies in order (copy i of a run lands
//!               at dst + i * stride); count x copies at most MAX_WRITE_BLOCKS
//!        CheckRuns: count x run descriptors as in WriteRuns, no payload
//!        Ping:  nothing
//!        Exports: nothing; the ack is followed by len u64 and the
//!               receiver's export table (CUDA IPC handles, see `ipc`)
//!        Lease: count x (region start u64, region len u64), no payload; on an
//!               Ok ack the connection *holds* those regions (added to what
//!               it held): a deregistration of a held region on the
//!               receiver first revokes the hold and waits for its Release
//!        Release: nothing; drops every hold of the connection (acked)
//!   S->C Ack        seq u64 | status u32 | block index u32
//!   S->C Revoke     an ack with seq 0 and status Revoked, sent unprompted
//!                   between acks on a connection holding regions: the
//!                   client waits for its copies in flight, then Releases
//! ```

/// First bytes of both handshake messages.
pub(crate) const MAGIC: [u8; 4] = *b"KVBT";
/// Protocol version (2: the hello announces the client's session and incarnation).
pub(crate) const VERSION: u16 = 2;
/// Handshake flag: the sender of the message holds a cluster secret.
pub(crate) const FLAG_SECRET: u16 = 1;
/// Nonce and proof length.
pub(crate) const NONCE_LEN: usize = 32;

/// Encoded sizes. `HELLO_LEN` is the fixed prefix every version shares;
/// the announcement (`ANNOUNCE_LEN` bytes, then the session id) follows it.
pub(crate) const HELLO_LEN: usize = 8 + NONCE_LEN;
pub(crate) const ANNOUNCE_LEN: usize = 10;
/// Longest session id a hello may announce.
pub(crate) const MAX_SESSION_LEN: usize = 512;
pub(crate) const CHALLENGE_LEN: usize = 16 + 2 * NONCE_LEN;
pub(crate) const RESPONSE_LEN: usize = NONCE_LEN;
pub(crate) const VERDICT_LEN: usize = 8;
pub(crate) const HEADER_LEN: usize = 24;
pub(crate) const DESC_LEN: usize = 16;
pub(crate) const RUN_DESC_LEN: usize = 32;
pub(crate) const ACK_LEN: usize = 16;

/// Most descriptors one Write request may carry.
pub(crate) const MAX_WRITE_BLOCKS: u32 = 1 << 16;
/// Most payload bytes one Write request may carry.
pub(crate) const MAX_WRITE_BYTES: u64 = 1 << 30;

/// Verdict statuses.
pub(crate) const VERDICT_OK: u32 = 0;
pub(crate) const VERDICT_AUTH: u32 = 1;
// 2 was "version mismatch" in version 1; a server now answers a hello of
// another version with its challenge only (the client reports the mismatch).
pub(crate) const VERDICT_FENCED: u32 = 3;

/// Request opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Write the payload at the descriptors' destinations.
    Write = 1,
    /// Check a whole batch's destinations.
    Check = 2,
    /// Answer Ok (alive, authenticated).
    Ping = 3,
    /// Send the export table.
    Exports = 4,
    /// Hold the named regions.
    Lease = 5,
    /// Drop every hold of the connection.
    Release = 6,
    /// Write the payload at the run descriptors' strided destinations.
    WriteRuns = 7,
    /// Check a whole batch's run destinations.
    CheckRuns = 8,
}

/// Longest export table a receiver sends (bytes).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MAX_EXPORTS_BYTES: u64 = 16 << 20;
/// Most regions one lease names.
pub(crate) const MAX_LEASE_REGIONS: u32 = 1 << 16;

/// Ack statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    // On the wire as these values: 0, 1, 2, ... in order.
    Ok = 0,
    /// A destination (`index`) is outside the receiver's regions.
    OutOfRegion,
    BadRequest,
    /// The receiver could not access its memory.
    Memory,
    ShuttingDown,
    /// Unprompted (seq 0): the receiver revokes the connection's holds.
    Revoked,
}

impl Status {
    fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::OutOfRegion,
            2 => Status::BadRequest,
            3 => Status::Memory,
            4 => Status::ShuttingDown,
            5 => Status::Revoked,
            _ => return None,
        })
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(a)
}

/// The little-endian `u32` at `at` (the caller checked the length).
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// The little-endian `u64` at `at` (the caller checked the length).
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn nonce_at(b: &[u8], at: usize) -> [u8; NONCE_LEN] {
    let mut a = [0u8; NONCE_LEN];
    a.copy_from_slice(&b[at..at + NONCE_LEN]);
    a
}

/// Client's opening message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub version: u16,
    pub flags: u16,
    pub nonce: [u8; NONCE_LEN],
    /// The client engine's incarnation.
    pub incarnation: u64,
    /// The client engine's own session id (`host:port`).
    pub session: String,
}

impl Hello {
    /// The whole message: prefix, announcement and session id.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HELLO_LEN + ANNOUNCE_LEN + self.session.len());
        b.extend_from_slice(&Self::encode_prefix_as(
            MAGIC,
            self.version,
            self.flags,
            &self.nonce,
        ));
        b.extend_from_slice(&self.incarnation.to_le_bytes());
        let len = u16::try_from(self.session.len()).unwrap_or(u16::MAX);
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(self.session.as_bytes());
        b
    }

    /// The fixed prefix, `(version, flags, nonce)`; `None` without the magic.
    pub(crate) fn decode_prefix(b: &[u8; HELLO_LEN]) -> Option<(u16, u16, [u8; NONCE_LEN])> {
        Self::decode_prefix_as(MAGIC, b)
    }

    /// [`Hello::decode_prefix`] of a protocol opening with `magic`.
    pub(crate) fn decode_prefix_as(
        magic: [u8; 4],
        b: &[u8; HELLO_LEN],
    ) -> Option<(u16, u16, [u8; NONCE_LEN])> {
        (b[..4] == magic).then(|| (u16_at(b, 4), u16_at(b, 6), nonce_at(b, 8)))
    }

    /// The fixed prefix alone, of a protocol opening with `magic`.
    pub(crate) fn encode_prefix_as(
        magic: [u8; 4],
        version: u16,
        flags: u16,
        nonce: &[u8; NONCE_LEN],
    ) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..4].copy_from_slice(&magic);
        b[4..6].copy_from_slice(&version.to_le_bytes());
        b[6..8].copy_from_slice(&flags.to_le_bytes());
        b[8..].copy_from_slice(nonce);
        b
    }

    /// The announcement after the prefix: `(incarnation, session id length)`;
    /// `None` when the length is 0 or over [`MAX_SESSION_LEN`].
    pub(crate) fn decode_announce(b: &[u8; ANNOUNCE_LEN]) -> Option<(u64, usize)> {
        let len = usize::from(u16_at(b, 8));
        (1..=MAX_SESSION_LEN)
            .contains(&len)
            .then(|| (u64_at(b, 0), len))
    }
}

/// Server's answer to [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub version: u16,
    pub flags: u16,
    pub incarnation: u64,
    pub nonce: [u8; NONCE_LEN],
    pub proof: [u8; NONCE_LEN],
}

impl Challenge {
    /// The engine wire's challenge.
    pub(crate) fn encode(&self) -> [u8; CHALLENGE_LEN] {
        self.encode_as(MAGIC)
    }

    /// Strict decode of the engine wire's challenge; `None` without the magic.
    pub(crate) fn decode(b: &[u8; CHALLENGE_LEN]) -> Option<Self> {
        Self::decode_as(MAGIC, b)
    }

    /// The challenge of a protocol opening with `magic`.
    pub(crate) fn encode_as(&self, magic: [u8; 4]) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[..4].copy_from_slice(&magic);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.incarnation.to_le_bytes());
        b[16..48].copy_from_slice(&self.nonce);
        b[48..80].copy_from_slice(&self.proof);
        b
    }

    /// [`Challenge::decode`] of a protocol opening with `magic`.
    pub(crate) fn decode_as(magic: [u8; 4], b: &[u8; CHALLENGE_LEN]) -> Option<Self> {
        (b[..4] == magic).then(|| Self {
            version: u16_at(b, 4),
            flags: u16_at(b, 6),
            incarnation: u64_at(b, 8),
            nonce: nonce_at(b, 16),
            proof: nonce_at(b, 48),
        })
    }
}

/// Server's final handshake word.
pub(crate) fn encode_verdict(status: u32) -> [u8; VERDICT_LEN] {
    let mut b = [0u8; VERDICT_LEN];
    b[..4].copy_from_slice(&status.to_le_bytes());
    b
}

/// Decode a verdict status.
pub(crate) fn decode_verdict(b: &[u8; VERDICT_LEN]) -> u32 {
    u32_at(b, 0)
}

/// A request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub op: Op,
    pub count: u32,
    pub seq: u64,
    pub payload: u64,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.op as u8;
        b[4..8].copy_from_slice(&self.count.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.payload.to_le_bytes());
        b
    }

    /// Strict decode: unknown opcodes and non-zero reserved bytes are refused.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Option<Self> {
        let op = match b[0] {
            1 => Op::Write,
            2 => Op::Check,
            3 => Op::Ping,
            4 => Op::Exports,
            5 => Op::Lease,
            6 => Op::Release,
            7 => Op::WriteRuns,
            8 => Op::CheckRuns,
            _ => return None,
        };
        if b[1..4] != [0, 0, 0] {
            return None;
        }
        Some(Self {
            op,
            count: u32_at(b, 4),
            seq: u64_at(b, 8),
            payload: u64_at(b, 16),
        })
    }
}

/// Append one `(dst, len)` descriptor.
pub(crate) fn push_desc(out: &mut Vec<u8>, dst: u64, len: u64) {
    out.extend_from_slice(&dst.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
}

/// Decode descriptor `i` of a descriptor buffer.
pub(crate) fn desc_at(b: &[u8], i: usize) -> (u64, u64) {
    (u64_at(b, i * DESC_LEN), u64_at(b, i * DESC_LEN + 8))
}

/// One run descriptor: `copies` copies of `len` bytes, copy `i` at
/// `dst + i * stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RunDesc {
    pub dst: u64,
    pub len: u64,
    pub copies: u64,
    pub stride: u64,
}

impl RunDesc {
    /// Append the descriptor.
    pub(crate) fn push(&self, out: &mut Vec<u8>) {
        for v in [self.dst, self.len, self.copies, self.stride] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// Decode descriptor `i` of a run descriptor buffer.
    pub(crate) fn at(b: &[u8], i: usize) -> Self {
        let at = i * RUN_DESC_LEN;
        Self {
            dst: u64_at(b, at),
            len: u64_at(b, at + 8),
            copies: u64_at(b, at + 16),
            stride: u64_at(b, at + 24),
        }
    }

    /// Bytes from the first copy's start to the last copy's end, if the run
    /// is acceptable from a peer: at least one copy of at least one byte,
    /// copies that do not overlap (`stride >= len` when there are several)
    /// and a span that fits the address space.
    pub(crate) fn span(&self) -> Option<u64> {
        if self.len == 0 || self.copies == 0 {
            return None;
        }
        if self.copies > 1 && self.stride < self.len {
            return None;
        }
        let span = (self.copies - 1)
            .checked_mul(self.stride)?
            .checked_add(self.len)?;
        self.dst.checked_add(span)?;
        Some(span)
    }

    /// Payload bytes of the run (`None` on overflow).
    pub(crate) fn bytes(&self) -> Option<u64> {
        self.len.checked_mul(self.copies)
    }
}

/// An ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ack {
    pub seq: u64,
    pub status: Status,
    pub index: u32,
}

impl Ack {
    pub(crate) fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&(self.status as u32).to_le_bytes());
        b[12..16].copy_from_slice(&self.index.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; ACK_LEN]) -> Option<Self> {
        Some(Self {
            seq: u64_at(b, 0),
            status: Status::from_u32(u32_at(b, 8))?,
            index: u32_at(b, 12),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_descriptors_round_trip_and_refuse_what_a_peer_must_not_send() {
        let r = RunDesc {
            dst: 0x1000,
            len: 512,
            copies: 64,
            stride: 1024,
        };
        let mut b = Vec::new();
        r.push(&mut b);
        assert_eq!(b.len(), RUN_DESC_LEN);
        assert_eq!(RunDesc::at(&b, 0), r);
        assert_eq!(r.span(), Some(63 * 1024 + 512));
        assert_eq!(r.bytes(), Some(64 * 512));
        let bad = |f: fn(&mut RunDesc)| {
            let mut x = r;
            f(&mut x);
            x.span()
        };
        assert_eq!(bad(|x| x.len = 0), None);
        assert_eq!(bad(|x| x.copies = 0), None);
        assert_eq!(bad(|x| x.stride = 511), None, "overlapping copies");
        assert_eq!(bad(|x| x.stride = u64::MAX / 2), None, "span overflows");
        assert_eq!(bad(|x| x.dst = u64::MAX - 100), None, "end overflows");
        // One copy needs no stride.
        assert_eq!(bad(|x| (x.copies, x.stride) = (1, 0)), Some(512));
    }

    #[test]
    fn round_trips() {
        let h = Hello {
            version: VERSION,
            flags: FLAG_SECRET,
            nonce: [7; 32],
            incarnation: 0x1234,
            session: "10.0.0.1:7000".into(),
        };
        let b = h.encode();
        let mut prefix = [0u8; HELLO_LEN];
        prefix.copy_from_slice(&b[..HELLO_LEN]);
        assert_eq!(
            Hello::decode_prefix(&prefix),
            Some((VERSION, FLAG_SECRET, [7; 32]))
        );
        let mut ann = [0u8; ANNOUNCE_LEN];
        ann.copy_from_slice(&b[HELLO_LEN..HELLO_LEN + ANNOUNCE_LEN]);
        assert_eq!(Hello::decode_announce(&ann), Some((0x1234, 13)));
        assert_eq!(&b[HELLO_LEN + ANNOUNCE_LEN..], b"10.0.0.1:7000");
        let c = Challenge {
            version: 1,
            flags: 0,
            incarnation: 99,
            nonce: [1; 32],
            proof: [2; 32],
        };
        assert_eq!(Challenge::decode(&c.encode()), Some(c));
        let hd = Header {
            op: Op::Check,
            count: 5,
            seq: 77,
            payload: 1 << 40,
        };
        assert_eq!(Header::decode(&hd.encode()), Some(hd));
        let a = Ack {
            seq: 3,
            status: Status::OutOfRegion,
            index: 9,
        };
        assert_eq!(Ack::decode(&a.encode()), Some(a));
        let mut d = Vec::new();
        push_desc(&mut d, 0xdead, 12);
        push_desc(&mut d, 0xbeef, 13);
        assert_eq!(desc_at(&d, 1), (0xbeef, 13));
        assert_eq!(decode_verdict(&encode_verdict(VERDICT_AUTH)), VERDICT_AUTH);
    }

    #[test]
    fn status_values_are_fixed() {
        let all = [
            Status::Ok,
            Status::OutOfRegion,
            Status::BadRequest,
            Status::Memory,
            Status::ShuttingDown,
            Status::Revoked,
        ];
        for (v, s) in all.into_iter().enumerate() {
            assert_eq!(s as u32, v as u32);
            assert_eq!(Status::from_u32(v as u32), Some(s));
        }
    }

    #[test]
    fn strict_decoding() {
        let mut hb = Header {
            op: Op::Write,
            count: 1,
            seq: 1,
            payload: 1,
        }
        .encode();
        hb[0] = 9;
        assert_eq!(Header::decode(&hb), None);
        hb[0] = 1;
        hb[2] = 1;
        assert_eq!(Header::decode(&hb), None);
        let mut h = [0u8; HELLO_LEN];
        h[..4].copy_from_slice(b"XVBT");
        assert_eq!(Hello::decode_prefix(&h), None);
        let mut ann = [0u8; ANNOUNCE_LEN];
        assert_eq!(Hello::decode_announce(&ann), None, "empty session id");
        ann[8..].copy_from_slice(&(MAX_SESSION_LEN as u16 + 1).to_le_bytes());
        assert_eq!(Hello::decode_announce(&ann), None, "session id too long");
        let mut a = Ack {
            seq: 1,
            status: Status::Ok,
            index: 0,
        }
        .encode();
        a[8] = 200;
        assert_eq!(Ack::decode(&a), None);
    }
}
