"""kvbridge as sglang's transfer backend (``KVBRIDGE_SGLANG=backend``:
``kvbridge.sglang_backend`` over kvbridge's Rust roles), driven by
``pd_worker.py`` as sglang's prefill and decode scheduler mixins drive the
backend classes (README.md, "The backend driver"): on both sides, and mixed
with sglang's own Mooncake connector (on kvbridge's engine) both ways.

Every data case verifies every byte on the decode (KV pages per token and
head slice, aux rows, untouched pages) and which rooms succeeded or failed
on every rank; kvbridge prefills also report each room's transfer metric
(``get_transfer_metric()``), checked against the bytes the room needs.
"""

import os

import pytest

import cluster
import harness
from conftest import ENGINES
from test_pd import expected_bytes

pytestmark = pytest.mark.skipif(ENGINES["kvbridge"][1] is not None, reason=ENGINES["kvbridge"][1] or "")

KB, MC = cluster.KVBRIDGE, "mooncake"

#: Pairing -> (prefill backend, decode backend, bootstrap server backend).
#: The bootstrap server is the prefill side's, as in a deployment.
PAIRINGS = {
    "kvbridge-both": (KB, KB, KB),
    "kvbridge-to-mooncake": (KB, MC, KB),
    "mooncake-to-kvbridge": (MC, KB, MC),
}
CASES = {
    "tp1-tp1": {},
    "tp2-tp1": {"prefill_tp": 2},
    "tp1-tp2": {"decode_tp": 2},
    "mla-tp1-tp2": {"model": harness.ModelSpec.tiny_mla(), "decode_tp": 2},
    "abort": {"scenario": "abort"},
    "abort-prefill": {"scenario": "abort-prefill"},
    "abort-bootstrap": {"scenario": "abort-bootstrap"},
    "kill-decode": {"scenario": "kill-decode"},
}
#: Pipeline parallelism: PP0's driver polls poll_pp_consensus (the lowest
#: state over the stages), as sglang's PP0 scheduler does.
PP_CASES = {
    "pp2-tp1": {"prefill_pp": 2},
    "pp2-pp2": {"prefill_pp": 2, "decode_pp": 2},
    "pp3-tp2": {"prefill_pp": 3, "decode_tp": 2, "layer_ids": True},  # uneven split: layer ids
    "pp2-abort-last-stage": {"prefill_pp": 2, "scenario": "abort-last-stage"},
}
#: PP cases only kvbridge-both runs unless KVB_INTEROP_FULL=1.
PP_BOTH_ONLY = {"pp3-tp2", "pp2-abort-last-stage"}
if os.environ.get("KVB_INTEROP_FULL"):
    CASES.update({
        "tp2-tp2": {"prefill_tp": 2, "decode_tp": 2},
        "mla-tp2-tp1": {"model": harness.ModelSpec.tiny_mla(), "prefill_tp": 2},
    })

#: Cases the mixed pairings skip unless KVB_INTEROP_FULL=1 (kvbridge-both
#: runs them; they exercise kvbridge's own state machine, not the pairing),
#: keeping CI's suite short.
MIXED_FULL_ONLY = {"tp1-tp1", "abort-prefill", "abort-bootstrap"}
FULL = bool(os.environ.get("KVB_INTEROP_FULL"))
MATRIX = [pytest.param(p, c, id=f"{p}-{c}") for p in PAIRINGS for c in CASES
          if FULL or p == "kvbridge-both" or c not in MIXED_FULL_ONLY]
MATRIX += [pytest.param(p, c, id=f"{p}-{c}") for p in PAIRINGS for c in PP_CASES
           if FULL or c not in PP_BOTH_ONLY or p == "kvbridge-both"]


def spec_for(pairing: str, case: str) -> cluster.Spec:
    prefill, decode, bootstrap = PAIRINGS[pairing]
    fields = dict(CASES[case] if case in CASES else PP_CASES[case])
    return cluster.Spec(engine_module="kvbridge", prefill_backend=prefill, decode_backend=decode,
                        bootstrap_backend=bootstrap, timeout=45, **fields)


def room_bytes(spec: cluster.Spec, room: int) -> int:
    """KV bytes a TP-1 prefill (all its pipeline stages together) writes for
    ``room`` (no aux): every page of every buffer, once per decode rank
    holding a replica (MLA)."""
    model = spec.model
    tokens = {r.room: r.tokens for r in spec.workload.plan()}[room]
    buffers = model.layers * (1 if model.mla else 2)
    replicas = spec.decode_tp if model.mla else 1
    return harness.pages_for(tokens, model.page_size) * buffers * model.item_len(1) * replicas


@pytest.mark.parametrize("pairing,case", MATRIX)
def test_backend(pairing, case):
    spec = spec_for(pairing, case)
    out = cluster.run(spec)
    detail = out.report() + "\n" + out.outputs()
    assert out.ok, detail
    rooms = [r.room for r in spec.workload.plan()]
    first = rooms[0]
    decodes = [p.result for p in out.procs.values() if p.kind == "decode"]
    prefills = [p.result for p in out.procs.values() if p.kind == "prefill"]
    if spec.scenario == "kill-decode":
        for r in prefills:
            assert sorted(r["failed"]) == sorted(str(x) for x in rooms), detail
            assert all(r["failed"].values()), detail  # every failure carries a reason
        return
    aborted = spec.scenario.startswith("abort")
    want = [x for x in rooms if not (aborted and x == first)]
    for r in decodes:
        assert r["done"] == sorted(want), detail
        assert r["bad"] == [] and r["untouched_ok"], detail
        assert r["verified_bytes"] == expected_bytes(spec, want), detail
        if aborted:
            assert list(r["failed"]) == [str(first)], detail
            # The pages of an abort the prefill was told about are reused only
            # once every prefill rank acknowledged it (deferred KV release).
            if spec.scenario != "abort-bootstrap":
                assert r["drained"] == {str(first): True}, detail
    for r in prefills:
        assert r["done"] == sorted(want), detail
        if aborted:
            assert list(r["failed"]) == [str(first)], detail
    if spec.scenario == "abort-last-stage" and spec.prefill_backend == KB:
        # PP0 learnt it from the last stage: through its consensus poll, or
        # from the decode's ABORT, which the last stage's Failed status to the
        # decode sets off and which may reach PP0 first (a race either wins).
        pp0 = [p.result for p in out.procs.values() if p.kind == "prefill" and p.result["role"].endswith("-pp0")]
        how = ("another pipeline stage", "Aborted by the decode side")
        assert pp0 and all(any(h in r["failed"][str(first)] for h in how) for r in pp0), detail
    if spec.prefill_backend == KB and spec.prefill_tp == 1:
        # Each pipeline stage writes its own layers: together, the room.
        for room in want:
            stages = [r["metrics"][str(room)] for r in prefills]
            assert sum(total for _, total in stages) == room_bytes(spec, room), detail
            assert all(latency is not None and latency > 0 for latency, _ in stages), detail


@pytest.mark.parametrize("case", ["tp2-tp1", "tp1-tp2"])
def test_backend_staging(monkeypatch, case):
    """sglang's staging knobs on the kvbridge backend: with
    ``SGLANG_DISAGG_STAGING_BUFFER=1`` the roles gather, bulk-write and
    scatter through a 1 MiB decode ring (``SGLANG_DISAGG_STAGING_POOL_SIZE_MB``),
    every byte still exact."""
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "1")
    spec = spec_for("kvbridge-both", case)
    out = cluster.run(spec)
    detail = out.report() + "\n" + out.outputs()
    assert out.ok, detail
    rooms = sorted(r.room for r in spec.workload.plan())
    decodes = [p.result for p in out.procs.values() if p.kind == "decode"]
    for r in decodes:
        assert r["done"] == rooms and r["bad"] == [] and r["untouched_ok"], detail
        assert r["verified_bytes"] == expected_bytes(spec, rooms), detail
        assert r["staged_bytes"] > 0, detail


DP_MATRIX = [pytest.param(p, m, id=f"{p}-dp2-{m}") for p in PAIRINGS
             for m in ("follow_bootstrap_room", "round_robin")
             if FULL or p == "kvbridge-both" or m == "round_robin"]


@pytest.mark.parametrize("pairing,method", DP_MATRIX)
def test_backend_dp(pairing, method):
    """Two prefill attention-DP groups on one bootstrap server. With
    ``follow_bootstrap_room`` each room goes to DP rank ``room % 2``, which
    the decode computes; with another method (round robin here) each
    prefill registers its rooms' DP rank (``/register_dp_rank``) and the
    decode asks for it (``query_prefill_dp_ranks`` on the manager's
    executor), as sglang's decode scheduler does."""
    prefill, decode, bootstrap = PAIRINGS[pairing]
    spec = cluster.Spec(engine_module="kvbridge", prefill_backend=prefill, decode_backend=decode,
                        bootstrap_backend=bootstrap, timeout=45, prefill_dp=2, load_balance_method=method,
                        workload=harness.Workload(requests=8))
    out = cluster.run(spec)
    detail = out.report() + "\n" + out.outputs()
    assert out.ok, detail
    plan = spec.workload.plan()
    rooms = sorted(r.room for r in plan)
    groups = {g: sorted(r.room for r in plan
                        if (r.room if method == "follow_bootstrap_room" else r.index) % 2 == g) for g in (0, 1)}
    assert groups[0] and groups[1], "both DP groups get rooms"
    for p in out.procs.values():
        if p.kind == "decode":
            assert p.result["done"] == rooms and p.result["bad"] == [], detail
            assert p.result["verified_bytes"] == expected_bytes(spec, rooms), detail
        elif p.kind == "prefill":
            assert p.result["done"] == groups[int(p.name[-1])], detail


CP_MATRIX = [pytest.param(p, a, id=f"{p}-cp2-{'all-ranks' if a else 'rank0'}") for p in PAIRINGS
             for a in (False, True) if FULL or p == "kvbridge-both" or a]


@pytest.mark.parametrize("pairing,all_ranks", CP_MATRIX)
def test_backend_cp(pairing, all_ranks):
    """Prefill attention context parallelism, 2 CP ranks each holding the
    whole KV: CP rank 0 sends and rank 1 is a dummy the decode never asks
    (``is_dummy_cp_rank``), or with ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``
    (set for every process, as both sides must agree) each sends its share of
    the pages; every byte checked on the decode."""
    prefill, decode, bootstrap = PAIRINGS[pairing]
    env = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"} if all_ranks else {}
    spec = cluster.Spec(engine_module="kvbridge", prefill_backend=prefill, decode_backend=decode,
                        bootstrap_backend=bootstrap, timeout=45, prefill_cp=2, env=env,
                        workload=harness.Workload(requests=6))
    out = cluster.run(spec)
    detail = out.report() + "\n" + out.outputs()
    assert out.ok, detail
    rooms = sorted(r.room for r in spec.workload.plan())
    for p in out.procs.values():
        if p.kind in ("decode", "prefill"):
            assert p.result["done"] == rooms, detail
        if p.kind == "decode":
            assert p.result["bad"] == [] and p.result["untouched_ok"], detail
            assert p.result["verified_bytes"] == expected_bytes(spec, rooms), detail


def test_malformed_setting_is_refused(monkeypatch):
    """A malformed sglang setting fails start-up (sglang itself would fall
    back to the default with a warning)."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "soon")
    spec = cluster.Spec(engine_module="kvbridge", prefill_backend=KB, decode_backend=KB, bootstrap_backend=KB,
                        timeout=10)
    out = cluster.run(spec)
    assert not out.ok
    for p in out.procs.values():
        if p.kind in ("prefill", "decode"):
            assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT='soon' is malformed" in p.output, p.output


def test_refused_feature_names_itself(monkeypatch):
    """A Mooncake-only setting in force fails start-up with its name."""
    monkeypatch.setenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "NVLINK")
    spec = cluster.Spec(engine_module="kvbridge", prefill_backend=KB, decode_backend=KB, bootstrap_backend=KB,
                        timeout=10)
    out = cluster.run(spec)
    assert not out.ok
    for p in out.procs.values():
        if p.kind in ("prefill", "decode"):
            assert "SGLANG_MOONCAKE_CUSTOM_MEM_POOL='NVLINK'" in p.output, p.output
