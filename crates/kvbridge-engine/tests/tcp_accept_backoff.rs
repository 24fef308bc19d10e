//! The accept loop out of file descriptors: it backs off instead of
//! spinning, counts the failures, and serves the pending connection once
//! descriptors are back. Alone in its test binary: it lowers the process's
//! descriptor limit and fills the descriptor table.
#![allow(clippy::unwrap_used)]

mod common;
mod raw;

use std::io::Write;
use std::time::Duration;

use common::*;
use kvbridge_engine::TransferEngine;
use raw::*;

fn nofile() -> libc::rlimit {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid rlimit for the call to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) }, 0);
    l
}

fn set_nofile(l: &libc::rlimit) {
    // SAFETY: `l` is a valid rlimit, read by the call.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, l) }, 0);
}

#[test]
fn accept_backs_off_when_out_of_descriptors() {
    let e = tcp(cfg());
    let saved = nofile();
    let open_now = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    set_nofile(&libc::rlimit {
        rlim_cur: (open_now + 32).min(saved.rlim_max),
        rlim_max: saved.rlim_max,
    });
    // Fill the descriptor table, then free one for our connection: the
    // kernel completes it, and the engine's accept fails with EMFILE.
    let mut fillers = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => fillers.push(f),
            Err(err) => {
                assert_eq!(err.raw_os_error(), Some(libc::EMFILE), "{err}");
                break;
            }
        }
    }
    fillers.pop();
    let mut s = connect(e.session_id());
    wait_until("accept failed", || e.stats().accept_errors >= 1);
    // Back-off: a handful of retries in about a second (a loop retrying at
    // once would count thousands, at full CPU).
    std::thread::sleep(Duration::from_secs(1));
    let n = e.stats().accept_errors;
    assert!(n <= 30, "accept retried {n} times in about a second");
    assert_eq!(e.stats().connections_accepted, 0);
    // Descriptors back: the pending connection is served.
    drop(fillers);
    set_nofile(&saved);
    assert_eq!(handshake(&mut s, "me:1"), VERDICT_OK);
    s.write_all(&header(OP_PING, 0, 1, 0)).unwrap();
    assert_eq!(ack(&mut s), (1, STATUS_OK, 0));
    assert_eq!(e.stats().connections_accepted, 1);
}
