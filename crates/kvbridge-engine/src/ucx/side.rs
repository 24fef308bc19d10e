//! The UCX engine's side channel: how peers find each other by session id
//! (`host:port`) and obtain what a one-sided put needs — the target's UCP
//! worker address and the packed remote keys of the regions it registered —
//! plus its incarnation, so a restarted peer is told apart.
//!
//! One short TCP connection per question, authenticated with the optional
//! cluster secret through the session layer's handshake (mutual HMAC
//! challenge-response, [`crate::session::handshake`]); the server proves
//! itself first, and a client that did not prove the secret never receives
//! the worker address or a key.
//!
//! ```text
//! C->S Hello      "KVBU" | version u16 | flags u16 | client nonce [32]
//! S->C Challenge  "KVBU" | version u16 | flags u16 | incarnation u64 | server nonce [32] | server proof [32]
//! C->S Response   client proof [32] | op u32 (1 info, 2 ping) | 0 u32
//! S->C Verdict    status u32 (0 ok, 1 auth, 2 bad request) | body bytes u32
//!      Body (info) worker address bytes u32 | address | regions u32 |
//!                  regions x (addr u64 | len u64 | rkey bytes u32 | rkey)
//! ```
//! Little-endian; the client decodes the body strictly (limits below) and
//! never trusts a length it has not checked.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use crate::session::auth;
use crate::session::handshake::{self, Proto};
use crate::session::io;
use crate::session::server::{Gate, Service};
use crate::session::wire::{CHALLENGE_LEN, HELLO_LEN, Hello, NONCE_LEN as NONCE, u32_at, u64_at};
use crate::{ErrorKind, TransferError};

const MAGIC: [u8; 4] = *b"KVBU";
const VERSION: u16 = 1;
#[cfg(test)]
const FLAG_SECRET: u16 = crate::session::wire::FLAG_SECRET;
/// The side channel's handshake.
const SIDE: Proto = Proto {
    magic: MAGIC,
    version: VERSION,
    peer: "ucx engine",
    versioned: "side-channel",
};
const RESPONSE_LEN: usize = NONCE + 8;
const VERDICT_LEN: usize = 8;
const VERDICT_OK: u32 = 0;
const VERDICT_AUTH: u32 = 1;
const VERDICT_BAD: u32 = 2;
/// Limits on what a peer may send us.
const MAX_BODY: usize = 64 << 20;
const MAX_WORKER_ADDR: usize = 1 << 20;
const MAX_RKEY: usize = 64 << 10;

/// What the client asks for after the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    /// The worker address and the published regions with their keys.
    Info,
    /// Only "alive, and which incarnation".
    Ping,
}

impl Ask {
    fn code(self) -> u32 {
        match self {
            Ask::Info => 1,
            Ask::Ping => 2,
        }
    }
}

/// A region a peer published: its length and packed remote key.
#[derive(Debug, Clone)]
pub(crate) struct RemoteRegion {
    pub len: u64,
    pub rkey: Arc<[u8]>,
}

/// Everything learnt from one handshake with a peer.
#[derive(Debug)]
pub(crate) struct PeerInfo {
    /// The peer's session id.
    pub session: String,
    /// The peer engine's incarnation.
    pub incarnation: u64,
    /// The peer's UCP worker address.
    pub worker: Vec<u8>,
    /// The peer's published regions, by start address.
    pub regions: BTreeMap<u64, RemoteRegion>,
}

impl PeerInfo {
    /// The region containing all of `[addr, addr + len)`, if published.
    pub(crate) fn region_of(&self, addr: u64, len: u64) -> Option<(u64, &RemoteRegion)> {
        let (&start, r) = self.regions.range(..=addr).next_back()?;
        let end = addr.checked_add(len)?;
        (end <= start.checked_add(r.len)?).then_some((start, r))
    }
}

/// What the side-channel server answers with; shared with the engine.
#[derive(Debug)]
pub(crate) struct Published {
    /// The handshake key (derived from the cluster secret), if any.
    pub secret: Option<Vec<u8>>,
    pub incarnation: u64,
    pub worker: Vec<u8>,
    pub regions: RwLock<BTreeMap<u64, RemoteRegion>>,
    pub shutdown: AtomicBool,
    pub io_timeout: Duration,
    pub served: AtomicU64,
    pub auth_failures: AtomicU64,
    /// The accept loop's counters: connections answered now, and those
    /// closed at once because [`MAX_SIDE_CONNECTIONS`] were open.
    pub gate: Gate,
}

/// Most side-channel connections answered at once (each on its own
/// thread); more are closed at once. A question takes one round trip, so
/// honest peers hold a slot for milliseconds.
pub(crate) const MAX_SIDE_CONNECTIONS: usize = 64;

/// The side channel plugs into the session layer's accept loop: at most
/// [`MAX_SIDE_CONNECTIONS`] are answered at once, each within `io_timeout`
/// in all; more are closed at once.
impl Service for Published {
    const WHAT: &'static str = "ucx side channel";
    const THREAD: &'static str = "kvb-ucx-side";

    fn is_shutdown(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    fn max_connections(&self) -> usize {
        MAX_SIDE_CONNECTIONS
    }

    fn gate(&self) -> &Gate {
        &self.gate
    }

    fn serve(self: Arc<Self>, stream: TcpStream, _id: u64, _accepted_at: Instant) {
        if let Err(e) = serve(&self, stream) {
            tracing::debug!(error = %e, "ucx side channel: connection dropped");
        }
    }
}

/// Accept side-channel connections until `published.shutdown` is set.
pub(crate) fn accept_loop(published: Arc<Published>, listener: TcpListener) {
    crate::session::server::accept_loop(published, listener);
}

/// Answer one side-channel connection.
fn serve(p: &Published, s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    // The whole exchange within `io_timeout`: a peer trickling bytes holds
    // its slot no longer than one that sends nothing.
    let stop = || p.shutdown.load(Ordering::Acquire);
    let mut budget = io::Budget::new(Instant::now() + p.io_timeout, p.io_timeout, &stop);
    let fd = s.as_raw_fd();
    let send = |buf: &[u8], budget: &mut io::Budget<'_>| io::write_all_by(fd, buf, budget);
    let mut hello = [0u8; HELLO_LEN];
    io::read_exact_by(fd, &mut hello, &mut budget)?;
    let Some((_, flags, client_nonce)) = Hello::decode_prefix_as(MAGIC, &hello) else {
        return Err(std::io::Error::other("not a kvbridge ucx client"));
    };
    let secret = p.secret.as_deref();
    let ch = handshake::challenge(SIDE, secret, p.incarnation, flags, &client_nonce);
    send(&ch.encode_as(MAGIC), &mut budget)?;
    let mut resp = [0u8; RESPONSE_LEN];
    io::read_exact_by(fd, &mut resp, &mut budget)?;
    let client_proof: [u8; NONCE] = arr(&resp);
    if let Some(sec) = secret
        && !handshake::verify(sec, &ch, &client_nonce, None, &client_proof)
    {
        p.auth_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(peer = ?s.peer_addr().ok(), "ucx side channel: client failed authentication");
        send(&verdict(VERDICT_AUTH, 0), &mut budget)?;
        return Ok(());
    }
    let op = u32_at(&resp, NONCE);
    let body = match op {
        1 => info_body(p),
        2 => Vec::new(),
        _ => {
            send(&verdict(VERDICT_BAD, 0), &mut budget)?;
            return Ok(());
        }
    };
    let Ok(n) = u32::try_from(body.len()) else {
        send(&verdict(VERDICT_BAD, 0), &mut budget)?;
        return Ok(());
    };
    send(&verdict(VERDICT_OK, n), &mut budget)?;
    send(&body, &mut budget)?;
    p.served.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn verdict(status: u32, len: u32) -> [u8; VERDICT_LEN] {
    let mut v = [0u8; VERDICT_LEN];
    v[..4].copy_from_slice(&status.to_le_bytes());
    v[4..].copy_from_slice(&len.to_le_bytes());
    v
}

fn info_body(p: &Published) -> Vec<u8> {
    encode_info(&p.worker, &p.regions.read())
}

/// Encode an info body: what [`decode_info`] reads.
pub(crate) fn encode_info(worker: &[u8], regions: &BTreeMap<u64, RemoteRegion>) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(worker.len() as u32).to_le_bytes());
    b.extend_from_slice(worker);
    b.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for (addr, r) in regions.iter() {
        b.extend_from_slice(&addr.to_le_bytes());
        b.extend_from_slice(&r.len.to_le_bytes());
        b.extend_from_slice(&(r.rkey.len() as u32).to_le_bytes());
        b.extend_from_slice(&r.rkey);
    }
    b
}

fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

/// Strict decoder of an info body: every length is checked before use.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|s| u32_at(s, 0))
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|s| u64_at(s, 0))
    }
}

/// Decode an info body; `None` if it is malformed or over the limits.
pub(crate) fn decode_info(body: &[u8]) -> Option<(Vec<u8>, BTreeMap<u64, RemoteRegion>)> {
    let mut c = Cursor { b: body, at: 0 };
    let wlen = c.u32()? as usize;
    if wlen == 0 || wlen > MAX_WORKER_ADDR {
        return None;
    }
    let worker = c.take(wlen)?.to_vec();
    let count = c.u32()? as usize;
    let mut regions: BTreeMap<u64, RemoteRegion> = BTreeMap::new();
    for _ in 0..count {
        let addr = c.u64()?;
        let len = c.u64()?;
        let klen = c.u32()? as usize;
        if len == 0 || addr == 0 || addr.checked_add(len).is_none() || klen > MAX_RKEY {
            return None;
        }
        let rkey: Arc<[u8]> = c.take(klen)?.into();
        // Regions must be sorted and disjoint, as a registry publishes them.
        if let Some((&prev, r)) = regions.iter().next_back()
            && prev.saturating_add(r.len) > addr
        {
            return None;
        }
        regions.insert(addr, RemoteRegion { len, rkey });
    }
    (c.at == body.len()).then_some((worker, regions))
}

/// Ask the peer at `session`: handshake (authenticating both ways when
/// `secret` is set), then `ask`. Returns the peer's incarnation and, for
/// [`Ask::Info`], what it published.
pub(crate) fn query(
    session: &str,
    addr: SocketAddr,
    secret: Option<&[u8]>,
    timeout: Duration,
    ask: Ask,
) -> Result<(u64, Option<PeerInfo>), TransferError> {
    let err = |kind, d: String| TransferError::new(session, None, kind, d);
    let io = |e: std::io::Error| TransferError::from_io(session, None, &e);
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| err(ErrorKind::Unreachable, format!("connect to {addr}: {e}")))?;
    s.set_nodelay(true).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    let my_nonce = auth::nonce();
    let hello = Hello::encode_prefix_as(MAGIC, VERSION, handshake::flags(secret), &my_nonce);
    s.write_all(&hello).map_err(io)?;
    let mut ch = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut ch).map_err(io)?;
    let (ch, proof) = handshake::respond(SIDE, session, secret, &my_nonce, &ch, None)?;
    let incarnation = ch.incarnation;
    let mut resp = Vec::with_capacity(RESPONSE_LEN);
    resp.extend_from_slice(&proof);
    resp.extend_from_slice(&ask.code().to_le_bytes());
    resp.extend_from_slice(&0u32.to_le_bytes());
    s.write_all(&resp).map_err(io)?;
    let mut v = [0u8; VERDICT_LEN];
    s.read_exact(&mut v).map_err(io)?;
    let (status, len) = (u32_at(&v, 0), u32_at(&v, 4) as usize);
    match status {
        VERDICT_OK => {}
        VERDICT_AUTH => {
            let d = if secret.is_none() {
                "peer requires a cluster secret"
            } else {
                "peer refused our cluster secret proof"
            };
            return Err(err(ErrorKind::Auth, d.into()));
        }
        other => {
            return Err(err(
                ErrorKind::Refused,
                format!("peer refused the request ({other})"),
            ));
        }
    }
    if ask == Ask::Ping {
        return Ok((incarnation, None));
    }
    if len > MAX_BODY {
        return Err(err(ErrorKind::Refused, format!("info of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(io)?;
    let (worker, regions) =
        decode_info(&body).ok_or_else(|| err(ErrorKind::Refused, "malformed peer info".into()))?;
    Ok((
        incarnation,
        Some(PeerInfo {
            session: session.to_owned(),
            incarnation,
            worker,
            regions,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(secret: Option<&str>) -> (Arc<Published>, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut regions = BTreeMap::new();
        regions.insert(
            0x1000,
            RemoteRegion {
                len: 0x1000,
                rkey: Arc::from(&b"key-one"[..]),
            },
        );
        let p = Arc::new(Published {
            secret: secret.map(|s| s.as_bytes().to_vec()),
            incarnation: 77,
            worker: b"worker-address".to_vec(),
            regions: RwLock::new(regions),
            shutdown: AtomicBool::new(false),
            io_timeout: Duration::from_secs(2),
            served: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            gate: Gate::default(),
        });
        let p2 = p.clone();
        std::thread::spawn(move || accept_loop(p2, l));
        (p, addr)
    }

    const T: Duration = Duration::from_secs(2);

    #[test]
    fn info_round_trip_with_and_without_secret() {
        let (_p, a) = server(None);
        let (inc, info) = query("s", a, None, T, Ask::Info).unwrap();
        let info = info.unwrap();
        assert_eq!((inc, info.incarnation), (77, 77));
        assert_eq!(info.worker, b"worker-address");
        assert_eq!(&*info.region_of(0x1800, 0x800).unwrap().1.rkey, b"key-one");
        assert!(info.region_of(0x1800, 0x801).is_none());
        assert!(info.region_of(0xfff, 2).is_none());
        let (_p, a) = server(Some("s3cret"));
        let (inc, info) = query("s", a, Some(b"s3cret"), T, Ask::Info).unwrap();
        assert_eq!(inc, 77);
        assert_eq!(info.unwrap().regions.len(), 1);
        assert_eq!(query("s", a, Some(b"s3cret"), T, Ask::Ping).unwrap().0, 77);
    }

    #[test]
    fn a_client_without_the_secret_never_receives_a_key() {
        let (p, a) = server(Some("s3cret"));
        let e = query("s", a, None, T, Ask::Info).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Auth, "{e}");
        let e = query("s", a, Some(b"wrong"), T, Ask::Info).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Auth, "{e}");
        // Raw: a client that sends a bogus proof gets a bare refusal and EOF.
        let mut s = TcpStream::connect(a).unwrap();
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&FLAG_SECRET.to_le_bytes());
        hello.extend_from_slice(&[7u8; NONCE]);
        s.write_all(&hello).unwrap();
        let mut ch = [0u8; CHALLENGE_LEN];
        s.read_exact(&mut ch).unwrap();
        let mut resp = vec![9u8; NONCE];
        resp.extend_from_slice(&1u32.to_le_bytes());
        resp.extend_from_slice(&0u32.to_le_bytes());
        s.write_all(&resp).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, verdict(VERDICT_AUTH, 0));
        // (The client with the wrong secret gave up before answering: the
        // server's proof did not verify.)
        assert_eq!(p.auth_failures.load(Ordering::Relaxed), 2);
        assert_eq!(p.served.load(Ordering::Relaxed), 0);
        // A server without a secret is refused by a client that has one.
        let (_p, a) = server(None);
        let e = query("s", a, Some(b"s3cret"), T, Ask::Info).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Auth, "{e}");
    }

    #[test]
    fn malformed_info_is_rejected() {
        let good = {
            let mut b = Vec::new();
            b.extend_from_slice(&2u32.to_le_bytes());
            b.extend_from_slice(b"wa");
            b.extend_from_slice(&1u32.to_le_bytes());
            b.extend_from_slice(&0x1000u64.to_le_bytes());
            b.extend_from_slice(&16u64.to_le_bytes());
            b.extend_from_slice(&1u32.to_le_bytes());
            b.push(5);
            b
        };
        assert!(decode_info(&good).is_some());
        for cut in 0..good.len() {
            assert!(decode_info(&good[..cut]).is_none(), "prefix {cut}");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(decode_info(&trailing).is_none());
        let mut huge_count = good.clone();
        huge_count[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_info(&huge_count).is_none());
        let mut overflow = good.clone();
        overflow[10..18].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_info(&overflow).is_none());
    }

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(
                std::time::Instant::now() < until,
                "timed out waiting: {what}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Strangers that open connections and send nothing (or trickle a
    /// byte at a time) hold at most MAX_SIDE_CONNECTIONS handler threads,
    /// each for at most io_timeout in all; past that an honest client is
    /// answered again.
    #[test]
    fn idle_and_trickling_strangers_cannot_pile_up_handlers() {
        let (p, a) = server(Some("s3cret"));
        let idle: Vec<TcpStream> = (0..MAX_SIDE_CONNECTIONS + 40)
            .map(|_| TcpStream::connect(a).unwrap())
            .collect();
        wait_for("the extra connections refused", || {
            p.gate.refused.load(Ordering::Relaxed) >= 40
        });
        assert_eq!(
            p.gate.open.load(Ordering::Relaxed),
            MAX_SIDE_CONNECTIONS as u64
        );
        drop(idle);
        wait_for("the idle strangers' slots given back", || {
            p.gate.open.load(Ordering::Relaxed) == 0
        });
        // A trickler: one byte of its hello every 300 ms, under the 2 s
        // no-progress limit, yet cut off by the 2 s deadline for the whole.
        let mut trickler = TcpStream::connect(a).unwrap();
        let started = std::time::Instant::now();
        let trickle = std::thread::spawn(move || {
            // 40 hello bytes at 300 ms: 12 s if nobody cut it off.
            for _ in 0..HELLO_LEN {
                if trickler.write_all(&MAGIC[..1]).is_err() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            false
        });
        wait_for("the trickler accepted", || {
            p.gate.open.load(Ordering::Relaxed) == 1
        });
        wait_for("the trickler's slot given back", || {
            p.gate.open.load(Ordering::Relaxed) == 0
        });
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "a trickling stranger held its slot {:?}",
            started.elapsed()
        );
        assert!(
            trickle.join().unwrap(),
            "the server never closed the trickler"
        );
        let (inc, info) = query("s", a, Some(b"s3cret"), T, Ask::Info).unwrap();
        assert_eq!(inc, 77);
        assert!(info.is_some());
    }
}
