//! `resolve` on arbitrary peer-reported topologies never panics and never
//! allocates more than the caps allow (MAX_PARALLEL_SIZE ranks per list),
//! measured by a counting allocator.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvbridge_roles::decode::topology::{LocalTopology, resolve};
use kvbridge_wire::bootstrap::{MAX_PARALLEL_SIZE, MAX_TOTAL_RANKS, PrefillServerInfo};
use proptest::prelude::*;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, recording the largest request made while tracking.
struct Counting;

fn record(size: usize) {
    let _ = TRACKING.try_with(|on| {
        if on.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every call is forwarded to `System` unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Sizes a peer might send: small, at and around the caps, huge.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..=9,
        Just(MAX_PARALLEL_SIZE),
        Just(MAX_PARALLEL_SIZE + 1),
        0u64..200_000,
        Just(1 << 40),
        any::<u64>(),
    ]
}

fn info() -> impl Strategy<Value = PrefillServerInfo> {
    (
        (size(), size(), size(), size()),
        prop_oneof![Just(None), Just(Some(16u64)), any::<Option<u64>>()],
        any::<[bool; 4]>(),
    )
        .prop_map(|((tp, cp, dp, pp), page_size, flags)| PrefillServerInfo {
            attn_tp_size: tp,
            attn_cp_size: cp,
            dp_size: dp,
            pp_size: pp,
            page_size,
            kv_cache_dtype: flags[0].then(|| "auto".to_owned()),
            follow_bootstrap_room: flags[1],
            enable_dsa_cache_layer_split: flags[2],
            dsv41_spec_layout: None,
            kv_layout: None,
            decode_allocation_policy: "early".into(),
            enable_kv_cache_sharding: flags[3],
            prefill_http_port: None,
            target_tp_rank: None,
            target_tp_ranks: None,
            target_cp_ranks: None,
            target_pp_ranks: None,
            required_dst_info_num: None,
            required_prefill_response_num: None,
        })
}

fn local() -> impl Strategy<Value = LocalTopology> {
    (
        prop_oneof![1u64..=16, Just(64), Just(4096)],
        any::<u64>(),
        prop_oneof![Just(1u64), 0u64..=4],
        0u64..4,
        any::<[bool; 3]>(),
    )
        .prop_map(|(tp, rank, pp, pp_rank, flags)| LocalTopology {
            attn_tp_size: tp,
            engine_rank: rank,
            pp_size: pp,
            pp_rank,
            page_size: 16,
            is_mla: flags[0],
            is_hybrid_mla: flags[1],
            all_cp_ranks: flags[2],
            dcp_size: 1,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn resolve_is_bounded(info in info(), local in local()) {
        LARGEST.with(|l| l.set(0));
        TRACKING.with(|t| t.set(true));
        let result = std::panic::catch_unwind(|| resolve(&info, &local, "auto", None));
        TRACKING.with(|t| t.set(false));
        let largest = LARGEST.with(Cell::get);
        prop_assert!(result.is_ok(), "resolve panicked on {info:?} / {local:?}");
        let cap = MAX_PARALLEL_SIZE as usize * std::mem::size_of::<u64>();
        prop_assert!(largest <= cap, "allocated {largest} bytes for {info:?}");
        if let Ok(Ok(m)) = result {
            let max = MAX_PARALLEL_SIZE as usize;
            prop_assert!(m.target_tp_ranks.len() <= max);
            prop_assert!(m.target_cp_ranks.len() <= max);
            prop_assert!(m.target_pp_ranks.len() <= max);
            let lookups = m.target_tp_ranks.len() * m.target_cp_ranks.len() * m.target_pp_ranks.len();
            prop_assert!(lookups as u64 <= MAX_TOTAL_RANKS);
            prop_assert!(m.required_prefill_response_num <= MAX_TOTAL_RANKS);
        }
    }
}

#[test]
fn huge_or_zero_sizes_are_refused_with_a_reason() {
    let base = PrefillServerInfo {
        attn_tp_size: 1,
        attn_cp_size: 1,
        dp_size: 1,
        pp_size: 1,
        page_size: Some(16),
        kv_cache_dtype: Some("auto".into()),
        follow_bootstrap_room: true,
        enable_dsa_cache_layer_split: false,
        dsv41_spec_layout: None,
        kv_layout: None,
        decode_allocation_policy: "early".into(),
        enable_kv_cache_sharding: false,
        prefill_http_port: None,
        target_tp_rank: None,
        target_tp_ranks: None,
        target_cp_ranks: None,
        target_pp_ranks: None,
        required_dst_info_num: None,
        required_prefill_response_num: None,
    };
    let local = LocalTopology {
        attn_tp_size: 1,
        engine_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        page_size: 16,
        is_mla: false,
        is_hybrid_mla: false,
        all_cp_ranks: false,
        dcp_size: 1,
    };
    assert!(resolve(&base, &local, "auto", None).is_ok());
    let spoiled: [fn(&mut PrefillServerInfo); 4] = [
        |i| i.pp_size = 1 << 40,
        |i| i.dp_size = 0,
        |i| i.attn_tp_size = MAX_PARALLEL_SIZE + 1,
        |i| {
            i.attn_cp_size = 4096;
            i.attn_tp_size = 4096;
            i.enable_kv_cache_sharding = true;
        },
    ];
    for spoil in spoiled {
        let mut info = base.clone();
        spoil(&mut info);
        let reason = resolve(&info, &local, "auto", None).unwrap_err();
        assert!(reason.contains("unusable topology"), "{reason}");
    }
}
