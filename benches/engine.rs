//! In-process cost of moving a batch through the transfer engines: 16 MiB as
//! 4 KiB or 1 MiB blocks, loopback (memcpy) vs TCP over 127.0.0.1 vs the UCX
//! engine over UCX's TCP and shared-memory transports (when libucx is
//! installed). The two-process end-to-end numbers come from `kvbridge bench
//! tcp` and `kvbridge bench ucx`.
#![allow(clippy::unwrap_used)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvbridge::engine::{Block, EngineConfig, LoopbackEngine, TcpEngine, TransferEngine};
use kvbridge::mem::HostBuffer;

const TOTAL: u64 = 16 << 20;

fn blocks(src: &HostBuffer, dst: &HostBuffer, size: u64) -> Vec<Block> {
    (0..TOTAL / size)
        .map(|i| Block {
            src: src.addr() + i * size,
            dst: dst.addr() + i * size,
            len: size,
        })
        .collect()
}

fn bench_pair(c: &mut Criterion, name: &str, a: &dyn TransferEngine, b: &dyn TransferEngine) {
    let src = HostBuffer::new(TOTAL as usize).unwrap();
    let dst = HostBuffer::new(TOTAL as usize).unwrap();
    // SAFETY: the buffers outlive the registrations (deregistered below) and
    // are not read while transfers run.
    unsafe {
        a.batch_register(&[src.region()]).unwrap();
        b.batch_register(&[dst.region()]).unwrap();
    }
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Bytes(TOTAL));
    g.sample_size(10);
    for size in [4096u64, 1 << 20] {
        let bl = blocks(&src, &dst, size);
        g.bench_with_input(BenchmarkId::from_parameter(size), &bl, |bench, bl| {
            bench.iter(|| a.batch_transfer_sync(b.session_id(), bl).unwrap());
        });
    }
    g.finish();
    a.batch_deregister(&[src.addr()]).unwrap();
    b.batch_deregister(&[dst.addr()]).unwrap();
}

fn engines(c: &mut Criterion) {
    let (a, b) = (LoopbackEngine::new(), LoopbackEngine::new());
    bench_pair(c, "loopback_16MiB", &a, &b);
    let cfg = EngineConfig {
        listen_host: "127.0.0.1".into(),
        ..EngineConfig::default()
    };
    let (a, b) = (
        TcpEngine::new(cfg.clone()).unwrap(),
        TcpEngine::new(cfg.clone()).unwrap(),
    );
    bench_pair(c, "tcp_16MiB", &a, &b);
    ucx_pairs(c, &cfg);
}

/// The UCX engine over TCP and over shared memory, if UCX is installed.
fn ucx_pairs(c: &mut Criterion, cfg: &EngineConfig) {
    use kvbridge::engine::UcxEngine;
    if let Err(e) = kvbridge::engine::ucx::available() {
        eprintln!("skipping the UCX benches: {e}");
        return;
    }
    for (name, tls) in [
        ("ucx_tcp_16MiB", "tcp"),
        ("ucx_shm_16MiB", "posix,cma,self"),
    ] {
        let new = || UcxEngine::with_ucx_config(cfg.clone(), &[("TLS", tls)]).unwrap();
        let (a, b) = (new(), new());
        bench_pair(c, name, &a, &b);
    }
}

criterion_group!(benches, engines);
criterion_main!(benches);
