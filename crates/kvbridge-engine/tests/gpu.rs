//! GPU-gated engine tests (feature `cuda`): the batched copy kernel on
//! random descriptor sets, the TCP engine with device memory on both sides,
//! and the CUDA IPC engine between two processes on one GPU (and between
//! two engines of one process). Run by
//! `cargo xtask gpu-test --run`; without a GPU each test prints one skip
//! line and returns.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use kvbridge_engine::ipc::{Copies, CopyBench, CopyMode, CopyTuning};
use kvbridge_engine::{Batch, Block, ErrorKind, IpcEngine, Run, Side, Target, TransferEngine};
use kvbridge_mem::cuda::{self, DeviceBuffer};
use kvbridge_mem::{HostBuffer, MemError};
use rand::{Rng, RngCore, SeedableRng, rngs::StdRng};

fn gpu(test: &str) -> bool {
    match cuda::unavailable_reason() {
        None => true,
        Some(why) => {
            let _ = writeln!(std::io::stderr(), "SKIP {test}: no GPU ({why})");
            false
        }
    }
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// Random blocks: lengths from 1 B to `max` (log-uniform), any alignment,
/// sources free to overlap each other, destinations disjoint but packed
/// into shared pages and words. Returns the blocks as offsets.
fn random_set(rng: &mut StdRng, space: u64, max: u64, count: usize) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut dst = rng.gen_range(0..64);
    for _ in 0..count {
        let bits = rng.gen_range(0..=max.ilog2());
        let len = rng.gen_range(1..=(1u64 << bits).min(max));
        if dst + len > space {
            break;
        }
        let src = rng.gen_range(0..space - len);
        blocks.push(Block { src, dst, len });
        // next destination: right after (shared word), or a small gap
        dst += len
            + if rng.gen_bool(0.5) {
                0
            } else {
                rng.gen_range(1..40)
            };
    }
    blocks
}

#[test]
fn copy_kernel_matches_host_copies_on_random_descriptor_sets() {
    if !gpu("copy_kernel_matches_host_copies_on_random_descriptor_sets") {
        return;
    }
    let space: u64 = 96 << 20;
    let src_bytes = random_bytes(space as usize, 7);
    let src = DeviceBuffer::new(0, space as usize).unwrap();
    let dst = DeviceBuffer::new(0, space as usize).unwrap();
    src.write(0, &src_bytes).unwrap();
    let mut copier = CopyBench::new(0, CopyTuning::default()).unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    let mut checked = 0u64;
    let cases = [
        (CopyMode::Kernel, 64u64, 20_000usize),
        (CopyMode::Kernel, 4096, 5_000),
        (CopyMode::Kernel, 16 << 20, 12),
        (CopyMode::Auto, 16 << 20, 24),
        (CopyMode::Auto, 300, 50_000),
        (CopyMode::PerBlock, 8192, 500),
        (CopyMode::Kernel, 1, 3_000),
        // a large batch: packing on several threads, one upload, one launch
        (CopyMode::Auto, 48, 700_000),
    ];
    for (round, (mode, max, count)) in cases.into_iter().enumerate() {
        dst.fill(0xa5).unwrap();
        let set = random_set(&mut rng, space, max, count);
        let mut want = vec![0xa5u8; space as usize];
        for b in &set {
            let (s, d, n) = (b.src as usize, b.dst as usize, b.len as usize);
            want[d..d + n].copy_from_slice(&src_bytes[s..s + n]);
        }
        let abs: Vec<Block> = set
            .iter()
            .map(|b| Block {
                src: src.addr() + b.src,
                dst: dst.addr() + b.dst,
                len: b.len,
            })
            .collect();
        copier.set_tuning(CopyTuning {
            mode,
            ..CopyTuning::default()
        });
        let stats = copier
            .copy(&Copies::new(&src, &dst, &abs).unwrap())
            .unwrap();
        let mut got = vec![0u8; space as usize];
        dst.read(0, &mut got).unwrap();
        let first_bad = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            first_bad.is_none(),
            "round {round} ({mode:?}, up to {max} B, {} blocks): first wrong byte at {first_bad:?}",
            set.len()
        );
        checked += set.iter().map(|b| b.len).sum::<u64>();
        let _ = writeln!(
            std::io::stderr(),
            "copy kernel round {round}: {mode:?}, {} blocks of 1..={max} B, kernel {} / memcpy {} / launches {}: ok",
            set.len(),
            stats.kernel_blocks,
            stats.memcpy_blocks,
            stats.launches
        );
    }
    assert!(checked > 0);
}

#[test]
fn tcp_engine_moves_device_memory_on_both_sides() {
    if !gpu("tcp_engine_moves_device_memory_on_both_sides") {
        return;
    }
    let a = common::tcp(common::cfg());
    let b = common::tcp(common::cfg());
    let len = 24 << 20;
    let src = DeviceBuffer::new(0, len).unwrap();
    let dst = DeviceBuffer::new(0, len).unwrap();
    let host_dst = HostBuffer::new(len).unwrap();
    let data = random_bytes(len, 3);
    src.write(0, &data).unwrap();
    // SAFETY: the buffers outlive the engines' use; deregistered below.
    unsafe {
        a.batch_register(&[src.region()]).unwrap();
        b.batch_register(&[dst.region(), host_dst.region()])
            .unwrap();
    }
    let mut blocks = vec![Block {
        src: src.addr(),
        dst: dst.addr(),
        len: 16 << 20,
    }];
    for i in 0..2048u64 {
        blocks.push(Block {
            src: src.addr() + (16 << 20) + i * 1000,
            dst: dst.addr() + (16 << 20) + i * 1000,
            len: 1000,
        });
    }
    blocks.push(Block {
        src: src.addr() + 5,
        dst: host_dst.addr() + 7,
        len: 3 << 20,
    });
    a.batch_transfer_sync(b.session_id(), &blocks).unwrap();
    let mut got = vec![0u8; len];
    dst.read(0, &mut got).unwrap();
    let n = (16 << 20) + 2048 * 1000;
    assert!(got[..n] == data[..n], "device-to-device over TCP differs");
    assert!(host_dst.as_slice()[7..7 + (3 << 20)] == data[5..5 + (3 << 20)]);
    a.batch_deregister(&[src.addr()]).unwrap();
    b.batch_deregister(&[dst.addr(), host_dst.addr()]).unwrap();
}

#[test]
fn ipc_engine_between_two_engines_of_one_process() {
    if !gpu("ipc_engine_between_two_engines_of_one_process") {
        return;
    }
    // CUDA refuses to open a handle in the process that exported it: the
    // target's allocation is reached at its own address instead.
    let a = IpcEngine::new(common::cfg(), CopyTuning::default()).unwrap();
    let b = IpcEngine::new(common::cfg(), CopyTuning::default()).unwrap();
    let len = 8 << 20;
    let src = DeviceBuffer::new(0, len).unwrap();
    let dst = DeviceBuffer::new(0, len).unwrap();
    let data = random_bytes(len, 11);
    src.write(0, &data).unwrap();
    dst.fill(0).unwrap();
    // SAFETY: the buffers outlive the engines' use; deregistered below.
    unsafe {
        a.batch_register(&[src.region()]).unwrap();
        b.batch_register(&[dst.region()]).unwrap();
    }
    let mut blocks = vec![Block {
        src: src.addr(),
        dst: dst.addr() + 4096,
        len: 4 << 20,
    }];
    for i in 0..512u64 {
        blocks.push(Block {
            src: src.addr() + (4 << 20) + i * 3000,
            dst: dst.addr() + (5 << 20) + i * 3000,
            len: 2999,
        });
    }
    a.batch_transfer_sync(b.session_id(), &blocks).unwrap();
    let mut got = vec![0u8; len];
    dst.read(0, &mut got).unwrap();
    assert!(
        got[..4096].iter().all(|b| *b == 0),
        "wrote before the block"
    );
    assert!(got[4096..4096 + (4 << 20)] == data[..4 << 20]);
    for i in 0..512usize {
        let (s, d) = ((4 << 20) + i * 3000, (5 << 20) + i * 3000);
        assert!(got[d..d + 2999] == data[s..s + 2999], "small block {i}");
        assert_eq!(got[d + 2999], 0, "small block {i} overran");
    }
    // Outside the target's registered region: refused, nothing written.
    let bad = [Block {
        src: src.addr(),
        dst: dst.addr() + len as u64 - 16,
        len: 32,
    }];
    let err = a.batch_transfer_sync(b.session_id(), &bad).unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfRegion(Side::Remote), "{err}");
    // The target deregisters (revoking the hold) and registers again.
    b.batch_deregister(&[dst.addr()]).unwrap();
    // SAFETY: as above.
    unsafe { b.batch_register(&[dst.region()]) }.unwrap();
    a.batch_transfer_sync(b.session_id(), &blocks[..1]).unwrap();
    a.batch_deregister(&[src.addr()]).unwrap();
    b.batch_deregister(&[dst.addr()]).unwrap();
}

/// Bursts of up to 32 batches in flight: every byte lands, and the
/// session never allocates more descriptor slots than batches were ever in
/// flight at once (finished slots are kept for the next burst, not freed,
/// which would wait for the whole GPU, and allocated again).
#[test]
fn ipc_engine_reuses_slots_across_deep_bursts() {
    if !gpu("ipc_engine_reuses_slots_across_deep_bursts") {
        return;
    }
    let a = IpcEngine::new(common::cfg(), CopyTuning::default()).unwrap();
    let b = IpcEngine::new(common::cfg(), CopyTuning::default()).unwrap();
    const DEPTH: usize = 32;
    const PIECE: usize = 1 << 20;
    let len = DEPTH * 8 * PIECE;
    let src = DeviceBuffer::new(0, len).unwrap();
    let dst = DeviceBuffer::new(0, len).unwrap();
    // SAFETY: the buffers outlive the engines' use; deregistered below.
    unsafe {
        a.batch_register(&[src.region()]).unwrap();
        b.batch_register(&[dst.region()]).unwrap();
    }
    // Batch i: 8 blocks of 1 MiB, interleaved with the other batches' blocks.
    let batches: Vec<Vec<Block>> = (0..DEPTH)
        .map(|i| {
            (0..8)
                .map(|j| {
                    let off = ((j * DEPTH + i) * PIECE) as u64;
                    Block {
                        src: src.addr() + off,
                        dst: dst.addr() + off,
                        len: PIECE as u64,
                    }
                })
                .collect()
        })
        .collect();
    let mut made = Vec::new();
    for round in 0..4u64 {
        let data = random_bytes(len, 100 + round);
        src.write(0, &data).unwrap();
        dst.fill(0).unwrap();
        let handles: Vec<_> = batches
            .iter()
            .map(|blocks| a.submit(Target::any(b.session_id()), Batch::Blocks(blocks)))
            .collect();
        for h in handles {
            h.wait().unwrap();
        }
        let mut got = vec![0u8; len];
        dst.read(0, &mut got).unwrap();
        assert!(got == data, "round {round}: bytes differ");
        made.push(a.slots_made());
    }
    assert!(made[0] >= 1, "no slot made: {made:?}");
    assert!(
        made[3] <= DEPTH as u64,
        "more slots allocated than batches were ever in flight: {made:?}"
    );
    a.batch_deregister(&[src.addr()]).unwrap();
    b.batch_deregister(&[dst.addr()]).unwrap();
}

/// The other process of the IPC tests: the target (spawned from this test binary).
struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    session: String,
    addr: u64,
    incarnation: u64,
}

const TARGET_ENV: &str = "KVB_IPC_TEST_TARGET";
const TARGET_LEN: usize = 8 << 20;

impl Peer {
    #[allow(clippy::zombie_processes)] // `kill` waits for it
    fn spawn(port: u16) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "ipc_target_process", "--ignored", "--nocapture"])
            .env(TARGET_ENV, port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        loop {
            let mut line = String::new();
            assert!(
                stdout.read_line(&mut line).unwrap() > 0,
                "target exited early"
            );
            if let Some(rest) = line.strip_prefix("READY ") {
                let f: Vec<&str> = rest.split_whitespace().collect();
                return Self {
                    child,
                    stdin,
                    stdout,
                    session: f[0].to_owned(),
                    addr: f[1].parse().unwrap(),
                    incarnation: f[2].parse().unwrap(),
                };
            }
        }
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            assert!(
                self.stdout.read_line(&mut line).unwrap() > 0,
                "target exited"
            );
            if let Some(r) = line.strip_prefix("ANSWER ") {
                return r.trim().to_owned();
            }
        }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Not a test of its own: the target process of the IPC tests.
#[test]
#[ignore = "spawned by the IPC tests as their peer process"]
fn ipc_target_process() {
    let Ok(port) = std::env::var(TARGET_ENV) else {
        return;
    };
    let cfg = kvbridge_engine::EngineConfig {
        port: port.parse().unwrap(),
        ..common::cfg()
    };
    let engine = IpcEngine::new(cfg, CopyTuning::default()).unwrap();
    let buf = DeviceBuffer::new(0, TARGET_LEN).unwrap();
    let mut registered = true;
    // SAFETY: `buf` lives until the process ends; deregistered on request.
    unsafe { engine.batch_register(&[buf.region()]) }.unwrap();
    println!(
        "READY {} {} {}",
        engine.session_id(),
        buf.addr(),
        engine.incarnation()
    );
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let f: Vec<&str> = line.split_whitespace().collect();
        let answer = match f.as_slice() {
            ["SUM", off, len] => {
                let (off, len): (usize, usize) = (off.parse().unwrap(), len.parse().unwrap());
                let mut v = vec![0u8; len];
                buf.read(off, &mut v).unwrap();
                let h = v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                    (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
                });
                h.to_string()
            }
            ["FILL", byte] => {
                buf.fill(byte.parse().unwrap()).unwrap();
                "ok".into()
            }
            ["DEREG"] => {
                engine.batch_deregister(&[buf.addr()]).unwrap();
                registered = false;
                "ok".into()
            }
            _ => break,
        };
        println!("ANSWER {answer}");
    }
    if registered {
        let _ = engine.batch_deregister(&[buf.addr()]);
    }
}

fn fnv(v: &[u8]) -> String {
    v.iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
        })
        .to_string()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn ipc_engine_between_two_processes_on_one_gpu() {
    if !gpu("ipc_engine_between_two_processes_on_one_gpu") {
        return;
    }
    let port = free_port();
    let mut peer = Peer::spawn(port);
    let engine = IpcEngine::new(common::cfg(), CopyTuning::default()).unwrap();
    let len = 8 << 20;
    let src = DeviceBuffer::new(0, len).unwrap();
    let data = random_bytes(len, 5);
    src.write(0, &data).unwrap();
    // SAFETY: `src` outlives the engine's use; deregistered below.
    unsafe { engine.batch_register(&[src.region()]) }.unwrap();
    // Host memory is refused: the intra-node transport moves device memory only.
    let host = HostBuffer::new(4096).unwrap();
    // SAFETY: refused, never used.
    let refused = unsafe { engine.batch_register(&[host.region()]) };
    assert!(matches!(refused, Err(MemError::Unsupported { .. })));
    assert!(!engine.moves_host_memory());

    // Many small head-slice-like blocks and one large one, scattered.
    let mut rng = StdRng::seed_from_u64(9);
    let mut blocks = Vec::new();
    for i in 0..4096u64 {
        blocks.push(Block {
            src: src.addr() + rng.gen_range(0..(4 << 20)),
            dst: peer.addr + i * 512 + 3,
            len: 509,
        });
    }
    blocks.push(Block {
        src: src.addr() + (4 << 20),
        dst: peer.addr + (4 << 20),
        len: 4 << 20,
    });
    peer.ask("FILL 0");
    engine.batch_transfer_sync(&peer.session, &blocks).unwrap();
    let mut want = vec![0u8; TARGET_LEN];
    for b in &blocks {
        let (s, d) = ((b.src - src.addr()) as usize, (b.dst - peer.addr) as usize);
        want[d..d + b.len as usize].copy_from_slice(&data[s..s + b.len as usize]);
    }
    assert_eq!(peer.ask(&format!("SUM 0 {TARGET_LEN}")), fnv(&want));
    assert_eq!(
        engine.mapping_counts(),
        (1, 0),
        "one allocation opened, lazily, once"
    );

    // A large batch (several slices, prepared on several threads): one
    // destination outside the peer's regions, in the last slice, refuses
    // the whole batch before anything is written.
    let n = 300_000u64;
    let big: Vec<Block> = (0..n)
        .map(|i| Block {
            src: src.addr() + rng.gen_range(0..(len as u64 - 16)),
            dst: peer.addr + i * 16 + 8,
            len: 16,
        })
        .collect();
    peer.ask("FILL 0");
    let mut bad_big = big.clone();
    bad_big[n as usize - 1].dst = peer.addr + TARGET_LEN as u64 - 8;
    let e = engine
        .batch_transfer_sync(&peer.session, &bad_big)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Remote));
    assert_eq!(e.block, Some(n as usize - 1));
    assert_eq!(
        peer.ask(&format!("SUM 0 {TARGET_LEN}")),
        fnv(&vec![0u8; TARGET_LEN])
    );
    // The same blocks in six batches, all in flight at once.
    let handles: Vec<_> = big
        .chunks(50_000)
        .map(|c| {
            engine.submit(
                Target::exact(&peer.session, peer.incarnation),
                Batch::Blocks(c),
            )
        })
        .collect();
    for h in handles {
        h.wait().unwrap();
    }
    let mut want = vec![0u8; TARGET_LEN];
    for b in &big {
        let (s, d) = ((b.src - src.addr()) as usize, (b.dst - peer.addr) as usize);
        want[d..d + 16].copy_from_slice(&data[s..s + 16]);
    }
    assert_eq!(peer.ask(&format!("SUM 0 {TARGET_LEN}")), fnv(&want));
    assert_eq!(engine.mapping_counts(), (1, 0));

    // submit (async) with the right incarnation works too.
    let h = engine.submit(
        Target::exact(&peer.session, peer.incarnation),
        Batch::Blocks(&blocks[..10]),
    );
    h.wait().unwrap();

    // A destination outside the peer's regions: refused, nothing written.
    peer.ask("FILL 7");
    let bad = [
        Block {
            src: src.addr(),
            dst: peer.addr,
            len: 64,
        },
        Block {
            src: src.addr(),
            dst: peer.addr + TARGET_LEN as u64 - 8,
            len: 64,
        },
    ];
    let e = engine.batch_transfer_sync(&peer.session, &bad).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Remote));
    assert_eq!(e.block, Some(1));
    assert_eq!(peer.ask("SUM 0 64"), fnv(&[7u8; 64]));
    // A source outside ours.
    let e = engine
        .batch_transfer_sync(
            &peer.session,
            &[Block {
                src: src.addr() + len as u64 - 4,
                dst: peer.addr,
                len: 8,
            }],
        )
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Local));

    // The peer deregisters: its region is gone, our mapping is closed.
    peer.ask("DEREG");
    let e = engine
        .batch_transfer_sync(&peer.session, &blocks[..1])
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Remote));
    assert_eq!(
        engine.mapping_counts(),
        (1, 1),
        "mapping closed after deregistration"
    );
    let old = peer.incarnation;
    peer.kill();

    // A new incarnation on the same port: batches planned for the old one
    // are refused; fresh ones reopen the new memory.
    let mut peer2 = Peer::spawn(port);
    assert_ne!(peer2.incarnation, old);
    let e = engine
        .submit(
            Target::exact(&peer2.session, old),
            Batch::Blocks(&blocks[..1]),
        )
        .wait()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::PeerRestarted);
    peer2.ask("FILL 0");
    let moved = [Block {
        src: src.addr(),
        dst: peer2.addr,
        len: 4096,
    }];
    engine.batch_transfer_sync(&peer2.session, &moved).unwrap();
    assert_eq!(peer2.ask("SUM 0 4096"), fnv(&data[..4096]));
    assert_eq!(
        engine.mapping_counts().0,
        2,
        "the new incarnation's memory was opened"
    );
    engine.batch_deregister(&[src.addr()]).unwrap();
    drop(engine);
    peer2.kill();
    let _ = writeln!(
        std::io::stderr(),
        "ipc: transfer, refusals, deregistration, restart: ok"
    );
}

/// Random strided runs inside a `space`-byte window: copies of 1 B to
/// `max` bytes, 1 to `most` copies, source strides free (copies may overlap),
/// destination strides at least the copy length, runs packed one after
/// another on the destination side. Offsets, not addresses.
fn random_runs(rng: &mut StdRng, space: u64, max: u64, count: usize, most: u64) -> Vec<Run> {
    let mut runs = Vec::new();
    let mut dst = rng.gen_range(0..64);
    for _ in 0..count {
        let len = rng.gen_range(1..=max);
        let copies = rng.gen_range(1..=most);
        let dst_stride = len + rng.gen_range(0..=len);
        let src_stride = rng.gen_range(0..=2 * len);
        let d_span = (copies - 1) * dst_stride + len;
        let s_span = (copies - 1) * src_stride + len;
        if dst + d_span > space || s_span >= space {
            break;
        }
        let src = rng.gen_range(0..space - s_span);
        runs.push(Run {
            src,
            dst,
            len,
            count: copies,
            src_stride,
            dst_stride,
        });
        dst += d_span + rng.gen_range(0..8);
    }
    runs
}

#[test]
fn ipc_engine_copies_strided_runs() {
    if !gpu("ipc_engine_copies_strided_runs") {
        return;
    }
    let mut peer = Peer::spawn(free_port());
    // Two kernel streams: the batches of a round run concurrently.
    let tuning = CopyTuning {
        kernel_streams: 2,
        ..CopyTuning::default()
    };
    let engine = IpcEngine::new(common::cfg(), tuning).unwrap();
    assert!(engine.copies_runs());
    let len = TARGET_LEN;
    let src = DeviceBuffer::new(0, len).unwrap();
    let data = random_bytes(len, 21);
    src.write(0, &data).unwrap();
    // SAFETY: `src` outlives the engine's use; deregistered below.
    unsafe { engine.batch_register(&[src.region()]) }.unwrap();
    let mut rng = StdRng::seed_from_u64(17);
    // Head-slice-like (256 B at token strides), odd sizes and alignments,
    // and copies longer than a kernel piece (expanded into pieces).
    let rounds = [
        (256u64, 400usize, 150u64),
        (1000, 300, 40),
        (3, 200, 300),
        (200 << 10, 6, 3),
    ];
    for (round, (max, count, most)) in rounds.into_iter().enumerate() {
        let runs = random_runs(&mut rng, len as u64, max, count, most);
        peer.ask("FILL 0");
        let abs: Vec<Run> = runs
            .iter()
            .map(|r| Run {
                src: src.addr() + r.src,
                dst: peer.addr + r.dst,
                ..*r
            })
            .collect();
        let handles: Vec<_> = abs
            .chunks(abs.len().div_ceil(3).max(1))
            .map(|c| {
                engine.submit(
                    Target::exact(&peer.session, peer.incarnation),
                    Batch::Runs(c),
                )
            })
            .collect();
        for h in handles {
            h.wait().unwrap();
        }
        let mut want = vec![0u8; len];
        for r in &runs {
            for k in 0..r.count {
                let b = r.block(k);
                let (s, d, n) = (b.src as usize, b.dst as usize, b.len as usize);
                want[d..d + n].copy_from_slice(&data[s..s + n]);
            }
        }
        assert_eq!(
            peer.ask(&format!("SUM 0 {len}")),
            fnv(&want),
            "round {round}: {} runs of up to {max} B",
            runs.len()
        );
        let _ = writeln!(
            std::io::stderr(),
            "ipc runs round {round}: {} runs, {} copies of 1..={max} B: ok",
            runs.len(),
            runs.iter().map(|r| r.count).sum::<u64>()
        );
    }
    // The last copy of a run past the peer's region: the batch is refused
    // and nothing is written.
    peer.ask("FILL 9");
    let over = [
        Run {
            src: src.addr(),
            dst: peer.addr,
            len: 256,
            count: 4,
            src_stride: 256,
            dst_stride: 512,
        },
        Run {
            src: src.addr(),
            dst: peer.addr + len as u64 - 4096,
            len: 256,
            count: 9,
            src_stride: 0,
            dst_stride: 512,
        },
    ];
    let e = engine
        .submit(Target::exact(&peer.session, 0), Batch::Runs(&over))
        .wait()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Remote));
    assert_eq!(e.block, Some(1));
    assert_eq!(peer.ask("SUM 0 4096"), fnv(&[9u8; 4096]));
    // Copies that would overlap at the destination: refused as malformed.
    let overlap = [Run {
        dst_stride: 128,
        ..over[0]
    }];
    let e = engine
        .submit(Target::exact(&peer.session, 0), Batch::Runs(&overlap))
        .wait()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    engine.batch_deregister(&[src.addr()]).unwrap();
    drop(engine);
    peer.kill();
    let _ = writeln!(std::io::stderr(), "ipc runs: rounds, refusals: ok");
}
