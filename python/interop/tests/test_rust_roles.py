"""sglang's released connector against kvbridge's Rust roles
(``kvbridge prefill`` / ``kvbridge decode`` / ``kvbridge bootstrap``), with
bytes verified on the receiving side: the kvbridge decode checks every byte
against its own pattern (its ``done`` events: ``verified``, ``mismatched``),
the sglang decode against the harness's port of it.

The data plane must be the same engine at both ends: the sglang ranks use
``kvbridge.TransferEngine`` through the engine hook (skipped until
``import kvbridge`` works) or ``kvtcp_engine`` (a pure-Python speaker of
kvbridge's TCP wire). Open mode: sglang has no cluster secret. Needs the
kvbridge binary (``$KVBRIDGE_BIN``, default ``target/debug/kvbridge``).
"""

import os

import pytest

import cluster
import harness
from conftest import STANDIN, engine_param, kvbridge_bin_missing
from test_pd import expected_bytes

pytestmark = pytest.mark.skipif(kvbridge_bin_missing() is not None, reason=kvbridge_bin_missing() or "")

#: Direction -> (prefill, decode, bootstrap). The bootstrap server is the
#: prefill side's, as in a deployment.
DIRECTIONS = {
    "sglang-to-kvbridge": (cluster.SGLANG, cluster.KVBRIDGE, cluster.SGLANG),
    "kvbridge-to-sglang": (cluster.KVBRIDGE, cluster.SGLANG, cluster.KVBRIDGE),
}
CASES = {
    "tp1-tp1": {},
    "tp2-tp1": {"prefill_tp": 2},
    "tp1-tp2": {"decode_tp": 2},
    "mla-tp1-tp2": {"model": harness.ModelSpec.tiny_mla(), "decode_tp": 2},
    "pp2-tp2": {"prefill_pp": 2, "decode_tp": 2},
}
if os.environ.get("KVB_INTEROP_FULL"):
    CASES.update({
        "tp2-tp2": {"prefill_tp": 2, "decode_tp": 2},
        "mla-tp2-tp1": {"model": harness.ModelSpec.tiny_mla(), "prefill_tp": 2},
        "pp2-tp1": {"prefill_pp": 2},
        "gqa-tp4-tp2": {"model": harness.ModelSpec(kv_heads=8), "prefill_tp": 4, "decode_tp": 2},
    })

SGLANG_SIDE = [engine_param("kvbridge")] + (
    [engine_param("kvtcp")] if STANDIN or os.environ.get("KVB_INTEROP_FULL") else [])


def check(spec: cluster.Spec, out: cluster.Outcome) -> None:
    """Every rank concluded every room successfully; each decode rank
    verified every byte of every room, none mismatched."""
    detail = out.report() + "\n" + out.outputs()
    assert out.ok, detail
    rooms = sorted(r.room for r in spec.workload.plan())
    want = expected_bytes(spec, rooms)
    for p in out.procs.values():
        if p.kind == "bootstrap":
            continue
        assert p.result["done"] == rooms and not p.result["failed"], detail
        if p.kind == "decode":
            assert p.result["verified_bytes"] == want, detail
            assert p.result.get("mismatched", 0) == 0 and p.result.get("bad", []) == [], detail


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("engine", SGLANG_SIDE)
def test_sglang_and_kvbridge_roles(engine, direction, case):
    prefill, decode, bootstrap = DIRECTIONS[direction]
    spec = cluster.Spec(engine_module=engine, prefill=prefill, decode=decode, bootstrap=bootstrap,
                        timeout=45, **CASES[case])
    check(spec, cluster.run(spec))


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("engine", SGLANG_SIDE)
def test_other_sides_bootstrap_server(engine, direction):
    """The prefill registers with the other implementation's bootstrap server
    (sglang prefill ranks with ``kvbridge bootstrap``, kvbridge prefill ranks
    with sglang's), TP2 -> TP1."""
    prefill, decode, bootstrap = DIRECTIONS[direction]
    other = cluster.KVBRIDGE if bootstrap == cluster.SGLANG else cluster.SGLANG
    spec = cluster.Spec(engine_module=engine, prefill=prefill, decode=decode, bootstrap=other,
                        prefill_tp=2, timeout=45)
    check(spec, cluster.run(spec))


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("engine", SGLANG_SIDE)
def test_decode_killed_mid_transfer(engine, direction):
    """The decode dies (SIGKILL, or ``os._exit`` for an sglang decode) after
    sending every room's destination, before the prefill's forward pass
    ends: the prefill, sglang's or kvbridge's, fails every room with a
    reason and exits; nothing hangs."""
    prefill, decode, bootstrap = DIRECTIONS[direction]
    spec = cluster.Spec(engine_module=engine, prefill=prefill, decode=decode, bootstrap=bootstrap,
                        scenario="kill-decode", timeout=45)
    out = cluster.run(spec)
    detail = out.report() + "\n" + out.outputs()
    assert out.ok, detail
    rooms = sorted(str(r.room) for r in spec.workload.plan())
    prefills = [p for p in out.procs.values() if p.kind == "prefill"]
    assert prefills, detail
    for p in prefills:
        assert sorted(p.result["failed"]) == rooms, detail
        assert all(p.result["failed"].values()), detail  # every failure says why
    for p in out.procs.values():
        if p.kind == "decode":  # it really died: SIGKILL, or os._exit before its RESULT line
            assert p.returncode == -9 if p.impl == cluster.KVBRIDGE else p.result is None, detail


def test_harness_runs_kvbridge_ranks():
    """The harness's kvbridge launch path on its own: kvbridge bootstrap,
    prefill PP2 and decode TP2 from the rank files it writes."""
    spec = cluster.Spec(prefill=cluster.KVBRIDGE, decode=cluster.KVBRIDGE, bootstrap=cluster.KVBRIDGE,
                        prefill_pp=2, decode_tp=2, timeout=45)
    check(spec, cluster.run(spec))


@pytest.mark.parametrize("engine", SGLANG_SIDE)
def test_kvbridge_decode_aborts_sglang_prefill(engine):
    """The kvbridge decode aborts a third of the rooms (its workload's
    choice, predicted by harness.Workload.aborts): those fail on the decode,
    the sglang prefill acknowledges the aborts (the decode concludes them
    without its 10 s quarantine), every other room arrives byte-exact."""
    workload = harness.Workload(requests=6, abort_fraction=0.34)
    aborted = workload.aborted_rooms()
    assert 0 < len(aborted) < 6
    spec = cluster.Spec(engine_module=engine, decode=cluster.KVBRIDGE, workload=workload, timeout=45)
    out = cluster.run(spec)
    detail = out.report() + "\n" + out.outputs()
    assert out.ok, detail
    decode, prefill = out.procs["decode-tp0"], out.procs["prefill-tp0"]
    kept = sorted(r.room for r in workload.plan() if r.room not in aborted)
    assert decode.result["done"] == kept and {int(r) for r in decode.result["failed"]} == aborted, detail
    assert decode.result["verified_bytes"] == expected_bytes(spec, kept), detail
    assert "quarantined" not in decode.output, detail
    assert {int(r) for r in prefill.result["failed"]} <= aborted, detail


@pytest.mark.parametrize("engine", SGLANG_SIDE)
def test_sglang_decode_aborts_kvbridge_prefill(engine):
    """The sglang decode aborts the first room: the kvbridge prefill fails
    exactly that room, every other room arrives byte-exact."""
    spec = cluster.Spec(engine_module=engine, prefill=cluster.KVBRIDGE, bootstrap=cluster.KVBRIDGE,
                        scenario="abort", timeout=45)
    out = cluster.run(spec)
    detail = out.report() + "\n" + out.outputs()
    assert out.ok, detail
    rooms = [r.room for r in spec.workload.plan()]
    decode, prefill = out.procs["decode-tp0"], out.procs["prefill-tp0"]
    assert list(prefill.result["failed"]) == [str(rooms[0])] and prefill.result["done"] == sorted(rooms[1:]), detail
    assert decode.result["done"] == sorted(rooms[1:]) and decode.result["bad"] == [], detail
    assert decode.result["verified_bytes"] == expected_bytes(spec, rooms[1:]), detail


@pytest.mark.parametrize("engine", SGLANG_SIDE)
def test_stock_sglang_decode_with_kvbridge_pp_prefill(engine):
    """A kvbridge PP2 prefill and an sglang decode that, like stock sglang
    with a plain pool, publishes no layer ids: both pair by position."""
    spec = cluster.Spec(engine_module=engine, prefill=cluster.KVBRIDGE, decode=cluster.SGLANG,
                        bootstrap=cluster.KVBRIDGE, prefill_pp=2, timeout=30)
    check(spec, cluster.run(spec))


@pytest.mark.parametrize("engine", SGLANG_SIDE)
def test_layer_ids_on_both_sides_pp(engine):
    """Every rank publishes layer ids (as sglang's hybrid pools do):
    kvbridge PP2 prefill -> sglang decode pairs buffers by layer id."""
    spec = cluster.Spec(engine_module=engine, prefill=cluster.KVBRIDGE, decode=cluster.SGLANG,
                        bootstrap=cluster.KVBRIDGE, prefill_pp=2, layer_ids=True, timeout=30)
    check(spec, cluster.run(spec))


@pytest.mark.parametrize("engine", SGLANG_SIDE)
def test_kvbridge_prefill_pp_to_sglang_decode_pp(engine):
    """Prefill PP2 -> decode PP2 (stage k to stage k): a kvbridge prefill and
    sglang decode stages."""
    spec = cluster.Spec(engine_module=engine, prefill=cluster.KVBRIDGE, bootstrap=cluster.KVBRIDGE,
                        prefill_pp=2, decode_pp=2, timeout=45)
    check(spec, cluster.run(spec))


def test_kvbridge_decode_pp():
    """Prefill PP2 -> decode PP2 with kvbridge on both sides (sglang's own
    ranks pass the same pairing: test_pd's pp2-pp2)."""
    spec = cluster.Spec(prefill=cluster.KVBRIDGE, decode=cluster.KVBRIDGE, bootstrap=cluster.KVBRIDGE,
                        prefill_pp=2, decode_pp=2, workload=harness.Workload(requests=2, room_timeout_s=3),
                        timeout=10)
    check(spec, cluster.run(spec))
