//! Tests of the copy planning (no CUDA needed).

use super::*;

fn b(src: u64, dst: u64, len: u64) -> Block {
    Block { src, dst, len }
}

#[test]
fn pack_round_trips() {
    for blk in [
        b(0x7f00_0000_1234, 0x7e00_0000_0001, 1),
        b(1, 2, 0xffff),
        b(0xffff_ffff_ffff, 0, u64::from(u32::MAX)),
        b(0x1000, 0x2000, 0x1_0000),
    ] {
        assert!(fits_descriptor(&blk));
        assert_eq!(unpack(pack(&blk)), blk);
    }
    assert!(!fits_descriptor(&b(ADDR_LIMIT, 0, 1)));
    assert!(!fits_descriptor(&b(0, 0, 1 << 32)));
}

#[test]
fn choice_per_block_size() {
    let t = CopyTuning::default();
    let small = b(0x1000, 0x2000, 256);
    let big = b(0x1000, 0x2000, 64 << 20);
    assert!(!t.wants_memcpy(&small));
    assert!(t.wants_memcpy(&big));
    let s = t.split(&[small, big, b(0, 0, 0)]);
    assert_eq!(s.kernel, vec![small]);
    assert_eq!(s.memcpy, vec![big]);
    let k = CopyTuning {
        mode: CopyMode::Kernel,
        ..t
    };
    let s = k.split(&[b(0x10, 0x0010_0000, 200 << 10)]);
    assert!(s.memcpy.is_empty());
    assert_eq!(s.kernel.len(), 4);
    assert_eq!(s.kernel.iter().map(|x| x.len).sum::<u64>(), 200 << 10);
    assert_eq!(s.kernel[1].src, 0x10 + (64 << 10));
    assert!(
        CopyTuning {
            mode: CopyMode::PerBlock,
            ..t
        }
        .wants_memcpy(&small)
    );
    assert!(t.all_kernel_as_is(&[small]));
    assert!(!t.all_kernel_as_is(&[big]));
}

#[test]
fn group_size_follows_mean_length() {
    assert_eq!(group_shift(&[b(0, 0, 256); 4]), 4);
    assert_eq!(group_shift(&[b(0, 0, 1); 4]), 2);
    assert_eq!(group_shift(&[b(0, 0, 4096)]), 6);
    assert_eq!(group_shift(&[b(0, 0, 1 << 20)]), 9);
    assert_eq!(grid_size(1, 8, 132), 1);
    assert_eq!(grid_size(1 << 22, 4, 132), 132 * 32);
}

#[test]
fn only_batches_of_long_copies_alternate_streams() {
    let acc = |kernel_bytes, run_copies| Prepared {
        kernel_bytes,
        run_copies,
        ..Prepared::default()
    };
    // 1000 blocks of 256 B: first stream.
    assert!(!acc(256_000, 0).alternates(1000));
    // 4096 blocks of 64 KiB: alternate.
    assert!(acc(4096 << 16, 0).alternates(4096));
    // Runs: 64 copies of 256 B stay, 64 copies of 4 KiB alternate.
    assert!(!acc(64 * 256, 64).alternates(0));
    assert!(acc(64 * 4096, 64).alternates(0));
    // Just below the mean, and memcpy-only batches.
    assert!(!acc(2 * ALTERNATE_MIN_COPY - 1, 0).alternates(2));
    assert!(acc(0, 0).alternates(0));
}

type Prep = Result<(Vec<[u64; 2]>, Prepared), (usize, Miss)>;

fn prep(
    blocks: &[Block],
    local: &RangeMap,
    remote: &RangeMap,
    tuning: &CopyTuning,
    pool: Option<&rayon::ThreadPool>,
) -> Prep {
    let mut out = vec![[9u64; 2]; blocks.len()];
    let mut acc = Prepared::default();
    prepare::<true>(
        blocks,
        Context {
            local,
            remote,
            tuning,
            pool,
        },
        &mut out,
        &mut acc,
        &|_, _| {},
    )?;
    Ok((out, acc))
}

#[test]
fn prepare_checks_translates_and_packs() {
    let local = RangeMap::new(vec![(0x1000, 0x1000, 0)]);
    let remote = RangeMap::new(vec![
        (0x10_0000, 0x100, 0x1000),
        (0x20_0000, 0x100, -0x1000),
        (0x30_0000, 0x100, 0),
    ]);
    let t = CopyTuning::default();
    let blocks = [
        b(0x1000, 0x20_00f0, 16),
        b(0, 0, 0),
        b(0x1800, 0x10_0010, 16),
    ];
    let (out, acc) = prep(&blocks, &local, &remote, &t, None).unwrap();
    assert_eq!(unpack(out[0]), b(0x1000, 0x1f_f0f0, 16));
    assert_eq!(out[1], EMPTY);
    assert_eq!(unpack(out[2]), b(0x1800, 0x10_1010, 16));
    assert_eq!(acc.used, vec![0, 1]);
    assert_eq!(acc.kernel_bytes, 32);
    assert!(acc.pieces.is_empty() && acc.memcpy.is_empty());
    let bad = [b(0x1000, 0x10_0000, 8), b(0x1000, 0x20_00f8, 16)];
    assert_eq!(
        prep(&bad, &local, &remote, &t, None).unwrap_err(),
        (1, Miss::Destination)
    );
    let bad = [b(0x1ff8, 0x20_0000, 16)];
    assert_eq!(
        prep(&bad, &local, &remote, &t, None).unwrap_err(),
        (0, Miss::Source)
    );
    // Long blocks: cut into pieces, a placeholder in their slot.
    let local = RangeMap::new(vec![(0x100_0000, 1 << 30, 0)]);
    let remote = RangeMap::new(vec![(0x8000_0000, 1 << 30, 0x10)]);
    let kt = CopyTuning {
        piece: 4096,
        memcpy_min_block: 1 << 20,
        ..t
    };
    let blocks = [
        b(0x100_0000, 0x8000_0000, 10_000),
        b(0x100_0000, 0x8000_0000 + 20_000, 100),
        b(0x100_0000, 0x8000_0000 + 40_000, 1 << 20),
    ];
    let (out, acc) = prep(&blocks, &local, &remote, &kt, None).unwrap();
    assert_eq!(out[0], EMPTY);
    assert_eq!(unpack(out[1]), b(0x100_0000, 0x8000_0000 + 20_016, 100));
    assert_eq!(out[2], EMPTY);
    assert_eq!(acc.pieces.len(), 3);
    assert_eq!(
        unpack(acc.pieces[2]),
        b(0x100_2000, 0x8000_2010, 10_000 - 8192)
    );
    assert_eq!(
        acc.memcpy,
        vec![b(0x100_0000, 0x8000_0000 + 40_016, 1 << 20)]
    );
    assert_eq!(acc.kernel_bytes, 10_100);
}

#[test]
fn parallel_prepare_matches_sequential() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let local = RangeMap::new(vec![(1 << 20, 1 << 30, 0), (4 << 30, 1 << 30, 0)]);
    let remote = RangeMap::new(vec![
        (8 << 30, 1 << 30, 1 << 12),
        (16 << 30, 1 << 30, -(1 << 12)),
    ]);
    let t = CopyTuning {
        piece: 1024,
        ..CopyTuning::default()
    };
    let n = 100_000u64;
    let mut blocks: Vec<Block> = (0..n)
        .map(|i| {
            let src = if i % 3 == 0 { 1 << 20 } else { 4 << 30 } + i * 64;
            let dst = if i % 7 == 0 { 8 << 30 } else { 16 << 30 } + i * 97;
            b(src, dst, (i * 13) % 1500)
        })
        .collect();
    let seq = prep(&blocks, &local, &remote, &t, None).unwrap();
    let par = prep(&blocks, &local, &remote, &t, Some(&pool)).unwrap();
    assert_eq!(seq, par);
    assert_eq!(seq.1.used, vec![0, 1]);
    blocks[77_777].dst = 1;
    blocks[90_000].src = 1;
    assert_eq!(
        prep(&blocks, &local, &remote, &t, Some(&pool)).unwrap_err(),
        (77_777, Miss::Destination)
    );
}

#[test]
#[ignore = "timing, not a check"]
fn prepare_speed_long_blocks() {
    let local = RangeMap::new(vec![(1 << 30, 1 << 30, 0)]);
    let remote = RangeMap::new(vec![(8 << 30, 1 << 30, 1 << 12)]);
    let t = CopyTuning::default();
    for size in [64u64 << 10, 1 << 20, 16 << 20] {
        let n = (1u64 << 30) / size;
        let blocks: Vec<Block> = (0..n)
            .map(|i| b((1 << 30) + i * size, (8 << 30) + ((i * 5) % n) * size, size))
            .collect();
        let mut out = vec![[0u64; 2]; n as usize];
        let mut acc = Prepared::default();
        for k in 0..4 {
            acc.clear();
            let t0 = std::time::Instant::now();
            let f = if k % 2 == 0 {
                prepare::<true>
            } else {
                prepare::<false>
            };
            f(
                &blocks,
                Context {
                    local: &local,
                    remote: &remote,
                    tuning: &t,
                    pool: None,
                },
                &mut out,
                &mut acc,
                &|_, _| {},
            )
            .unwrap();
            println!(
                "prepare {n} blocks of {size} (streaming stores {}): {:.1} us ({} pieces)",
                k % 2 == 0,
                t0.elapsed().as_secs_f64() * 1e6,
                acc.pieces.len()
            );
        }
    }
}

/// Host cost of preparing 256-byte blocks (`cargo test --release -- --ignored --nocapture`).
#[test]
#[ignore = "timing, not a check"]
fn prepare_speed() {
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    let n = 4u64 << 20;
    let local = RangeMap::new(vec![(1 << 30, 1 << 30, 0)]);
    let remote = RangeMap::new(vec![(8 << 30, 1 << 30, 1 << 12)]);
    let blocks: Vec<Block> = (0..n)
        .map(|i| {
            b(
                (1 << 30) + i * 256,
                (8 << 30) + ((i * 0x9E37_79B9) % n) * 256,
                256,
            )
        })
        .collect();
    let mut out = vec![[0u64; 2]; n as usize];
    let mut acc = Prepared::default();
    let t = CopyTuning::default();
    for _ in 0..3 {
        use rayon::prelude::*;
        let t0 = std::time::Instant::now();
        let sum: u64 = pool.install(|| {
            blocks
                .par_chunks(1 << 16)
                .map(|c| c.iter().map(|b| b.len).sum::<u64>())
                .sum()
        });
        let dt = t0.elapsed();
        println!(
            "read {} MiB of blocks on {} threads: {:.2} ms, {:.1} GB/s ({sum})",
            (n * 24) >> 20,
            pool.current_num_threads(),
            dt.as_secs_f64() * 1e3,
            (n * 24) as f64 / dt.as_secs_f64() / 1e9
        );
    }
    for (nt, p) in [(true, None), (true, Some(&pool)), (false, Some(&pool))] {
        for _ in 0..3 {
            acc.clear();
            let t0 = std::time::Instant::now();
            let f = if nt {
                prepare::<true>
            } else {
                prepare::<false>
            };
            f(
                &blocks,
                Context {
                    local: &local,
                    remote: &remote,
                    tuning: &t,
                    pool: p,
                },
                &mut out,
                &mut acc,
                &|_, _| {},
            )
            .unwrap();
            let dt = t0.elapsed();
            println!(
                "prepare {n} blocks, pool {}, streaming stores {nt}: {:.2} ms, {:.2} ns/block",
                p.is_some(),
                dt.as_secs_f64() * 1e3,
                dt.as_secs_f64() * 1e9 / n as f64
            );
        }
    }
}

#[test]
fn parallel_pack_matches() {
    let blocks: Vec<Block> = (0..100_000u64).map(|i| b(i * 7, i * 13, i % 300)).collect();
    let mut out = vec![[0u64; 2]; blocks.len()];
    pack_par(&blocks, &mut out, 4);
    assert!(blocks.iter().zip(&out).all(|(x, y)| unpack(*y) == *x));
}
