//! Helpers shared by the engine integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use kvbridge_engine::{EngineConfig, TcpEngine, TransferEngine};
use kvbridge_mem::HostBuffer;
use rand::{Rng, RngCore, SeedableRng, rngs::StdRng};

/// A loopback-only engine config with test-sized timeouts.
pub fn cfg() -> EngineConfig {
    EngineConfig {
        listen_host: "127.0.0.1".into(),
        connect_timeout_ms: 2_000,
        io_timeout_ms: 5_000,
        ..EngineConfig::default()
    }
}

/// A TCP engine on 127.0.0.1 and a free port.
pub fn tcp(c: EngineConfig) -> TcpEngine {
    TcpEngine::new(c).unwrap()
}

/// A buffer filled with a random tile of odd length, so misplaced bytes show.
pub fn patterned(len: usize, seed: u64) -> HostBuffer {
    let mut b = HostBuffer::new(len).unwrap();
    let mut tile = vec![0u8; 65_537];
    StdRng::seed_from_u64(seed).fill_bytes(&mut tile);
    for (i, chunk) in b.as_mut_slice().chunks_mut(tile.len()).enumerate() {
        let rot = i % tile.len();
        let n = chunk.len();
        let (a, c) = tile.split_at(rot);
        let joined: Vec<u8> = c.iter().chain(a.iter()).copied().take(n).collect();
        chunk.copy_from_slice(&joined);
    }
    b
}

/// Register `buf` with `e`.
pub fn register(e: &dyn TransferEngine, buf: &HostBuffer) {
    // SAFETY: every test deregisters or drops the engine before its buffers
    // go away, and only looks at buffers after transfers into them finished.
    unsafe { e.batch_register(&[buf.region()]) }.unwrap();
}

/// Random non-overlapping blocks: sizes log-uniform in [1, max], unaligned,
/// fitting in `src_len` / `dst_len`.
pub fn random_blocks(
    rng: &mut StdRng,
    src: &HostBuffer,
    dst: &HostBuffer,
    max: u64,
    budget: u64,
) -> Vec<kvbridge_engine::Block> {
    let mut out = Vec::new();
    let mut s_off = 0u64;
    let mut d_off = 0u64;
    let mut moved = 0u64;
    while moved < budget {
        let bits = rng.gen_range(0..=max.ilog2());
        let len = rng.gen_range(1..=(1u64 << bits)).min(max);
        let s_gap = rng.gen_range(0..64);
        let d_gap = rng.gen_range(0..64);
        if s_off + s_gap + len > src.len() as u64 || d_off + d_gap + len > dst.len() as u64 {
            break;
        }
        out.push(kvbridge_engine::Block {
            src: src.addr() + s_off + s_gap,
            dst: dst.addr() + d_off + d_gap,
            len,
        });
        s_off += s_gap + len;
        d_off += d_gap + len;
        moved += len;
    }
    out
}

/// Check that every block's bytes arrived.
pub fn assert_arrived(blocks: &[kvbridge_engine::Block], src: &HostBuffer, dst: &HostBuffer) {
    for (i, b) in blocks.iter().enumerate() {
        let s = (b.src - src.addr()) as usize;
        let d = (b.dst - dst.addr()) as usize;
        let n = b.len as usize;
        assert!(
            src.as_slice()[s..s + n] == dst.as_slice()[d..d + n],
            "block {i} ({n} bytes) differs"
        );
    }
}
