//! `kvbridge demo --rogue`: a hostile host on the same network, without the
//! cluster secret, attacking the run while it transfers. It forges control
//! messages for the run's own rooms to every rank's zmq socket (Success
//! status, ABORT_ACK, STATE_DATA into the KV pools, transfer requests,
//! aborts), holds idle and half-open connections on every engine port, and
//! sends unsigned registrations to the bootstrap server. In secret mode the
//! run must finish as without it; in open mode (`--open --rogue`) it shows
//! what an unauthenticated cluster is exposed to.

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

/// What the rogue did during the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RogueReport {
    /// Forged control messages queued to the ranks' zmq sockets.
    pub forged_messages: u64,
    /// Idle or half-open connections held on the engines' ports.
    pub idle_connections: u64,
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
    report
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
