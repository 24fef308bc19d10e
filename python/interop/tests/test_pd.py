"""sglang 0.5.23's released Mooncake connector, prefill and decode in
separate processes, on each engine column: Mooncake's TCP engine, kvbridge's
(through the engine hook; skipped until `import kvbridge` works) and the
pure-Python stand-in speaking kvbridge's TCP wire (kvtcp_engine.py).

Each case checks, on the decode, every byte of every request's pages and aux
rows against kvbridge's pattern, that no other page was written, and on both
sides which rooms succeeded and which failed. ``KVB_INTEROP_FULL=1`` adds the
slower cases (TP2->2, MLA 2->1, PP2xTP2 MLA, killed prefill).
"""

import os

import pytest

import cluster
import harness
from conftest import STANDIN, engine_param

#: name -> Spec fields. The CI subset.
CASES = {
    "tp1-tp1": {},
    "tp2-tp1": {"prefill_tp": 2},
    "tp1-tp2": {"decode_tp": 2},
    "mla-tp1-tp2": {"model": harness.ModelSpec.tiny_mla(), "decode_tp": 2},
    "pp2-tp1": {"prefill_pp": 2},
    "abort": {"scenario": "abort"},
    "kill-decode": {"scenario": "kill-decode"},
}
FULL_CASES = {
    "tp2-tp2": {"prefill_tp": 2, "decode_tp": 2},
    "mla-tp2-tp1": {"model": harness.ModelSpec.tiny_mla(), "prefill_tp": 2},
    "mla-pp2xtp2-tp1": {"model": harness.ModelSpec.tiny_mla(), "prefill_pp": 2, "prefill_tp": 2},
    "kill-prefill": {"scenario": "kill-prefill"},
    "pp2-pp2": {"prefill_pp": 2, "decode_pp": 2},
}
FULL = bool(os.environ.get("KVB_INTEROP_FULL"))
if FULL:
    CASES.update(FULL_CASES)


def expected_bytes(spec: cluster.Spec, rooms) -> int:
    """Bytes one decode rank must verify for ``rooms``: every page of every
    KV buffer of its PP stage (layers split evenly) plus the aux rows."""
    model = spec.model
    assert model.layers % spec.decode_pp == 0
    buffers = model.layers // spec.decode_pp * (1 if model.mla else 2)
    tokens = {r.room: r.tokens for r in spec.workload.plan()}
    pages = sum(harness.pages_for(tokens[r], model.page_size) for r in rooms)
    return pages * buffers * model.item_len(spec.decode_tp) + len(rooms) * sum(model.aux_item_lens)


#: (engine column, case) pairs: every case on Mooncake's engine and on
#: kvbridge's; the stand-in (already exercised against the kvbridge ranks in
#: test_rust_roles.py) runs the plain and the per-token head-slicing paths.
MATRIX = [engine_param(e, c) for e in ("mooncake", "kvbridge") for c in CASES]
MATRIX += [engine_param("kvtcp", c) for c in CASES if c in ("tp1-tp1", "tp1-tp2", "abort") and STANDIN or FULL]


@pytest.mark.parametrize("engine,case", MATRIX)
def test_pd(engine, case):
    spec = cluster.Spec(engine_module=engine, timeout=45, **CASES[case])
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
    if spec.scenario == "kill-prefill":
        for r in decodes:
            assert sorted(r["failed"]) == sorted(str(x) for x in rooms), detail
            assert all("WaitingForInput" in why for why in r["failed"].values()), detail
        return
    want = [x for x in rooms if not (spec.scenario == "abort" and x == first)]
    for r in decodes:
        assert r["done"] == sorted(want), detail
        assert r["bad"] == [] and r["untouched_ok"], detail
        assert r["verified_bytes"] == expected_bytes(spec, want), detail
    for r in prefills:
        assert r["done"] == sorted(want), detail
    if spec.scenario == "abort":
        for r in decodes + prefills:
            assert list(r["failed"]) == [str(first)], detail
