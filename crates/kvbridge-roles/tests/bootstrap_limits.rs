//! 1,100 idle connections to the bootstrap port, with fewer file
//! descriptors than would hold them all (as on a host with a small
//! RLIMIT_NOFILE), must not stop it from answering `GET /health` promptly
//! (decode heartbeats), and the idle connections are closed after the
//! header timeout. Alone in its binary: it changes the process's fd limit.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvbridge_roles::bootstrap::{BootstrapConfig, BootstrapLimits, BootstrapServer};

const IDLE: usize = 1100;
const CAP: usize = 256;
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);

fn nofile() -> libc::rlimit {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim
}

fn set_nofile(lim: &libc::rlimit) -> bool {
    // SAFETY: `lim` is a valid rlimit.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, lim) == 0 }
}

/// One past the highest file descriptor open now.
fn fd_ceiling() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .map_or(0, |m| m + 1)
}

/// Whether the server closed `s` (EOF or reset) rather than keeping it open.
fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        }
    }
}

#[test]
fn idle_connections_do_not_starve_health_checks() {
    let config = BootstrapConfig {
        limits: BootstrapLimits {
            max_connections: CAP,
            header_timeout: HEADER_TIMEOUT,
            ..BootstrapLimits::default()
        },
        ..BootstrapConfig::default()
    };
    let bs = BootstrapServer::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let addr = bs.local_addr();

    // Room for our 1,100 client sockets and the server's capped share, but
    // not for the server to hold all 1,100 (what starves it without a cap).
    let saved = nofile();
    let want = fd_ceiling() + IDLE as u64 + CAP as u64 + 200;
    if want > saved.rlim_max {
        eprintln!("SKIP: RLIMIT_NOFILE hard limit {} < {want}", saved.rlim_max);
        return;
    }
    assert!(set_nofile(&libc::rlimit {
        rlim_cur: want,
        rlim_max: saved.rlim_max,
    }));

    let opening = Instant::now();
    let mut idle: Vec<TcpStream> = (0..IDLE)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    eprintln!("opened {IDLE} idle connections in {:?}", opening.elapsed());
    // Give the server a moment to accept (and shed) them.
    std::thread::sleep(Duration::from_millis(300));

    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(3)))
        .http_status_as_error(false)
        .build()
        .into();
    let started = Instant::now();
    let health = agent.get(&format!("http://{addr}/health")).call();
    let took = started.elapsed();
    assert_eq!(
        health.as_ref().map(|r| r.status().as_u16()).ok(),
        Some(200),
        "{health:?} after {took:?}"
    );
    assert!(took < Duration::from_secs(2), "health took {took:?}");
    let stats = bs.stats();
    // Each idle connection beyond the cap was closed: evicted for a
    // newcomer, or timed out if the opening took longer than the timeout.
    assert!(
        stats.connections_evicted + stats.header_timeouts >= (IDLE - CAP) as u64,
        "{stats:?}"
    );

    // Every idle connection is closed by now or within the header timeout.
    std::thread::sleep(HEADER_TIMEOUT + Duration::from_secs(1));
    for s in &mut idle {
        s.set_nonblocking(true).unwrap();
    }
    let open = idle.iter_mut().map(closed_by_server).filter(|c| !c).count();
    assert_eq!(
        open,
        0,
        "{open} idle connections still open; {:?}",
        bs.stats()
    );
    assert!(bs.stats().header_timeouts >= 1, "{:?}", bs.stats());
    drop(idle);
    assert!(set_nofile(&saved));
}
