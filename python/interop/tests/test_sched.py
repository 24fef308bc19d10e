"""kvbridge under sglang 0.5.23's own scheduler code (``sched_world.py``):
``Scheduler.init_disaggregation`` builds the queues and ``KVArgs`` exactly
as sglang does, real pools, allocator, radix cache, ``Req`` objects,
``PrefillAdder``, ``ScheduleBatch.prepare_for_extend``,
``process_batch_result_disagg_prefill``,
``process_disagg_prefill_inflight_queue``, ``process_decode_queue`` and
``abort_request`` run for real, and the TP ranks of each role all-reduce
their polls over a real gloo group.

Pairings: kvbridge's backend on both sides, and mixed with sglang's own
Mooncake connector (on kvbridge's engine) both ways. The decode checks
every KV byte of every room against the pattern the prefill's "forward"
wrote (per token and global head, so TP slicing is checked) and the first
token carried in sglang's metadata buffers; the prefill checks that every
KV page and metadata slot came back to its pools.

Needs real torch (requirements-sched.txt; ``sched_ci.sh``); skipped
without it unless ``KVB_REQUIRE_TORCH=1`` (CI), which fails instead.
"""

import importlib.util
import os

import pytest

from conftest import ENGINES, ON_DEVICE

TORCH_MISSING = importlib.util.find_spec("torch") is None
if TORCH_MISSING and os.environ.get("KVB_REQUIRE_TORCH"):
    raise RuntimeError("KVB_REQUIRE_TORCH=1 but torch is not installed (python/interop/sched_ci.sh installs it)")
pytestmark = [
    pytest.mark.skipif(TORCH_MISSING, reason="needs real torch (pip install -r requirements-sched.txt)"),
    pytest.mark.skipif(ENGINES["kvbridge"][1] is not None, reason=ENGINES["kvbridge"][1] or ""),
]

import sched_cluster  # noqa: E402
import sched_hybrid  # noqa: E402
import sched_world  # noqa: E402

KB, MC = "kvbridge", "mooncake"

#: Pairing -> (prefill backend, decode backend, bootstrap server backend):
#: the bootstrap server is the prefill side's, as in a deployment.
PAIRINGS = {
    "kvbridge-both": (KB, KB, KB),
    "kvbridge-to-sglang": (KB, MC, KB),
    "sglang-to-kvbridge": (MC, KB, MC),
}

#: (pairing, case) -> Spec fields. Every layout and TP pairing with a
#: kvbridge decode runs KVArgs as sglang's decode builds them (no
#: kv_head_num before the manager exists).
CASES = {
    ("kvbridge-both", "mha-tp1-tp1"): {},
    ("kvbridge-both", "gqa-tp2-tp1"): {"layout": "gqa", "prefill_tp": 2},
    ("kvbridge-both", "mla-tp1-tp2"): {"layout": "mla", "decode_tp": 2},
    ("sglang-to-kvbridge", "mha-tp1-tp1"): {},
    ("sglang-to-kvbridge", "mha-tp1-tp2"): {"decode_tp": 2},
    ("sglang-to-kvbridge", "gqa-tp2-tp1"): {"layout": "gqa", "prefill_tp": 2},
    ("sglang-to-kvbridge", "mla-tp2-tp1"): {"layout": "mla", "prefill_tp": 2},
    ("kvbridge-to-sglang", "mha-tp2-tp1"): {"prefill_tp": 2},
    ("kvbridge-to-sglang", "gqa-tp1-tp2"): {"layout": "gqa", "decode_tp": 2},
    ("kvbridge-to-sglang", "mla-tp1-tp2"): {"layout": "mla", "decode_tp": 2},
    # The router aborts the request on the decode after its metadata
    # (Scheduler.abort_request on the transfer queue).
    ("kvbridge-both", "abort-decode"): {"scenario": "abort-decode"},
    ("sglang-to-kvbridge", "abort-decode"): {"scenario": "abort-decode"},
    ("kvbridge-to-sglang", "abort-decode"): {"scenario": "abort-decode"},
    # The router aborts the request on the prefill before it ran: a
    # kvbridge prefill tells the room's decode, which concludes it at once
    # (not after its 300 s waiting timeout).
    ("kvbridge-both", "abort-prefill"): {"scenario": "abort-prefill"},
    ("kvbridge-to-sglang", "abort-prefill"): {"scenario": "abort-prefill"},
    # The decode dies with every room's metadata sent: the prefill fails
    # every room with a reason and gets every page back.
    ("kvbridge-both", "kill-decode"): {"scenario": "kill-decode"},
    ("sglang-to-kvbridge", "kill-decode"): {"scenario": "kill-decode"},
}

#: Hybrid pools (sched_hybrid: sglang's configurator and build_kv_cache).
#: Mamba (Qwen3-Next-shaped; 4 layers: two gated-delta-net, two full
#: attention): KVArgs carry state_types [MAMBA] with the conv q/k/v shard
#: groups, and the decode checks every conv and temporal byte of each
#: room's mamba slot (per global row, so TP slicing shows). SWA
#: (gpt-oss-shaped): state_types [SWA]; the decode checks full-attention KV
#: and the sliding layers' KV over the window the prefill sends.
MAMBA4 = {"layout": "mamba", "layers": 4}
HYBRID_CASES = {
    ("kvbridge-both", "mamba-tp1-tp1"): MAMBA4,
    ("kvbridge-both", "mamba-tp2-tp1"): dict(MAMBA4, prefill_tp=2),
    ("sglang-to-kvbridge", "mamba-tp1-tp1"): MAMBA4,
    ("sglang-to-kvbridge", "mamba-tp2-tp1"): dict(MAMBA4, prefill_tp=2),
    ("kvbridge-to-sglang", "mamba-tp1-tp1"): MAMBA4,
    ("kvbridge-to-sglang", "mamba-tp1-tp2"): dict(MAMBA4, decode_tp=2),
    ("kvbridge-both", "swa-tp1-tp1"): {"layout": "swa"},
    ("sglang-to-kvbridge", "swa-tp1-tp1"): {"layout": "swa"},
    ("sglang-to-kvbridge", "swa-tp2-tp1"): {"layout": "swa", "prefill_tp": 2},
    ("kvbridge-to-sglang", "swa-tp1-tp1"): {"layout": "swa"},
    ("kvbridge-both", "swa-tp1-tp2"): {"layout": "swa", "decode_tp": 2},
    ("kvbridge-to-sglang", "swa-tp2-tp1"): {"layout": "swa", "prefill_tp": 2},
    ("kvbridge-both", "swa-tp2-tp1"): {"layout": "swa", "prefill_tp": 2},
    ("kvbridge-to-sglang", "swa-tp1-tp2"): {"layout": "swa", "decode_tp": 2},
    ("sglang-to-kvbridge", "swa-tp1-tp2"): {"layout": "swa", "decode_tp": 2},
}

#: DeepSeek-V4 compressed MLA (sched_dsv4: sglang's DSV4PoolConfigurator
#: sizing, DeepSeekV4TokenToKVPool, SWATokenToKVPoolAllocator; 4 layers
#: with compression ratios 0, 4, 128, 4; 256-token pages): KVArgs carry
#: mla_compression_ratios and the kv_layout tag "v4,c4:v4,c128:v4", KV
#: [C4 KV, C4 indexer, C128 KV], state SWA [SWA KV, C4 compressor and
#: indexer states] and c128_state. The decode checks every byte of every
#: item sglang sent: all KV pages, the SWA pages of the window (two pages
#: or, past 384 tokens, the last one), the C128 state page (none at 384
#: tokens, a multiple of 128). MLA: replicated across TP on both sides.
DSV4 = {"layout": "dsv4", "layers": 4, "tokens": 371}
DSV4_KV_ARGS = {"kv_layout": "v4,c4:v4,c128:v4", "mla_compression_ratios": [0, 4, 128, 4],
                "state_types": ["swa", "c128_state"]}
DSV4_CASES = {
    (pairing, f"dsv4-tp{p}-tp{d}"): dict(DSV4, prefill_tp=p, decode_tp=d)
    for pairing in ("kvbridge-both", "sglang-to-kvbridge", "kvbridge-to-sglang") for p, d in ((1, 1), (2, 1), (1, 2))
}

#: Prefill parallelism beyond TP (sched_parallel): PP through sglang's own
#: event_loop_pp_disagg_prefill (bootstrap polls relayed by pp_sync_polls,
#: the release consensus around the ring); attention DP (the decode finds
#: the room's prefill DP rank through its DecodePreallocQueue: room % dp,
#: or query_prefill_dp_ranks after the sender's /register_dp_rank with
#: round_robin); attention CP (polls all-reduced over the real CP group;
#: rank 0 sends, or every rank with ALL_CP_RANKS_TRANSFER).
DP2 = {"prefill_tp": 2, "prefill_attn_dp": 2}
CP2 = {"prefill_tp": 2, "prefill_attn_cp": 2}
RR = {"load_balance_method": "round_robin"}
PARALLEL_CASES = {
    ("kvbridge-both", "pp2-tp1"): {"prefill_pp": 2},
    ("kvbridge-both", "pp2-abort-decode"): {"prefill_pp": 2, "scenario": "abort-decode"},
    ("sglang-to-kvbridge", "pp2-tp1"): {"prefill_pp": 2},
    ("kvbridge-to-sglang", "pp2-tp1"): {"prefill_pp": 2},
    ("kvbridge-both", "attn-dp2"): DP2,
    ("kvbridge-both", "attn-dp2-sglang-bootstrap"): dict(DP2, bootstrap_backend=MC),
    ("kvbridge-both", "attn-dp2-round-robin-sglang-bootstrap"): dict(DP2, bootstrap_backend=MC, **RR),
    ("sglang-to-kvbridge", "attn-dp2-round-robin"): dict(DP2, **RR),
    ("kvbridge-to-sglang", "attn-dp2-sglang-bootstrap"): dict(DP2, bootstrap_backend=MC),
    ("kvbridge-both", "attn-cp2"): CP2,
    ("kvbridge-both", "attn-cp2-all-ranks"): dict(CP2, env={"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}),
    ("sglang-to-kvbridge", "attn-cp2"): CP2,
    ("kvbridge-to-sglang", "attn-cp2"): CP2,
}

#: Staging (SGLANG_DISAGG_STAGING_BUFFER=1, heterogeneous TP): sglang's own
#: DecodeStagingHandler asserts the KV pool is on an indexed CUDA device, so
#: these run only with device KV (the GPU machine, KVB_INTEROP_BUFFERS=cuda:0).
#: A kvbridge decode gets its head counts from sglang only after its manager
#: exists (set_kv_buffer_tensors), as here.
STAGING = {"SGLANG_DISAGG_STAGING_BUFFER": "1"}
DEVICE_CASES = {
    ("kvbridge-both", "staging-tp1-tp2"): {"decode_tp": 2, "env": STAGING},
    ("kvbridge-both", "staging-gqa-tp2-tp1"): {"layout": "gqa", "prefill_tp": 2, "env": STAGING},
    ("sglang-to-kvbridge", "staging-tp1-tp2"): {"decode_tp": 2, "env": STAGING},
    ("kvbridge-to-sglang", "staging-tp2-tp1"): {"prefill_tp": 2, "env": STAGING},
}
NEEDS_CUDA = "sglang's staging handler needs CUDA KV buffers (KVB_INTEROP_BUFFERS=cuda:0, the GPU machine)"


def expected_bytes(spec: sched_cluster.Spec, rooms, rank: int) -> int:
    """KV bytes decode rank ``rank`` must hold for ``rooms``."""
    model = sched_world.MODELS[spec.layout]
    tokens = {room: n for room, n in sched_worker_rooms(spec)}
    if sched_hybrid.kind(spec.layout):
        return sum(sched_hybrid.expected_bytes(spec.layout, spec.layers, spec.decode_tp, rank, tokens[r])
                   for r in rooms)
    if spec.layout == "mla":
        per_token = (model["kv_lora_rank"] + model["qk_rope_head_dim"]) * 2
    else:
        heads = len(sched_world.local_kv_heads(model["num_key_value_heads"], spec.decode_tp, rank))
        per_token = 2 * heads * model["head_dim"] * 2
    return sum(tokens[r] for r in rooms) * spec.layers * per_token


def sched_worker_rooms(spec):
    import sched_worker

    args = type("A", (), {"rooms": spec.rooms, "tokens": spec.tokens,
                          "shape": sched_world.Shape(**sched_world.layout_shape(spec.layout))})()
    return sched_worker.rooms(args)


def _params():
    out = [pytest.param(p, c, CASES[(p, c)], id=f"{p}-{c}") for p, c in CASES]
    marks = [] if ON_DEVICE else [pytest.mark.skip(reason=NEEDS_CUDA)]
    out += [pytest.param(p, c, DEVICE_CASES[(p, c)], id=f"{p}-{c}", marks=marks) for p, c in DEVICE_CASES]
    out += [pytest.param(p, c, HYBRID_CASES[(p, c)], id=f"{p}-{c}") for p, c in HYBRID_CASES]
    out += [pytest.param(p, c, f, id=f"{p}-{c}") for (p, c), f in PARALLEL_CASES.items()]
    out += [pytest.param(p, c, DSV4_CASES[(p, c)], id=f"{p}-{c}") for p, c in DSV4_CASES]
    return out


def _cuda_ipc() -> bool:
    """kvbridge's engine moves KV by CUDA IPC here (MOONCAKE_PROTOCOL nvlink
    without a true MC_FORCE_TCP), where the decode role keeps no staging ring."""
    force_tcp = os.environ.get("MC_FORCE_TCP", "").strip().lower() in ("1", "true", "yes", "on")
    return not force_tcp and os.environ.get("MOONCAKE_PROTOCOL", "").lower() in ("nvlink", "nvlink_intra", "ipc")


@pytest.mark.parametrize("pairing,case,fields", _params())
def test_real_scheduler(pairing, case, fields):
    prefill, decode, boot = PAIRINGS[pairing]
    spec = sched_cluster.Spec(**{"prefill_backend": prefill, "decode_backend": decode, "bootstrap_backend": boot,
                                 **fields})
    out = sched_cluster.run(spec)
    assert out.ok, out.report() + "\n" + "\n".join(f"== {n}\n{o[-3000:]}" for n, o in out.outputs.items())
    all_rooms = {room for room, _ in sched_worker_rooms(spec)}
    first = min(all_rooms)
    for name, r in out.results.items():
        want = {prefill if name.startswith("prefill") else decode}
        assert {"kvbridge" if "kvbridge" in r.get("manager", "kvbridge") else "mooncake"} == want or \
            spec.scenario == "kill-decode"
        if spec.layout == "dsv4":
            # What sglang's _init_kv_manager put in KVArgs, on either backend.
            assert r["kv_args"] == DSV4_KV_ARGS, r
        if name.startswith("prefill"):
            # Every page and metadata slot came back (no room leaked them).
            assert r["leaks"]["free_kv_tokens"] == r["leaks"]["pool_tokens"], r
            # Hybrid pools: every SWA token and mamba slot too.
            assert r["leaks"].get("swa_free_tokens") == r["leaks"].get("swa_pool_tokens"), r
            assert r["leaks"].get("mamba_free_slots") == r["leaks"].get("mamba_slots"), r
        if name.startswith("decode") and spec.scenario != "kill-decode":
            rank = int(name.split("tp")[1])
            assert r["mismatched"] == 0
            assert r["verified_bytes"] == expected_bytes(spec, r["arrived"], rank) > 0
            if spec.env.get("SGLANG_DISAGG_STAGING_BUFFER") and decode == KB:
                if _cuda_ipc():
                    # CUDA IPC copies head slices device to device: no ring.
                    assert r["staged_bytes"] == 0, r
                else:
                    assert r["staged_bytes"] > 0, r  # the staging path, not per-slice writes
    if spec.prefill_attn_dp > 1:
        # Each room ran on the one prefill DP group the controller picked.
        done = [set(r["succeeded"]) | set(map(int, r["failed"])) for n, r in out.results.items()
                if n.startswith("prefill")]
        assert sum(map(len, done)) == len(all_rooms) and set().union(*done) == all_rooms, out.report()
    if spec.scenario == "kill-decode":
        for name, r in out.results.items():
            if name.startswith("prefill"):
                assert set(map(int, r["failed"])) == all_rooms and all(r["failed"].values())
    if spec.scenario == "abort-prefill":
        for name, r in out.results.items():
            if name.startswith("decode"):
                # Told by the prefill, long before any timeout.
                assert r["failed_after_s"][str(first)] < 10, r
