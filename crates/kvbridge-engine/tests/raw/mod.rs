//! A raw client of the TCP engine's wire protocol (`src/tcp/wire.rs`), for
//! tests that play a hostile or broken peer byte by byte.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvbridge_mem::HostBuffer;

/// Engine wire version the helpers speak.
pub const VERSION: u16 = 2;
/// Hello flag: the client holds a cluster secret.
pub const FLAG_SECRET: u16 = 1;
/// Verdicts.
pub const VERDICT_OK: u32 = 0;
pub const VERDICT_AUTH: u32 = 1;
pub const VERDICT_FENCED: u32 = 3;
/// Opcodes.
pub const OP_WRITE: u8 = 1;
pub const OP_CHECK: u8 = 2;
pub const OP_PING: u8 = 3;
pub const OP_EXPORTS: u8 = 4;
pub const OP_LEASE: u8 = 5;
pub const OP_RELEASE: u8 = 6;
/// Ack statuses.
pub const STATUS_OK: u32 = 0;
pub const STATUS_OUT_OF_REGION: u32 = 1;
pub const STATUS_REVOKED: u32 = 5;
/// Challenge length.
pub const CHALLENGE_LEN: usize = 80;

/// A hello announcing `me` (incarnation 7).
pub fn hello(me: &str, flags: u16) -> Vec<u8> {
    let mut b = b"KVBT".to_vec();
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&flags.to_le_bytes());
    b.extend_from_slice(&[0x11; 32]);
    b.extend_from_slice(&7u64.to_le_bytes());
    b.extend_from_slice(&(me.len() as u16).to_le_bytes());
    b.extend_from_slice(me.as_bytes());
    b
}

/// A connection to the engine at `session`, with a generous read timeout
/// (a liveness bound: a test never hangs).
pub fn connect(session: &str) -> TcpStream {
    let s = TcpStream::connect(session).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Open-mode handshake announcing `me`; the verdict.
pub fn handshake(s: &mut TcpStream, me: &str) -> u32 {
    s.write_all(&hello(me, 0)).unwrap();
    let mut ch = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut ch).unwrap();
    assert_eq!(&ch[..4], b"KVBT");
    s.write_all(&[0u8; 32]).unwrap();
    let mut v = [0u8; 8];
    s.read_exact(&mut v).unwrap();
    u32::from_le_bytes(v[..4].try_into().unwrap())
}

/// A connected, authenticated (open mode) raw client announcing `me`.
pub fn client(session: &str, me: &str) -> TcpStream {
    let mut s = connect(session);
    assert_eq!(handshake(&mut s, me), VERDICT_OK);
    s
}

/// A request header.
pub fn header(op: u8, count: u32, seq: u64, payload: u64) -> Vec<u8> {
    let mut b = vec![op, 0, 0, 0];
    b.extend_from_slice(&count.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&payload.to_le_bytes());
    b
}

/// Append a `(dst, len)` descriptor.
pub fn desc(out: &mut Vec<u8>, dst: u64, len: u64) {
    out.extend_from_slice(&dst.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
}

/// Read one ack: `(seq, status, index)`.
pub fn ack(s: &mut TcpStream) -> (u64, u32, u32) {
    let mut b = [0u8; 16];
    s.read_exact(&mut b).unwrap();
    (
        u64::from_le_bytes(b[..8].try_into().unwrap()),
        u32::from_le_bytes(b[8..12].try_into().unwrap()),
        u32::from_le_bytes(b[12..].try_into().unwrap()),
    )
}

/// Whether the server closed the connection: a read returns end of
/// stream or a reset (not data, not a timeout).
pub fn closed_by_peer(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 256];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

/// Wait until `cond` holds, at most 20 s (a liveness bound, not a speed
/// requirement); panics with `what` otherwise.
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "never happened: {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Byte `off` of `buf`, which a peer may be writing (volatile: the test only looks).
pub fn peek(buf: &HostBuffer, off: usize) -> u8 {
    assert!(off < buf.len());
    let p = std::ptr::with_exposed_provenance::<u8>(buf.addr() as usize + off);
    // SAFETY: `off` is inside `buf`, which is alive (borrowed) for the call.
    unsafe { std::ptr::read_volatile(p) }
}

/// Bytes `range` of `buf`, read volatile (see [`peek`]).
pub fn snapshot(buf: &HostBuffer, range: std::ops::Range<usize>) -> Vec<u8> {
    range.map(|i| peek(buf, i)).collect()
}
