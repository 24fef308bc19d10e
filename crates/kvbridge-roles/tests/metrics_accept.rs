//! The metrics endpoint survives accept errors: with the process out of
//! file descriptors its accept fails (EMFILE); once descriptors are free
//! again it serves the waiting connection. Alone in its binary: it changes
//! the process's fd limit.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_roles::metrics::{Metrics, MetricsServer};

fn nofile() -> libc::rlimit {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim
}

fn set_nofile(lim: &libc::rlimit) {
    // SAFETY: `lim` is a valid rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, lim) }, 0);
}

#[test]
fn the_metrics_endpoint_survives_running_out_of_file_descriptors() {
    let server =
        MetricsServer::start("127.0.0.1:0".parse().unwrap(), Arc::new(Metrics::new())).unwrap();
    let addr = server.local_addr();
    let saved = nofile();
    // The lowest free descriptor: our client socket takes it, and the
    // server's accept then finds none below the limit.
    let lowest = std::fs::File::open("/dev/null").unwrap().as_raw_fd() as u64;
    set_nofile(&libc::rlimit {
        rlim_cur: lowest + 1,
        rlim_max: saved.rlim_max,
    });
    let client = TcpStream::connect(addr);
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.accept_errors() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    set_nofile(&saved);
    let mut client = client.unwrap();
    assert!(server.accept_errors() >= 1, "no accept error was provoked");

    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    client
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    client.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("kvbridge_chunks_total"), "{answer}");
}
