//! `kvbridge demo --rogue`: a hostile host on the same network, without the
//! cluster secret, attacking the run while it transfers. It forges control
//! messages for the run's own rooms to every rank's zmq socket (Success
//! status, ABORT_ACK, STATE_DATA into the KV pools, transfer requests,
//! aborts, and transfer requests with long page lists naming made-up
//! endpoints), holds idle and half-open connections on every engine port
//! (re-opening those the engine closes), starts zmq handshakes that park a
//! large frame before authentication, holds bootstrap writes whose body
//! never comes, and sends unsigned registrations to the bootstrap server.
//! In secret mode the run must finish as without it; in open mode
//! (`--open --rogue`) it shows what an unauthenticated cluster is exposed
//! to.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kvbridge_wire::{
    Abort, AbortAck, KvPoll, PackedArray, StateData, Status, Transfer, TransferPages,
};
use serde::Serialize;

/// Idle connections held open per engine port.
const IDLE_PER_ENGINE: usize = 64;
/// Bootstrap writes held open without their body.
const SLOW_BODIES: usize = 96;
/// zmq connections per rank that park a large frame before authentication.
const PARKED_PER_RANK: usize = 2;
/// The size such a frame announces (all but its last byte is sent).
const PARKED_FRAME: usize = 8 << 20;

/// What the rogue did during the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RogueReport {
    /// Forged control messages queued to the ranks' zmq sockets.
    pub forged_messages: u64,
    /// Idle or half-open connections opened on the engines' ports
    /// (re-opened when the engine closed them).
    pub idle_connections: u64,
    /// Bootstrap writes opened whose body never came.
    pub slow_bodies: u64,
    /// zmq connections that parked a large frame before authentication.
    pub parked_frames: u64,
    /// Unsigned bootstrap registrations sent.
    pub bootstrap_writes: u64,
    /// Of those, how many the bootstrap server accepted (200).
    pub bootstrap_accepted: u64,
    /// Most open file descriptors seen in any rank process meanwhile.
    pub max_rank_fds: u64,
    /// Most threads seen in any rank process meanwhile.
    pub max_rank_threads: u64,
    /// Largest resident memory seen in any rank process, in MiB.
    pub max_rank_rss_mib: u64,
}

/// A ranks' address the rogue aims at.
#[derive(Debug, Clone)]
pub struct Target {
    /// The rank's zmq control port (on loopback).
    pub control_port: u16,
    /// The rank's engine session, `host:port`.
    pub engine_session: String,
}

/// The running attack; [`Rogue::stop`] ends it and reports.
#[derive(Debug)]
pub struct Rogue {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<RogueReport>>,
}

impl Rogue {
    /// Starts attacking `targets` and `bootstrap` about the rooms `rooms`,
    /// sampling the resources of the rank processes `pids` meanwhile.
    pub fn start(
        bootstrap: SocketAddr,
        targets: Vec<Target>,
        rooms: Vec<u64>,
        pids: Vec<u32>,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("demo-rogue".into())
            .spawn(move || attack(&s, bootstrap, &targets, &rooms, &pids))
            .ok();
        Self { stop, thread }
    }

    /// Stops the attack and closes everything it held.
    pub fn stop(mut self) -> RogueReport {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Rogue {
    fn drop(&mut self) {
        // A run that ends early (an error) stops the attack too.
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn attack(
    stop: &AtomicBool,
    bootstrap: SocketAddr,
    targets: &[Target],
    rooms: &[u64],
    pids: &[u32],
) -> RogueReport {
    let mut report = RogueReport::default();
    // Idle and half-open engine connections, held for the whole run.
    let mut held = Vec::new();
    for t in targets {
        let Ok(addr) = t.engine_session.parse::<SocketAddr>() else {
            continue;
        };
        if !addr.ip().is_loopback() {
            continue; // only ever aim at this machine
        }
        for i in 0..IDLE_PER_ENGINE {
            if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                if i % 2 == 1 {
                    // Half a hello, then silence.
                    let _ = s.write_all(b"KVB");
                }
                held.push(s);
                report.idle_connections += 1;
            }
        }
    }
    let mut slow = Vec::new();
    let mut parked = Vec::new();
    let ctx = zmq::Context::new();
    let sockets: Vec<zmq::Socket> = targets
        .iter()
        .filter_map(|t| {
            let s = ctx.socket(zmq::PUSH).ok()?;
            s.set_linger(0).ok()?;
            s.set_sndhwm(100_000).ok()?;
            s.connect(&format!("tcp://127.0.0.1:{}", t.control_port))
                .ok()?;
            Some(s)
        })
        .collect();
    let mut round = 0u64;
    while !stop.load(Ordering::SeqCst) {
        reopen_idle(targets, &mut held, &mut report);
        refill(
            &mut slow,
            SLOW_BODIES,
            || slow_body(bootstrap),
            &mut report.slow_bodies,
        );
        if round.is_multiple_of(25) {
            // Re-park: the inboxes close them after their handshake deadline.
            parked.retain(|c: &TcpStream| c.peer_addr().is_ok());
            let want = PARKED_PER_RANK * targets.len();
            refill(
                &mut parked,
                want,
                || park(targets, round),
                &mut report.parked_frames,
            );
        }
        if round.is_multiple_of(10) {
            let junk = junk_transfer(round);
            for s in &sockets {
                if s.send_multipart(junk.iter(), zmq::DONTWAIT).is_ok() {
                    report.forged_messages += 1;
                }
            }
        }
        for &room in rooms {
            for message in forged(room, round) {
                for s in &sockets {
                    if s.send_multipart(message.iter(), zmq::DONTWAIT).is_ok() {
                        report.forged_messages += 1;
                    }
                }
            }
        }
        report.bootstrap_writes += 1;
        if unsigned_registration(bootstrap, round) == Some(200) {
            report.bootstrap_accepted += 1;
        }
        for &pid in pids {
            sample(pid, &mut report);
        }
        round += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(sockets);
    drop(held);
    drop(slow);
    drop(parked);
    report
}

/// Whether the peer closed `s` (EOF or error), without waiting.
fn closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 64];
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let gone = match (&*s).read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = s.set_nonblocking(false);
    gone
}

/// Drops the connections their peer closed and opens new ones with `open`
/// until there are `want`, counting each opened.
fn refill(
    conns: &mut Vec<TcpStream>,
    want: usize,
    mut open: impl FnMut() -> Option<TcpStream>,
    opened: &mut u64,
) {
    conns.retain(|c| !closed(c));
    while conns.len() < want {
        let Some(c) = open() else {
            return;
        };
        conns.push(c);
        *opened += 1;
    }
}

/// Re-opens the engine connections the engines closed (evicted handshakes).
fn reopen_idle(targets: &[Target], held: &mut Vec<TcpStream>, report: &mut RogueReport) {
    held.retain(|c| !closed(c));
    let per = IDLE_PER_ENGINE;
    let want = per * targets.len();
    let mut i = 0usize;
    while held.len() < want && i < want {
        let t = &targets[i % targets.len()];
        i += 1;
        let Ok(addr) = t.engine_session.parse::<SocketAddr>() else {
            continue;
        };
        if !addr.ip().is_loopback() {
            continue;
        }
        if let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            held.push(s);
            report.idle_connections += 1;
        }
    }
}

/// A `PUT /route` head announcing a 4 KiB body that never comes.
fn slow_body(bootstrap: SocketAddr) -> Option<TcpStream> {
    let mut s = TcpStream::connect_timeout(&bootstrap, Duration::from_millis(200)).ok()?;
    let head = format!(
        "PUT /route HTTP/1.1\r\nHost: {bootstrap}\r\nContent-Type: application/json\r\n\
         Content-Length: 4096\r\n\r\n{{"
    );
    s.write_all(head.as_bytes()).ok()?;
    Some(s)
}

/// A zmq connection to one of `targets` (by `round`) that starts a CURVE
/// handshake and sends all but the last byte of a large frame instead of
/// its HELLO.
fn park(targets: &[Target], round: u64) -> Option<TcpStream> {
    let t = targets.get((round as usize) % targets.len().max(1))?;
    let mut s = TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], t.control_port)),
        Duration::from_millis(200),
    )
    .ok()?;
    s.set_write_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut greeting = vec![0xffu8, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    let mut mechanism = b"CURVE".to_vec();
    mechanism.resize(20, 0);
    greeting.extend_from_slice(&mechanism);
    greeting.resize(64, 0);
    s.write_all(&greeting).ok()?;
    let mut head = vec![0x06u8];
    head.extend_from_slice(&(PARKED_FRAME as u64).to_be_bytes());
    s.write_all(&head).ok()?;
    s.write_all(&vec![0x41u8; PARKED_FRAME - 1]).ok()?;
    Some(s)
}

/// Folds the fd count, thread count and resident memory of `pid` into the
/// report's maxima; a process that is gone is skipped.
fn sample(pid: u32, report: &mut RogueReport) {
    if let Some(u) = super::resources::Usage::of(pid) {
        report.max_rank_fds = report.max_rank_fds.max(u.fds);
        report.max_rank_threads = report.max_rank_threads.max(u.threads);
        report.max_rank_rss_mib = report.max_rank_rss_mib.max(u.rss_mib);
    }
}

/// Forged messages about `room`, in both directions.
fn forged(room: u64, round: u64) -> Vec<Vec<Vec<u8>>> {
    let owned = |parts: Vec<std::borrow::Cow<'_, [u8]>>| -> Vec<Vec<u8>> {
        parts.into_iter().map(|p| p.into_owned()).collect()
    };
    let status = Status {
        room,
        status: KvPoll::Success,
        prefill_rank: 0,
        failure_reason: None,
    };
    let ack = AbortAck {
        room,
        prefill_rank: Some(0),
        generation: Some(round % 4),
    };
    let state = StateData {
        room,
        dst_addr: 0x7f00_0000_0000 + (round % 64) * 4096,
        data: vec![0xee; 256].into(),
    };
    let transfer = Transfer {
        room,
        endpoint: "127.0.0.1".into(),
        dst_port: 9,
        mooncake_session_id: "127.0.0.1:9".into(),
        pages: Some(TransferPages {
            dst_kv_indices: PackedArray::from(vec![0i32, 1, 2, 3]),
            dst_aux_index: 0,
            ..TransferPages::default()
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
    };
    let abort = Abort {
        room,
        decode_ip: "127.0.0.1".into(),
        decode_port: 9,
        generation: Some(round),
    };
    vec![
        owned(status.encode()),
        owned(ack.encode()),
        owned(state.encode()),
        owned(transfer.encode()),
        owned(abort.encode()),
    ]
}

/// A transfer request with a long page list (64 KiB) for a made-up room,
/// from a made-up decode endpoint (a new one each time).
fn junk_transfer(round: u64) -> Vec<Vec<u8>> {
    let port = 20_000 + (round % 20_000) as u16;
    let junk = Transfer {
        room: (round << 20) ^ 0x5a5a_5a5a,
        endpoint: "127.0.0.1".into(),
        dst_port: port,
        mooncake_session_id: format!("127.0.0.1:{port}").into(),
        pages: Some(TransferPages {
            dst_kv_indices: PackedArray::from(vec![7i32; 1 << 14]),
            dst_aux_index: 0,
            ..TransferPages::default()
        }),
        required_dst_info_num: 2,
        decode_prefix_len: Some(0),
    };
    junk.encode().into_iter().map(|p| p.into_owned()).collect()
}

/// One unsigned `PUT /route` re-pointing prefill rank 0; the HTTP status.
fn unsigned_registration(bootstrap: SocketAddr, round: u64) -> Option<u16> {
    let body = format!(
        "{{\"attn_tp_size\":1,\"attn_tp_rank\":0,\"attn_cp_size\":1,\"attn_cp_rank\":0,\
         \"attn_dp_size\":1,\"attn_dp_rank\":0,\"pp_size\":1,\"pp_rank\":0,\
         \"system_dp_size\":1,\"system_dp_rank\":0,\"rank_ip\":\"127.0.0.1\",\
         \"rank_port\":{},\"page_size\":16,\"kv_cache_dtype\":\"auto\"}}",
        9 + round % 100
    );
    let mut s = TcpStream::connect_timeout(&bootstrap, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!(
        "PUT /route HTTP/1.1\r\nHost: {bootstrap}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).ok()?;
    let mut head = [0u8; 16];
    let n = s.read(&mut head).ok()?;
    std::str::from_utf8(head.get(..n)?)
        .ok()?
        .split(' ')
        .nth(1)?
        .parse()
        .ok()
}
