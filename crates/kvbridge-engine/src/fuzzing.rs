//! Entry points for the fuzz targets in `fuzz/`: thin wrappers that run the
//! engine's crate-private decoders of peer bytes on arbitrary input. Not
//! part of the supported API (hidden from the docs, may change at any time).
//!
//! Each wrapper takes any bytes, decodes what a peer could have sent, and
//! checks what must hold of the result (mostly: it re-encodes to the bytes
//! it was decoded from). A failed check panics: that is what the fuzzer
//! reports. Nothing here panics on malformed input as such.

use crate::ipc::table;

use crate::session::wire as tcp_wire;

use tcp_wire::{Ack, Challenge, Header, Hello};

/// The first `N` bytes of `data` as an array, if there are that many.
fn prefix<const N: usize>(data: &[u8]) -> Option<&[u8; N]> {
    data.get(..N)?.try_into().ok()
}

/// TCP engine hello (client → server): the fixed prefix, the announcement
/// and the announced session id, decoded as the server does; a hello that
/// decodes re-encodes to the same bytes.
pub fn tcp_hello(data: &[u8]) {
    let Some(p) = prefix::<{ tcp_wire::HELLO_LEN }>(data) else {
        return;
    };
    let Some((version, flags, nonce)) = Hello::decode_prefix(p) else {
        return;
    };
    // The server reads no further into a hello of another version.
    if version != tcp_wire::VERSION {
        return;
    }
    let rest = &data[tcp_wire::HELLO_LEN..];
    let Some(a) = prefix::<{ tcp_wire::ANNOUNCE_LEN }>(rest) else {
        return;
    };
    let Some((incarnation, len)) = Hello::decode_announce(a) else {
        return;
    };
    assert!((1..=tcp_wire::MAX_SESSION_LEN).contains(&len));
    let Some(session) = rest[tcp_wire::ANNOUNCE_LEN..].get(..len) else {
        return;
    };
    let Ok(session) = std::str::from_utf8(session) else {
        return;
    };
    let hello = Hello {
        version,
        flags,
        nonce,
        incarnation,
        session: session.to_owned(),
    };
    let used = tcp_wire::HELLO_LEN + tcp_wire::ANNOUNCE_LEN + len;
    assert_eq!(hello.encode(), &data[..used]);
}

/// TCP engine challenge (server → client); round-trips exactly.
pub fn tcp_challenge(data: &[u8]) {
    if let Some(b) = prefix(data)
        && let Some(c) = Challenge::decode(b)
    {
        assert_eq!(&c.encode(), b);
    }
}

/// TCP engine verdict (server → client): any status decodes, and
/// re-encodes to a verdict that decodes to the same status.
pub fn tcp_verdict(data: &[u8]) {
    if let Some(b) = prefix(data) {
        let status = tcp_wire::decode_verdict(b);
        assert_eq!(
            tcp_wire::decode_verdict(&tcp_wire::encode_verdict(status)),
            status
        );
    }
}

/// TCP engine request (client → server): the header, strictly decoded,
/// then as many `(dst, len)` descriptors (run descriptors for
/// `WriteRuns`/`CheckRuns`) as it announces and `data` holds. The header
/// and the descriptors re-encode to the same bytes; a run the receiver
/// accepts has a span covering its copies.
pub fn tcp_request(data: &[u8]) {
    let Some(b) = prefix::<{ tcp_wire::HEADER_LEN }>(data) else {
        return;
    };
    let Some(h) = Header::decode(b) else {
        return;
    };
    assert_eq!(&h.encode(), b);
    if matches!(h.op, tcp_wire::Op::WriteRuns | tcp_wire::Op::CheckRuns) {
        let descs = &data[tcp_wire::HEADER_LEN..];
        let n = (h.count as usize).min(descs.len() / tcp_wire::RUN_DESC_LEN);
        let descs = &descs[..n * tcp_wire::RUN_DESC_LEN];
        let mut again = Vec::with_capacity(descs.len());
        for i in 0..n {
            let r = tcp_wire::RunDesc::at(descs, i);
            r.push(&mut again);
            if let Some(span) = r.span() {
                let last = (r.copies - 1) * r.stride;
                assert!(r.len > 0 && last + r.len == span);
                assert!(r.dst.checked_add(span).is_some());
                assert!(r.copies == 1 || r.stride >= r.len);
            }
        }
        assert_eq!(again, descs);
        return;
    }
    let descs = &data[tcp_wire::HEADER_LEN..];
    let n = (h.count as usize).min(descs.len() / tcp_wire::DESC_LEN);
    let descs = &descs[..n * tcp_wire::DESC_LEN];
    let mut again = Vec::with_capacity(descs.len());
    for i in 0..n {
        let (dst, len) = tcp_wire::desc_at(descs, i);
        tcp_wire::push_desc(&mut again, dst, len);
    }
    assert_eq!(again, descs);
}

/// TCP engine ack (server → client); round-trips exactly.
pub fn tcp_ack(data: &[u8]) {
    if let Some(b) = prefix(data)
        && let Some(a) = Ack::decode(b)
    {
        assert_eq!(&a.encode(), b);
    }
}

/// The answer to an `Exports` control request as the CUDA IPC engine's
/// control client (`tcp/control.rs`) reads it: an ack, the table length
/// (refused over the limit), then the export table of `ipc::table`.
/// A table that decodes is sorted and disjoint, and survives a re-encode.
pub fn tcp_exports_reply(data: &[u8]) {
    let Some(b) = prefix(data) else {
        return;
    };
    if Ack::decode(b).is_none() {
        return;
    }
    let rest = &data[tcp_wire::ACK_LEN..];
    let Some(lb) = prefix::<8>(rest) else {
        return;
    };
    let len = u64::from_le_bytes(*lb);
    if len > tcp_wire::MAX_EXPORTS_BYTES {
        return;
    }
    if let Some(t) = rest[8..].get(..len as usize) {
        export_table(t);
    }
}

/// An IPC export table alone (`ipc::table::decode`).
pub fn export_table(data: &[u8]) {
    let Some(entries) = table::decode(data) else {
        return;
    };
    assert!(entries.len() <= table::MAX_ENTRIES);
    for w in entries.windows(2) {
        assert!(w[0].start + w[0].len <= w[1].start, "overlapping exports");
    }
    let encoded = table::encode(&entries);
    assert_eq!(encoded.len(), data.len());
    assert_eq!(table::decode(&encoded).as_deref(), Some(&entries[..]));
}

/// UCX side channel info body (the worker address and the published
/// regions with their keys), decoded as a client does, then a lookup of
/// the range named by the first 16 bytes. What decodes re-encodes to
/// the same bytes; a region found contains the range looked up.
#[cfg(feature = "ucx")]
pub fn ucx_info(data: &[u8]) {
    use crate::ucx::side;
    let (query, body) = match prefix::<16>(data) {
        Some(q) => (*q, &data[16..]),
        None => return,
    };
    let Some((worker, regions)) = side::decode_info(body) else {
        return;
    };
    assert_eq!(side::encode_info(&worker, &regions), body);
    let info = side::PeerInfo {
        session: String::new(),
        incarnation: 0,
        worker,
        regions,
    };
    let (mut addr, mut len) = ([0u8; 8], [0u8; 8]);
    addr.copy_from_slice(&query[..8]);
    len.copy_from_slice(&query[8..]);
    let (addr, len) = (u64::from_le_bytes(addr), u64::from_le_bytes(len));
    if let Some((start, r)) = info.region_of(addr, len) {
        assert!(start <= addr && addr + len <= start + r.len);
    }
    // Every published region is found from its own start.
    for (&start, r) in &info.regions {
        assert_eq!(info.region_of(start, r.len).map(|f| f.0), Some(start));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wrappers accept what the engine sends (their checks hold on
    /// valid frames) and any prefix or mutation of it without panicking.
    fn all(b: &[u8]) {
        for cut in 0..=b.len() {
            all_once(&b[..cut]);
        }
        let mut m = b.to_vec();
        for i in 0..m.len() {
            m[i] ^= 0x55;
            all_once(&m);
            m[i] ^= 0x55;
        }
    }

    fn all_once(d: &[u8]) {
        tcp_hello(d);
        tcp_challenge(d);
        tcp_verdict(d);
        tcp_request(d);
        tcp_ack(d);
        tcp_exports_reply(d);
        export_table(d);
        #[cfg(feature = "ucx")]
        ucx_info(d);
    }

    #[test]
    fn wrappers_take_valid_frames_and_their_mutations() {
        all(&Hello {
            version: tcp_wire::VERSION,
            flags: tcp_wire::FLAG_SECRET,
            nonce: [3; 32],
            incarnation: 7,
            session: "10.0.0.1:7000".into(),
        }
        .encode());
        let mut req = Header {
            op: tcp_wire::Op::Write,
            count: 2,
            seq: 1,
            payload: 12,
        }
        .encode()
        .to_vec();
        tcp_wire::push_desc(&mut req, 0x1000, 5);
        tcp_wire::push_desc(&mut req, 0x2000, 7);
        all(&req);
        let ack = Ack {
            seq: 1,
            status: tcp_wire::Status::Ok,
            index: 0,
        }
        .encode();
        let t = table::encode(&[table::Export {
            start: 0x1000,
            len: 0x100,
            base: 0x1000,
            size: 0x1000,
            handle: [9; 64],
        }]);
        let mut reply = ack.to_vec();
        reply.extend_from_slice(&(t.len() as u64).to_le_bytes());
        reply.extend_from_slice(&t);
        all(&reply);
        #[cfg(feature = "ucx")]
        {
            use crate::ucx::side::{RemoteRegion, encode_info};
            let mut regions = std::collections::BTreeMap::new();
            regions.insert(
                0x1000,
                RemoteRegion {
                    len: 0x100,
                    rkey: std::sync::Arc::from(&b"key"[..]),
                },
            );
            let mut d = Vec::new();
            d.extend_from_slice(&0x1010u64.to_le_bytes());
            d.extend_from_slice(&0x10u64.to_le_bytes());
            d.extend_from_slice(&encode_info(b"worker", &regions));
            all(&d);
        }
    }
}
