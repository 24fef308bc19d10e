//! Every model layout the planner handles, through real prefill and decode
//! managers over TCP: hybrid state components (mamba whole and TP-sliced,
//! SWA windows, DSA indexer pages, DSA tail rings, QSA pages), speculative
//! draft layers and decode context parallelism. Each decode rank verifies
//! every byte of its share: KV, aux and states.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;

use kvbridge_roles::KvPoll;
use kvbridge_roles::synthetic::{CompressedSpec, ModelSpec, StateBuffer, StateLayers, StateSpec};

/// A small hybrid: `layers` layers, every second one full attention.
fn hybrid(mla: bool, layers: u64, states: Vec<StateSpec>) -> ModelSpec {
    ModelSpec {
        full_attention_interval: 2,
        states,
        ..tiny_model(mla, layers)
    }
}

fn state(state_type: &str, layers: StateLayers, buffers: Vec<StateBuffer>) -> StateSpec {
    StateSpec {
        state_type: state_type.into(),
        layers,
        window_tokens: None,
        buffers,
    }
}

/// A gated-delta-net slot: conv `[q | k | v]` channels × 3 taps and a
/// recurrent state of 8 heads, both TP-sliced, plus a replicated scalar row.
fn mamba() -> StateSpec {
    state(
        "mamba",
        StateLayers::Linear,
        vec![
            StateBuffer::Slot {
                outer: 1,
                dim: 32,
                unit_bytes: 6,
                groups: vec![8, 8, 16],
            },
            StateBuffer::Slot {
                outer: 2,
                dim: 8,
                unit_bytes: 24,
                groups: Vec::new(),
            },
            StateBuffer::Slot {
                outer: 1,
                dim: 0,
                unit_bytes: 40,
                groups: Vec::new(),
            },
        ],
    )
}

fn swa(window: u64) -> StateSpec {
    StateSpec {
        window_tokens: Some(window),
        ..state(
            "swa",
            StateLayers::Linear,
            vec![
                StateBuffer::Page {
                    heads: 8,
                    head_bytes: 32,
                    sliced: true,
                };
                2
            ],
        )
    }
}

fn replicated_pages(state_type: &str, layers: StateLayers) -> StateSpec {
    state(
        state_type,
        layers,
        vec![StateBuffer::Page {
            heads: 1,
            head_bytes: 20,
            sliced: false,
        }],
    )
}

fn tail_ring(ring: u64) -> StateSpec {
    state(
        "dsa_tail",
        StateLayers::All,
        vec![
            StateBuffer::Ring {
                ring,
                slot_bytes: 12,
            };
            2
        ],
    )
}

/// Three requests of awkward lengths (a partial last page, one page, many),
/// each checked on every decode rank.
fn check(mut cluster: Cluster) {
    let ps = cluster.model.page_size;
    for (k, (room, tokens)) in [(21u64, 9 * ps - 3), (22, ps), (23, 13 * ps + 1)]
        .into_iter()
        .enumerate()
    {
        let n = tokens.div_ceil(ps) as i32;
        let src: Vec<i32> = (0..n).map(|i| 2 * i + k as i32).collect();
        let dst: Vec<i32> = (0..n).map(|i| 60 - i - k as i32).collect();
        let results = cluster.run_tokens(room, tokens, &src, &dst, 3);
        for (rank, (status, verified)) in results.into_iter().enumerate() {
            assert_eq!(status, KvPoll::Success, "room {room}: decode rank {rank}");
            assert!(verified.bytes > 0);
            assert_eq!(
                verified.mismatched, 0,
                "room {room}: decode rank {rank}: {verified:?}"
            );
        }
    }
    cluster.shutdown();
}

fn run(model: ModelSpec, prefill_tp: u64, prefill_pp: u64, decode_tp: u64) {
    check(Cluster::new(model, prefill_tp, prefill_pp, decode_tp, 64));
}

#[test]
fn mamba_slots_with_equal_tp() {
    run(hybrid(false, 4, vec![mamba()]), 2, 1, 2);
}

#[test]
fn mamba_slots_sliced_tp_1_to_2() {
    run(hybrid(false, 4, vec![mamba()]), 1, 1, 2);
}

#[test]
fn mamba_slots_sliced_tp_4_to_2() {
    run(hybrid(false, 4, vec![mamba()]), 4, 1, 2);
}

#[test]
fn mamba_slots_sliced_tp_2_to_4_from_two_pp_stages() {
    run(hybrid(false, 6, vec![mamba()]), 2, 2, 4);
}

#[test]
fn swa_windows_with_equal_tp_and_pp() {
    // A window of 3 pages and a bit: long requests move only its pages.
    run(hybrid(false, 4, vec![swa(13)]), 2, 2, 2);
}

#[test]
fn swa_and_mamba_together() {
    run(hybrid(false, 4, vec![swa(8), mamba()]), 1, 1, 1);
}

#[test]
fn dsa_indexer_pages_on_mla_across_tp() {
    let m = ModelSpec {
        states: vec![replicated_pages("dsa", StateLayers::All)],
        ..tiny_model(true, 3)
    };
    run(m.clone(), 2, 1, 1);
    run(m, 1, 1, 2);
}

#[test]
fn dsa_indexer_pages_from_pp_stages() {
    let m = ModelSpec {
        states: vec![replicated_pages("dsa", StateLayers::All)],
        ..tiny_model(true, 4)
    };
    run(m, 1, 2, 1);
}

#[test]
fn dsa_tail_rings_wrap_and_split_over_pp() {
    let m = ModelSpec {
        states: vec![tail_ring(8)],
        ..tiny_model(true, 4)
    };
    run(m.clone(), 1, 1, 1);
    run(m, 1, 2, 2);
}

#[test]
fn qsa_pages_replicated_across_tp() {
    let m = ModelSpec {
        states: vec![
            replicated_pages("qsa_pending", StateLayers::Attention),
            replicated_pages("qsa_compressed", StateLayers::Attention),
        ],
        ..hybrid(false, 4, Vec::new())
    };
    run(m.clone(), 2, 1, 1);
    run(m, 1, 1, 2);
}

#[test]
fn draft_layers_mha_and_mla() {
    let mha = ModelSpec {
        draft_layers: 1,
        ..tiny_model(false, 3)
    };
    run(mha.clone(), 2, 1, 2);
    run(mha, 1, 2, 2);
    let mla = ModelSpec {
        draft_layers: 2,
        ..tiny_model(true, 3)
    };
    run(mla.clone(), 2, 1, 1);
    run(mla, 1, 3, 1);
}

#[test]
fn decode_context_parallel_relayout() {
    // Each of 2 DCP ranks holds every 2nd token; the draft layer every token.
    let m = ModelSpec {
        draft_layers: 1,
        ..tiny_model(true, 3)
    };
    let dcp = |prefill_tp, decode_tp, decode_cp| Shape {
        decode_cp,
        ..Shape::new(prefill_tp, 1, decode_tp)
    };
    check(Cluster::shaped(m.clone(), dcp(1, 2, 2), 64));
    check(Cluster::shaped(m, dcp(2, 4, 4), 64));
}

#[test]
fn decode_context_parallel_from_pp_stages() {
    let shape = Shape {
        decode_cp: 2,
        ..Shape::new(1, 2, 2)
    };
    check(Cluster::shaped(tiny_model(true, 4), shape, 64));
}

#[test]
fn swa_across_different_tp_is_head_sliced() {
    // sglang 0.5.23 head-slices SWA pages between different TP sizes when
    // the pool names its (NHD) page layout, as the synthetic pools do:
    // every token's heads land at their place, both directions.
    for (p, d) in [(2, 1), (1, 2)] {
        check(Cluster::new(hybrid(false, 4, vec![swa(8)]), p, 1, d, 64));
    }
}

#[test]
fn prefill_context_parallel_rank_0_sends_and_the_others_stand_by() {
    // CP 2 without all-ranks transfer: CP rank 1 is a dummy the decode
    // never asks; its rooms still succeed, and every byte comes from rank 0.
    for model in [tiny_model(false, 3), hybrid(false, 4, vec![mamba()])] {
        let shape = Shape {
            prefill_cp: 2,
            ..Shape::new(2, 1, 1)
        };
        check(Cluster::shaped(model, shape, 64));
    }
}

#[test]
fn prefill_context_parallel_ranks_each_send_a_share() {
    // All-ranks transfer on both sides: each CP rank sends its contiguous
    // share of the pages and the decode asks every CP rank; the replicated
    // state comes from CP rank 0 only.
    for (model, tp, cp, decode_tp) in [
        (tiny_model(false, 3), 1, 3, 2),
        (tiny_model(true, 3), 2, 2, 1),
        (hybrid(false, 4, vec![mamba(), swa(8)]), 2, 2, 2),
    ] {
        let shape = Shape {
            prefill_cp: cp,
            all_cp_ranks: true,
            decode_all_cp_ranks: true,
            ..Shape::new(tp, 1, decode_tp)
        };
        check(Cluster::shaped(model, shape, 64));
    }
}

#[test]
fn prefill_data_parallel_groups_routed_by_the_bootstrap_room() {
    // Two prefill DP groups on one bootstrap server: each room goes to DP
    // rank room % 2, which the decode computes itself.
    let shape = Shape {
        prefill_dp: 2,
        ..Shape::new(2, 1, 1)
    };
    check(Cluster::shaped(tiny_model(false, 3), shape, 64));
}

#[test]
fn prefill_data_parallel_groups_registered_and_queried() {
    // Rooms dispatched by another rule: each prefill registers the room's
    // DP rank with the bootstrap server and the decode asks for it.
    let shape = Shape {
        prefill_dp: 3,
        dp_query: true,
        ..Shape::new(1, 2, 2)
    };
    check(Cluster::shaped(tiny_model(true, 4), shape, 64));
}

#[test]
fn a_room_dispatched_against_the_bootstrap_room_rule_fails_with_the_reason() {
    let shape = Shape {
        prefill_dp: 2,
        ..Shape::new(1, 1, 1)
    };
    let cluster = Cluster::shaped(tiny_model(false, 2), shape, 16);
    let (dp1, _) = &cluster.prefill[1];
    assert_eq!(cluster.prefill_dp_ranks[1], 1);
    let mut tx = dp1.sender(4); // 4 % 2 == 0: not DP rank 1's
    assert_eq!(tx.poll(), KvPoll::Failed);
    let why = tx.failure_exception().reason;
    assert!(why.contains("follow_bootstrap_room conflict"), "{why}");
    // A router hint names the DP rank: no rule applies.
    let mut hinted = dp1.sender_dp_hinted(6);
    assert_eq!(hinted.poll(), KvPoll::Bootstrapping);
    hinted.clear();
    cluster.shutdown();
}

/// A small DeepSeek-V4-like pool: 6 layers [0, 4, 128, 4, 128, 4].
fn compressed() -> ModelSpec {
    ModelSpec {
        page_size: 8,
        compressed: Some(CompressedSpec {
            ratios: vec![0, 4, 128, 4, 128, 4],
            c4_bytes: 200,
            indexer_bytes: 72,
            c128_bytes: 24,
        }),
        ..tiny_model(true, 6)
    }
}

#[test]
fn compressed_mla_stages_pair_per_ratio_group() {
    // No layer ids (as sglang's V4 pool): each PP stage's C4 KV, indexer and
    // C128 buffers are sliced out of the decode's whole-model groups.
    run(compressed(), 1, 1, 1);
    run(compressed(), 2, 2, 1);
    run(compressed(), 1, 3, 2);
}

#[test]
fn hisparse_decodes_take_c4_kv_in_host_pages() {
    for (tp, pp) in [(1, 1), (2, 2)] {
        let shape = Shape {
            hisparse: true,
            ..Shape::new(tp, pp, 1)
        };
        check(Cluster::shaped(compressed(), shape, 64));
    }
}

#[test]
fn a_decode_pulling_cp_rank_0_alone_from_sharing_ranks_fails_loudly() {
    // The prefill's CP ranks share each room but the decode was not told:
    // rank 0's share alone would pass for the room. The decode sees the
    // prefill's mode in its bootstrap entry and fails the room, naming the
    // setting, instead of taking part of the KV.
    let shape = Shape {
        prefill_cp: 2,
        all_cp_ranks: true,
        ..Shape::new(1, 1, 1)
    };
    let cluster = Cluster::shaped(tiny_model(false, 2), shape, 16);
    let addr = cluster.bootstrap.local_addr().to_string();
    let (decode, _) = &cluster.decode[0];
    let mut rx = decode.receiver(&addr, 5);
    assert_eq!(rx.init(0), KvPoll::Failed);
    let why = rx.failure_exception().reason;
    assert!(
        why.contains("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"),
        "{why}"
    );
    cluster.shutdown();
}
