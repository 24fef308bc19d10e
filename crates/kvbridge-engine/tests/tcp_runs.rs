//! TCP engine, strided runs carried natively (`WriteRuns` / `CheckRuns`):
//! byte-exact delivery of heterogeneous-TP-shaped runs, splitting, region
//! enforcement on the whole destination span, and the expanded fallback.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use kvbridge_engine::{
    Batch, Block, EngineConfig, ErrorKind, Run, Side, Target, TcpConfig, TransferEngine,
};
use kvbridge_mem::HostBuffer;

/// Head slices of `tokens` tokens for every one of `buffers` buffers: the
/// prefill holds `heads` heads per token, the decode `heads / 2`, so each
/// copy is half a prefill token row (what TP 2 -> 4 plans).
fn head_slices(
    src: &HostBuffer,
    dst: &HostBuffer,
    buffers: u64,
    tokens: u64,
    head: u64,
    heads: u64,
) -> Vec<Run> {
    let (src_row, dst_row) = (head * heads, head * heads / 2);
    (0..buffers)
        .map(|b| Run {
            src: src.addr() + b * tokens * src_row + dst_row, // the second half of each row
            dst: dst.addr() + b * tokens * dst_row,
            len: dst_row,
            count: tokens,
            src_stride: src_row,
            dst_stride: dst_row,
        })
        .collect()
}

fn expanded(runs: &[Run]) -> Vec<Block> {
    runs.iter().flat_map(Run::blocks).collect()
}

fn runs_arrive(c: EngineConfig) {
    let (a, b) = (tcp(c.clone()), tcp(c));
    let (buffers, tokens, head, heads) = (64, 700, 256, 4);
    let src = patterned((buffers * tokens * head * heads) as usize, 21);
    let dst = HostBuffer::new((buffers * tokens * head * heads / 2) as usize).unwrap();
    register(&a, &src);
    register(&b, &dst);
    let runs = head_slices(&src, &dst, buffers, tokens, head, heads);
    a.submit(Target::any(b.session_id()), Batch::Runs(&runs))
        .wait()
        .unwrap();
    assert_arrived(&expanded(&runs), &src, &dst);
    assert_eq!(b.stats().bytes_received, a.stats().bytes_sent);
    assert_eq!(a.stats().bytes_sent, buffers * tokens * head * heads / 2);
}

#[test]
fn runs_arrive_byte_exact() {
    runs_arrive(cfg());
}

#[test]
fn runs_arrive_byte_exact_split_staged_one_lane() {
    // Small requests (runs split across requests, batch check first),
    // every byte through frame and bounce buffers, one connection.
    runs_arrive(EngineConfig {
        tcp: TcpConfig {
            request_bytes: 100_000,
            connections_per_peer: 1,
            force_staging: true,
            ..TcpConfig::default()
        },
        ..cfg()
    });
}

#[test]
fn runs_arrive_byte_exact_expanded() {
    let c = EngineConfig {
        tcp: TcpConfig {
            native_runs: false,
            ..TcpConfig::default()
        },
        ..cfg()
    };
    assert!(!tcp(c.clone()).copies_runs());
    runs_arrive(c);
}

#[test]
fn long_copies_and_single_copy_runs_arrive() {
    // Copies longer than a request go as blocks; one-copy runs as plain writes.
    let c = EngineConfig {
        tcp: TcpConfig {
            request_bytes: 64 << 10,
            ..TcpConfig::default()
        },
        ..cfg()
    };
    let (a, b) = (tcp(c.clone()), tcp(c));
    let src = patterned(4 << 20, 22);
    let dst = HostBuffer::new(4 << 20).unwrap();
    register(&a, &src);
    register(&b, &dst);
    let runs = [
        Run {
            src: src.addr(),
            dst: dst.addr(),
            len: 300_000,
            count: 3,
            src_stride: 400_000,
            dst_stride: 300_000,
        },
        Run {
            src: src.addr() + 2_000_000,
            dst: dst.addr() + 1_000_000,
            len: 77,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
        },
    ];
    a.submit(Target::any(b.session_id()), Batch::Runs(&runs))
        .wait()
        .unwrap();
    assert_arrived(&expanded(&runs), &src, &dst);
    let single = [runs[1]];
    let dst2 = dst.addr() + 2_000_000;
    let moved = [Run {
        dst: dst2,
        ..single[0]
    }];
    a.submit(Target::any(b.session_id()), Batch::Runs(&moved))
        .wait()
        .unwrap();
    assert_arrived(&expanded(&moved), &src, &dst);
}

#[test]
fn a_run_leaving_the_peers_region_writes_nothing() {
    for request_bytes in [8 << 20, 4096] {
        // One request (WriteRuns refused whole) and many (CheckRuns refuses first).
        let c = EngineConfig {
            tcp: TcpConfig {
                request_bytes,
                ..TcpConfig::default()
            },
            ..cfg()
        };
        let (a, b) = (tcp(c.clone()), tcp(c));
        let src = patterned(1 << 20, 23);
        let dst = HostBuffer::new(64 << 10).unwrap();
        register(&a, &src);
        register(&b, &dst);
        let runs = [
            Run {
                src: src.addr(),
                dst: dst.addr(),
                len: 512,
                count: 16,
                src_stride: 1024,
                dst_stride: 512,
            },
            // Its last copy ends past the region.
            Run {
                src: src.addr(),
                dst: dst.addr() + 8192,
                len: 512,
                count: 200,
                src_stride: 1024,
                dst_stride: 512,
            },
        ];
        let err = a
            .submit(Target::any(b.session_id()), Batch::Runs(&runs))
            .wait()
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::OutOfRegion(Side::Remote), "{err}");
        assert_eq!(err.block, Some(1), "{err}");
        assert!(dst.as_slice().iter().all(|&x| x == 0), "nothing written");
        assert_eq!(b.stats().bytes_received, 0);
    }
}

#[test]
fn malformed_and_unregistered_runs_fail_locally() {
    let c = cfg();
    let (a, b) = (tcp(c.clone()), tcp(c));
    let src = patterned(1 << 20, 24);
    let dst = HostBuffer::new(1 << 20).unwrap();
    register(&a, &src);
    register(&b, &dst);
    // Copies overlapping at the destination.
    let overlap = [Run {
        src: src.addr(),
        dst: dst.addr(),
        len: 512,
        count: 4,
        src_stride: 512,
        dst_stride: 256,
    }];
    let err = a
        .submit(Target::any(b.session_id()), Batch::Runs(&overlap))
        .wait()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
    // A source span leaving our registered region.
    let outside = [Run {
        src: src.addr(),
        dst: dst.addr(),
        len: 512,
        count: 4,
        src_stride: 400_000,
        dst_stride: 512,
    }];
    let err = a
        .submit(Target::any(b.session_id()), Batch::Runs(&outside))
        .wait()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfRegion(Side::Local), "{err}");
    assert!(dst.as_slice().iter().all(|&x| x == 0));
}

#[test]
fn gathered_sources_and_back_to_back_copies_arrive() {
    // TP 2 -> 1 shape: back-to-back source rows into every other half row
    // of the destination; and runs back to back on both sides.
    let (a, b) = (tcp(cfg()), tcp(cfg()));
    let (tokens, row) = (5000u64, 512u64);
    let src = patterned((tokens * row * 2) as usize, 25);
    let dst = HostBuffer::new((tokens * row * 2) as usize).unwrap();
    register(&a, &src);
    register(&b, &dst);
    let runs = [
        Run {
            src: src.addr(),
            dst: dst.addr() + row,
            len: row,
            count: tokens,
            src_stride: row,
            dst_stride: 2 * row,
        },
        Run {
            src: src.addr() + tokens * row,
            dst: dst.addr(),
            len: 100,
            count: 5,
            src_stride: 100,
            dst_stride: 100,
        },
    ];
    a.submit(Target::any(b.session_id()), Batch::Runs(&runs))
        .wait()
        .unwrap();
    assert_arrived(&expanded(&runs[..1]), &src, &dst);
    assert_arrived(&expanded(&runs[1..]), &src, &dst);
}
