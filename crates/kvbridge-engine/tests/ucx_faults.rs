//! The UCX engine under failure, between processes over TCP and over shared
//! memory: a killed peer gives an error within the timeout while the engine
//! keeps serving others; a restarted peer is handshaken again (new
//! incarnation) and works; probes tell dead from alive.
#![allow(clippy::unwrap_used)]

mod common;
mod ucx_util;

use std::time::{Duration, Instant};

use common::{patterned, register};
use kvbridge_engine::{Batch, Block, ErrorKind, TransferEngine};
use kvbridge_mem::HostBuffer;
use ucx_util::{TRANSPORTS, Target, engine, ucx_or_skip};

const LEN: usize = 16 << 20;

/// The whole buffer in 1 MiB blocks.
fn whole(src: &HostBuffer, t: &Target) -> Vec<Block> {
    (0..(LEN as u64 >> 20))
        .map(|i| Block {
            src: src.addr() + (i << 20),
            dst: t.addr + (i << 20),
            len: 1 << 20,
        })
        .collect()
}

/// The engine's I/O timeout in the tests (`ucx_util::cfg`), plus slack.
const BOUND: Duration = Duration::from_secs(3 + 4);

fn killed_peer_fails_in_time_and_others_keep_working(tls: &str) {
    let a = engine(tls, None);
    let src = patterned(LEN, 21);
    register(&a, &src);
    let mut victim = Target::spawn(tls, LEN, 0, None);
    let mut fine = Target::spawn(tls, LEN, 0, None);
    a.batch_transfer_sync(&victim.session, &whole(&src, &victim))
        .unwrap();
    a.batch_transfer_sync(&fine.session, &whole(&src, &fine))
        .unwrap();
    // Kill it with batches in flight, then keep sending to it.
    let inflight: Vec<_> = (0..8)
        .map(|_| {
            a.submit(
                kvbridge_engine::Target::any(&victim.session),
                Batch::Blocks(&whole(&src, &victim)),
            )
        })
        .collect();
    victim.kill();
    let t = Instant::now();
    let mut first_err = None;
    for h in inflight {
        let r = h
            .wait_timeout(BOUND)
            .expect("a batch to a killed peer hung");
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    if let Some(e) = &first_err {
        eprintln!(
            "over {tls}: in flight at the kill: {e} after {:?}",
            t.elapsed()
        );
    }
    let mut after = None;
    for _ in 0..3 {
        let r = a.submit(
            kvbridge_engine::Target::any(&victim.session),
            Batch::Blocks(&whole(&src, &victim)),
        );
        match r.wait_timeout(BOUND).expect("a batch to a dead peer hung") {
            Err(e) => {
                after = Some(e);
                break;
            }
            Ok(()) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let e = after.or(first_err).expect("no error from a dead peer");
    eprintln!(
        "over {tls}: dead peer reported after {:?}: {e}",
        t.elapsed()
    );
    assert!(
        matches!(
            e.kind,
            ErrorKind::PeerClosed | ErrorKind::Unreachable | ErrorKind::Timeout
        ),
        "{e}"
    );
    assert_eq!(e.session, victim.session);
    assert!(t.elapsed() < 2 * BOUND, "took {:?}", t.elapsed());
    assert!(a.probe(&victim.session).is_err());
    // The other peer is served as before.
    fine.fill(0);
    a.batch_transfer_sync(&fine.session, &whole(&src, &fine))
        .unwrap();
    assert!(fine.dump() == src.as_slice());
    a.probe(&fine.session).unwrap();
}

#[test]
fn killed_peer_fails_in_time_and_others_keep_working_over_tcp() {
    if ucx_or_skip() {
        killed_peer_fails_in_time_and_others_keep_working(TRANSPORTS[0]);
    }
}

#[test]
fn killed_peer_fails_in_time_and_others_keep_working_over_shared_memory() {
    if ucx_or_skip() {
        killed_peer_fails_in_time_and_others_keep_working(TRANSPORTS[1]);
    }
}

fn restarted_peer_is_handshaken_again(tls: &str) {
    let a = engine(tls, None);
    let src = patterned(LEN, 23);
    register(&a, &src);
    let mut old = Target::spawn(tls, LEN, 0, None);
    let (session, port, old_inc) = (old.session.clone(), old.port, old.incarnation);
    a.submit(
        kvbridge_engine::Target::exact(&session, old_inc),
        Batch::Blocks(&whole(&src, &old)),
    )
    .wait()
    .unwrap();
    old.kill();
    drop(old);
    let mut new = Target::spawn(tls, LEN, port, None);
    assert_eq!(new.session, session);
    assert_ne!(new.incarnation, old_inc);
    // Blocks planned for the old incarnation never reach the new one.
    let e = a
        .submit(
            kvbridge_engine::Target::exact(&session, old_inc),
            Batch::Blocks(&whole(&src, &new)),
        )
        .wait()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::PeerRestarted, "{e}");
    assert!(
        new.dump().iter().all(|&b| b == 0),
        "old-incarnation blocks landed"
    );
    // Planned for the new one: a fresh handshake, and every byte arrives.
    a.submit(
        kvbridge_engine::Target::exact(&session, new.incarnation),
        Batch::Blocks(&whole(&src, &new)),
    )
    .wait()
    .unwrap();
    assert!(new.dump() == src.as_slice());
    a.probe(&session).unwrap();
    // Unpinned batches work too.
    new.fill(0);
    a.batch_transfer_sync(&session, &whole(&src, &new)).unwrap();
    assert!(new.dump() == src.as_slice());
}

/// A peer that stops answering (SIGSTOP) times out within the I/O timeout
/// while another peer is served; once it runs again it is served again.
/// (Over shared memory a stopped process still receives: CMA writes into
/// its memory without it, so this is a TCP-only story.)
#[test]
fn hung_peer_times_out_and_recovers_over_tcp() {
    if !ucx_or_skip() {
        return;
    }
    let tls = TRANSPORTS[0];
    let a = engine(tls, None);
    let src = patterned(LEN, 25);
    register(&a, &src);
    let mut hung = Target::spawn(tls, LEN, 0, None);
    let mut fine = Target::spawn(tls, LEN, 0, None);
    a.batch_transfer_sync(&hung.session, &whole(&src, &hung))
        .unwrap();
    hung.signal("STOP");
    let t = Instant::now();
    let stuck: Vec<_> = (0..4)
        .map(|_| {
            a.submit(
                kvbridge_engine::Target::any(&hung.session),
                Batch::Blocks(&whole(&src, &hung)),
            )
        })
        .collect();
    // Meanwhile the other peer is served.
    fine.fill(0);
    a.batch_transfer_sync(&fine.session, &whole(&src, &fine))
        .unwrap();
    assert!(fine.dump() == src.as_slice());
    let mut timed_out = 0;
    for h in stuck {
        let r = h.wait_timeout(BOUND).expect("a batch to a hung peer hung");
        if let Err(e) = r {
            assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
            assert_eq!(e.session, hung.session);
            assert!(e.block.is_some(), "{e}");
            timed_out += 1;
        }
    }
    assert!(
        timed_out > 0,
        "64 MiB fit into a stopped peer's socket buffers?"
    );
    assert!(t.elapsed() < BOUND, "took {:?}", t.elapsed());
    hung.signal("CONT");
    hung.fill(0);
    a.batch_transfer_sync(&hung.session, &whole(&src, &hung))
        .unwrap();
    assert!(hung.dump() == src.as_slice());
}

#[test]
fn restarted_peer_is_handshaken_again_over_tcp() {
    if ucx_or_skip() {
        restarted_peer_is_handshaken_again(TRANSPORTS[0]);
    }
}

#[test]
fn restarted_peer_is_handshaken_again_over_shared_memory() {
    if ucx_or_skip() {
        restarted_peer_is_handshaken_again(TRANSPORTS[1]);
    }
}
