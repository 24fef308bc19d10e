"""bench_rooms.py, tiny: sglang's connector on each engine column moves a
few rooms of scattered pages, and the report says what happened. Asserts
rooms, bytes and blocks, never speed."""

import json

import numpy as np
import pytest

import bench_rooms
import harness
from conftest import ENGINES

LAYERS, ROOM_TOKENS, ROOMS, BLOCK = 2, 64, 4, 4096


def test_pages_pattern_matches_page_pattern():
    model = bench_rooms.model_for(BLOCK, LAYERS)
    assert model.page_size == 2 and model.item_len(1) == BLOCK
    rows = harness.pages_pattern(model, harness.RankSpec(), 1234, 1, 1, 5)
    assert rows.shape == (5, BLOCK)
    for k in range(5):
        assert np.array_equal(rows[k], harness.page_pattern(model, harness.RankSpec(), 1234, 1, 1, k))


def test_scattered_pages_are_single_blocks():
    for pool, counts in ((1024, [512, 512]), (4, [2, 2]), (64, [32, 32]), (10, [3, 3, 3])):
        runs = harness.scatter_pages(pool, counts, seed=5)
        assert [len(r) for r in runs] == counts
        flat = [p for r in runs for p in r]
        assert len(set(flat)) == len(flat) and all(0 <= p < pool for p in flat)
        assert all(b != a + 1 for r in runs for a, b in zip(r, r[1:]))
        assert runs == harness.scatter_pages(pool, counts, seed=5)  # both sides derive the same
    assert harness.contiguous_blocks([3, 4, 5, 9], [7, 8, 2, 3]) == 3
    assert harness.contiguous_blocks([2, 0], [1, 3]) == 2
    with pytest.raises(ValueError):
        harness.scatter_pages(4, [3, 2], seed=1)


def test_allocate_scattered_keeps_the_plan():
    requests = harness.Workload(requests=4, prompt_tokens=40).plan()
    model = harness.ModelSpec()
    pre = harness.allocate(requests, model, 64, 16, reverse=False, scatter_seed=3)
    dec = harness.allocate(requests, model, 64, 16, reverse=True, scatter_seed=3)
    for r, p, d in zip(requests, pre, dec):
        assert p.room == d.room == r.room and len(p.pages) == len(d.pages) == harness.pages_for(r.tokens, 16)
        assert harness.contiguous_blocks(p.pages, d.pages) == len(p.pages)
    assert pre[0].pages != dec[0].pages


def test_whole_request_fill_verify_clear():
    model = bench_rooms.model_for(BLOCK, LAYERS)
    pool = harness.KVPool(model, harness.RankSpec(), pages=16, aux_slots=2)
    pages = [9, 2, 14, 5]
    pool.fill_request(77, pages, 1)
    assert pool.verify(77, pages, 1) == pool.verify_request(77, pages, 1)
    assert pool.verify_request(77, pages, 1)[1] == []
    pool.kv[3][14 * BLOCK + 100] ^= 0x10
    assert pool.verify_request(77, pages, 1)[1] == [(3, 14)]
    pool.clear_request(pages, 1)
    assert pool.untouched([]) and not any(a.any() for a in pool.aux)


def _engine(name):
    _, skip = ENGINES[name]
    return pytest.param(name, id=name, marks=[pytest.mark.skip(reason=skip)] if skip else [])


@pytest.mark.parametrize("engine", [_engine("kvbridge"), _engine("mooncake")])
def test_bench_rooms_tiny(engine, tmp_path):
    out = tmp_path / "bench.json"
    rc = bench_rooms.main(["--engines", engine, "--block-sizes", str(BLOCK), "--rounds", "1",
                           "--rooms", str(ROOMS), "--rooms-per-wave", "2", "--room-tokens", str(ROOM_TOKENS),
                           "--layers", str(LAYERS), "--timeout", "60", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, doc["runs"]
    (run,) = doc["runs"]
    model = bench_rooms.model_for(BLOCK, LAYERS)
    pages = ROOM_TOKENS // model.page_size
    kv_per_room = pages * 2 * LAYERS * BLOCK
    assert run["ok"] and run["engine"] == engine and not run["failed"] and not run["bad"]
    assert run["rooms"] == run["rooms_done"] == ROOMS == len(run["latency_s"])
    assert run["kv_bytes"] == ROOMS * kv_per_room
    # Every byte of every room (KV and aux rows) checked on the decode.
    assert run["verified_bytes"] == run["expected_bytes"] == ROOMS * (kv_per_room + sum(model.aux_item_lens))
    # Scattered: every page of every buffer went as its own block of one page.
    assert run["blocks_per_room"] == [pages * 2 * LAYERS] * ROOMS and run["block_bytes_seen"] == BLOCK
    assert run["engine_module"].startswith("kvbridge" if engine == "kvbridge" else "mooncake")
    assert run["engine_calls"] == 2 * ROOMS  # one KV chunk and one aux call per room
    assert run["engine_blocks"] == ROOMS * (pages * 2 * LAYERS + len(model.aux_item_lens))
    assert len(run["wave_s"]) == ROOMS // 2
    s = doc["summary"][str(BLOCK)][engine]
    assert s["ok_runs"] == 1 and s["rooms_done"] == ROOMS and s["latency_samples"] == ROOMS
    for key in ("gbps", "rps", "p50_ms", "p99_ms", "engine_share"):
        assert s[key] > 0, key
    assert s["p99_ms"] >= s["p50_ms"]


@pytest.mark.parametrize("_", [_engine("kvbridge")])
def test_bench_rooms_backend_tiny(_, tmp_path):
    """``--backend``: sglang's connector on kvbridge's engine against
    kvbridge's backend classes, same workload; every byte arrives and the
    scheduler-thread timings are reported (never judged)."""
    out = tmp_path / "bench.json"
    rc = bench_rooms.main(["--backend", "--block-sizes", str(BLOCK), "--rounds", "1",
                           "--rooms", str(ROOMS), "--rooms-per-wave", "2", "--room-tokens", str(ROOM_TOKENS),
                           "--layers", str(LAYERS), "--timeout", "60", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, doc["runs"]
    model = bench_rooms.model_for(BLOCK, LAYERS)
    kv_per_room = ROOM_TOKENS // model.page_size * 2 * LAYERS * BLOCK
    assert sorted(r["engine"] for r in doc["runs"]) == ["backend", "connector"]
    for run in doc["runs"]:
        backend = "kvbridge" if run["engine"] == "backend" else "mooncake"
        assert run["ok"] and run["backends"] == [backend, backend], run["engine"]
        assert run["rooms"] == run["rooms_done"] == ROOMS == len(run["latency_s"]) and not run["bad"]
        assert run["verified_bytes"] == run["expected_bytes"] == ROOMS * (kv_per_room + sum(model.aux_item_lens))
        pre, dec = run["prefill_sched"], run["decode_sched"]
        assert pre["send"]["calls"] == pre["init"]["calls"] == ROOMS  # one chunk per room
        assert pre["poll"]["calls"] >= 2 * ROOMS and pre["poll"]["rooms"] == ROOMS
        assert dec["init"]["calls"] == dec["send_metadata"]["calls"] == ROOMS and dec["poll"]["rooms"] == ROOMS
        for x in list(pre.values()) + list(dec.values()):
            assert x["total_ns"] > 0 and x["p99_ns"] >= x["p50_ns"] > 0 and x["per_room_ns"] > 0
    for column in ("connector", "backend"):
        s = doc["summary"][str(BLOCK)][column]
        assert s["ok_runs"] == 1 and s["rooms_done"] == ROOMS
        for key in ("prefill.send", "prefill.poll", "decode.poll"):
            assert s["sched"][key]["per_room"] > 0, key
        assert s["sched"]["prefill.all_per_room"] > 0 and s["sched"]["decode.all_per_room"] > 0
    assert len(doc["goal"]) == 1 and doc["goal"][0].startswith(bench_rooms._size(BLOCK))
