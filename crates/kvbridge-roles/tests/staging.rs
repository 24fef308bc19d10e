//! The staging path through real managers over TCP: every TP pairing with
//! GQA replication byte-exact, the ring wrapping under many concurrent
//! rooms, aborts in every staging state, a decode restart mid-stream,
//! staging on one side only, and MLA untouched.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use kvbridge_roles::synthetic::ModelSpec;
use kvbridge_roles::{KvPoll, StagingConfig, StagingMode};

/// Staging with chunks of `chunk_tokens` tokens and a ring of `ring` bytes.
fn staging(chunk_tokens: u64, ring: u64) -> StagingConfig {
    StagingConfig {
        mode: StagingMode::On,
        pool_bytes: ring,
        chunk_tokens,
        buffer_bytes: 1 << 20,
        wait_timeout: Duration::from_secs(20),
    }
}

fn model(heads: u64) -> ModelSpec {
    ModelSpec {
        kv_heads: heads,
        ..tiny_model(false, 2)
    }
}

fn staged_bytes(c: &Cluster) -> (u64, u64) {
    let p = c
        .prefill
        .iter()
        .map(|(m, _)| m.metrics().staged_bytes.get())
        .sum();
    let d = c
        .decode
        .iter()
        .map(|(m, _)| m.metrics().staged_bytes.get())
        .sum();
    (p, d)
}

fn assert_ring_empty(c: &Cluster) {
    for (i, (m, _)) in c.decode.iter().enumerate() {
        assert_eq!(
            m.staging_allocations(),
            Some(0),
            "decode rank {i} still holds ring space"
        );
    }
}

/// Three rooms of different lengths, sent in chunks of 3 pages (not the
/// grid's 2 or 4): every byte of every decode rank, all of it staged.
fn check(heads: u64, prefill_tp: u64, decode_tp: u64) {
    check_with(heads, prefill_tp, decode_tp, staging(8, 64 << 10));
}

fn check_with(heads: u64, prefill_tp: u64, decode_tp: u64, config: StagingConfig) {
    let mut c = Cluster::staged(model(heads), prefill_tp, decode_tp, 64, config);
    for (k, room) in [21u64, 22, 23].into_iter().enumerate() {
        let n = 5 + k * 4;
        let src: Vec<i32> = (0..n as i32).map(|i| 2 * i + k as i32).collect();
        let dst: Vec<i32> = (0..n as i32).map(|i| 63 - i - 10 * k as i32).collect();
        for (rank, (status, v)) in c.run(room, &src, &dst, 3).into_iter().enumerate() {
            assert_eq!(status, KvPoll::Success, "decode rank {rank}");
            assert!(v.bytes > 0);
            assert_eq!(v.mismatched, 0, "decode rank {rank}: {v:?}");
        }
    }
    let (p, d) = staged_bytes(&c);
    assert!(p > 0, "the prefill ranks gathered");
    // Prefill ranks holding the same heads (more ranks than heads) both
    // write them; the decode scatters one copy.
    let replicas = if prefill_tp > decode_tp {
        (prefill_tp / heads).max(1)
    } else {
        1
    };
    assert_eq!(p, d * replicas, "every gathered head was scattered once");
    assert_ring_empty(&c);
    c.shutdown();
}

#[test]
fn staged_tp_1_to_2() {
    check(8, 1, 2);
}

#[test]
fn staged_tp_2_to_1() {
    check(8, 2, 1);
}

#[test]
fn staged_tp_2_to_4() {
    check(8, 2, 4);
}

#[test]
fn staged_tp_4_to_2() {
    check(8, 4, 2);
}

#[test]
fn staged_tp_8_to_2_with_replicated_prefill_heads() {
    check(4, 8, 2);
}

#[test]
fn staged_tp_2_to_8_with_replicated_decode_heads() {
    check(4, 2, 8);
}

#[test]
fn staged_in_several_pieces_through_small_gather_slots() {
    // Gather slots of one staging layer each: every chunk takes several
    // bulk writes, and the worker's four slots are reused many times.
    let config = StagingConfig {
        buffer_bytes: 0,
        ..staging(8, 64 << 10)
    };
    check_with(8, 1, 2, config.clone());
    check_with(8, 4, 2, config);
}

#[test]
fn mla_is_not_staged() {
    let mut c = Cluster::staged(tiny_model(true, 2), 2, 1, 64, staging(8, 64 << 10));
    let src: Vec<i32> = (0..7).collect();
    let dst: Vec<i32> = (20..27).collect();
    for (status, v) in c.run(5, &src, &dst, 3) {
        assert_eq!(status, KvPoll::Success);
        assert_eq!(v.mismatched, 0, "{v:?}");
    }
    assert_eq!(staged_bytes(&c), (0, 0));
    assert_eq!(
        c.decode[0].0.staging_allocations(),
        None,
        "no ring for an MLA pool"
    );
    c.shutdown();
}

/// A hybrid pool under staging: the KV goes through the ring (head slices
/// of two prefill ranks interleaved per token on the decode), the mamba
/// state slot and the aux row still arrive on the last chunk.
#[test]
fn a_state_slot_lands_beside_staged_kv() {
    use kvbridge_mem::HostBuffer;
    use kvbridge_plan::{StateComponent, StateType};
    const SLOT: usize = 192;
    const HEAD: usize = 64;
    const PAGE: usize = 16;
    let with_state = |mut args: kvbridge_roles::KvArgs, buf: &HostBuffer| {
        args.layout.states.push(StateComponent::new(
            StateType::Mamba,
            vec![buf.addr()],
            vec![SLOT as u64],
        ));
        args.state_data_lens.push(vec![buf.len() as u64]);
        args
    };
    let bs = bootstrap();
    let config = staging(32, 1 << 20);
    let src_pages: Vec<i32> = vec![1, 2, 3, 7, 8];
    let dst_pages: Vec<i32> = vec![30, 31, 5, 6, 50];
    let mut prefill = Vec::new();
    for tp in 0..2u64 {
        // One head of 64 bytes per token on each prefill rank.
        let mut pools = Pools::new(2, 32, (PAGE * HEAD) as u64, 4, 64);
        for &p in &src_pages {
            pools.fill_page(p as u64 + 100 * (tp + 1), p as usize);
        }
        pools.fill_aux(9, 1);
        let mut state = HostBuffer::new(8 * SLOT).unwrap();
        state.as_mut_slice()[3 * SLOT..4 * SLOT].fill(0x3c);
        let mut c = prefill_config(bs.local_addr(), 2, tp);
        c.staging = config.clone();
        let m = start_prefill(
            c,
            with_state(pools.kv_args(PAGE as u64, 2, tp, 1), &state),
            tcp_engine(),
        );
        prefill.push((m, pools, state));
    }
    let d_pools = Pools::new(2, 64, (PAGE * 2 * HEAD) as u64, 8, 64);
    let d_state = HostBuffer::new(16 * SLOT).unwrap();
    let mut c = decode_config(1);
    c.staging = config;
    let decode = start_decode(
        c,
        with_state(d_pools.kv_args(PAGE as u64, 1, 0, 2), &d_state),
        tcp_engine(),
    );
    let room = 0x57a9;
    let mut rx = decode.receiver(&bs.local_addr().to_string(), room);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&dst_pages, 3, &[vec![11]], None);
    let mut senders = Vec::new();
    for (m, _, _) in &prefill {
        let mut tx = m.sender(room);
        tx.init(src_pages.len() as u64, Some(1));
        assert_eq!(
            wait_for(Duration::from_secs(20), KvPoll::WaitingForInput, || tx
                .poll()),
            KvPoll::WaitingForInput
        );
        senders.push(tx);
    }
    for tx in &mut senders {
        let chunks: Vec<&[i32]> = src_pages.chunks(2).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let states = (i + 1 == chunks.len()).then(|| vec![Some(vec![3i64])]);
            tx.send(chunk, states, None).unwrap();
        }
    }
    assert_eq!(
        wait_terminal(Duration::from_secs(20), || rx.poll()),
        KvPoll::Success
    );
    assert!(
        d_state.as_slice()[11 * SLOT..12 * SLOT]
            .iter()
            .all(|b| *b == 0x3c),
        "state slot"
    );
    assert_eq!(
        &d_pools.aux.as_slice()[3 * 64..4 * 64],
        &prefill[0].1.aux.as_slice()[64..2 * 64]
    );
    for (s, d) in src_pages.iter().zip(&dst_pages) {
        for b in 0..4 {
            for t in 0..PAGE {
                for (r, (_, pools, _)) in prefill.iter().enumerate() {
                    let src =
                        &pools.kv[b].as_slice()[*s as usize * PAGE * HEAD + t * HEAD..][..HEAD];
                    let at = *d as usize * PAGE * 2 * HEAD + t * 2 * HEAD + r * HEAD;
                    assert_eq!(
                        &d_pools.kv[b].as_slice()[at..at + HEAD],
                        src,
                        "page {d} token {t} buffer {b}"
                    );
                }
            }
        }
    }
    assert!(decode.metrics().staged_bytes.get() > 0, "the KV was staged");
    for tx in &mut senders {
        assert_eq!(
            wait_terminal(Duration::from_secs(20), || tx.poll()),
            KvPoll::Success
        );
        tx.clear();
    }
    rx.clear();
    for (m, _, _) in prefill {
        m.teardown();
    }
    decode.teardown();
    bs.shutdown();
}

/// sglang's decode creates its manager before it sets `KVArgs.kv_head_num`
/// (it does so afterwards, for staging only): such a decode starts, and
/// with its head counts unknown its rooms take the per-slice path (the
/// ring is not offered to the prefill), byte-exact.
#[test]
fn a_decode_without_head_counts_takes_the_per_slice_path() {
    let unknown = |mut a: kvbridge_roles::KvArgs| {
        a.layout.kv_head_num = 0;
        a.layout.total_kv_head_num = 0;
        a
    };
    let config = StagingConfig {
        wait_timeout: Duration::from_secs(5),
        ..staging(8, 64 << 10)
    };
    let mut c = Cluster::staged_with(model(8), 1, 2, 64, config, &unknown);
    let src: Vec<i32> = (0..9).collect();
    let dst: Vec<i32> = (20..29).collect();
    for (rank, (status, v)) in c.run(31, &src, &dst, 3).into_iter().enumerate() {
        assert_eq!(status, KvPoll::Success, "decode rank {rank}");
        assert_eq!(v.mismatched, 0, "decode rank {rank}: {v:?}");
    }
    assert_eq!(
        staged_bytes(&c),
        (0, 0),
        "nothing staged without head counts"
    );
    assert_ring_empty(&c);
    c.shutdown();
}

/// Heads handed over after start (sglang's `set_kv_buffer_tensors`, before
/// its first request): staging works as if they had been known at start.
#[test]
fn staging_starts_once_the_head_counts_are_handed_over() {
    let unknown = |mut a: kvbridge_roles::KvArgs| {
        a.layout.kv_head_num = 0;
        a.layout.total_kv_head_num = 0;
        a
    };
    let m = model(8);
    let mut c = Cluster::staged_with(m.clone(), 1, 2, 64, staging(8, 64 << 10), &unknown);
    for (decode, _) in &c.decode {
        let e = decode.set_kv_heads(0, 8).unwrap_err();
        assert!(e.to_string().contains("kv_head_num"), "{e}");
        let e = decode.set_kv_heads(4, 2).unwrap_err();
        assert!(e.to_string().contains("below"), "{e}");
        decode.set_kv_heads(m.local_heads(2), m.kv_heads).unwrap();
    }
    for (k, room) in [41u64, 42].into_iter().enumerate() {
        let n = 5 + 4 * k;
        let src: Vec<i32> = (0..n as i32).collect();
        let dst: Vec<i32> = (0..n as i32).map(|i| 60 - i).collect();
        for (rank, (status, v)) in c.run(room, &src, &dst, 3).into_iter().enumerate() {
            assert_eq!(status, KvPoll::Success, "decode rank {rank}");
            assert_eq!(v.mismatched, 0, "decode rank {rank}: {v:?}");
        }
    }
    let (p, d) = staged_bytes(&c);
    assert!(p > 0 && p == d, "staged: prefill {p}, decode {d}");
    assert_ring_empty(&c);
    c.shutdown();
}

/// A TCP engine that moves head slices one copy at a time (its native runs
/// off), as UCX does: it prefers staging.
fn per_copy_engine() -> std::sync::Arc<dyn kvbridge_engine::TransferEngine> {
    let mut config = kvbridge_engine::EngineConfig::default();
    config.tcp.native_runs = false;
    std::sync::Arc::new(kvbridge_engine::TcpEngine::new(config).expect("tcp engine"))
}

/// Staging `auto` (the default) stages where the engine is faster staged and
/// goes per slice where it is not, with every byte delivered either way.
#[test]
fn staging_auto_follows_the_engine() {
    let auto = StagingConfig {
        mode: StagingMode::Auto,
        ..staging(8, 64 << 10)
    };
    assert_eq!(StagingConfig::default().mode, StagingMode::Auto);
    for (name, prefers, mut c) in [
        (
            "per-copy engine",
            true,
            Cluster::staged_on(model(8), 2, 4, 64, auto.clone(), per_copy_engine),
        ),
        (
            "engine with native runs",
            false,
            Cluster::staged_on(model(8), 2, 4, 64, auto.clone(), tcp_engine),
        ),
    ] {
        for (rank, (decode, _)) in c.decode.iter().enumerate() {
            assert_eq!(
                decode.staging_ring().is_some(),
                prefers,
                "{name}: decode rank {rank}'s ring"
            );
        }
        let src: Vec<i32> = (0..9).map(|i| 2 * i + 1).collect();
        let dst: Vec<i32> = (0..9).map(|i| 60 - i).collect();
        for (rank, (status, v)) in c.run(51, &src, &dst, 3).into_iter().enumerate() {
            assert_eq!(status, KvPoll::Success, "{name}: decode rank {rank}");
            assert_eq!(v.mismatched, 0, "{name}: decode rank {rank}: {v:?}");
        }
        let (p, d) = staged_bytes(&c);
        if prefers {
            assert!(p > 0 && p == d, "{name}: staged prefill {p}, decode {d}");
            assert_ring_empty(&c);
        } else {
            assert_eq!((p, d), (0, 0), "{name}: nothing staged");
        }
        c.shutdown();
    }
}
