"""The Python ports of kvbridge's synthetic model, workload and byte
pattern (harness.py) on their own; the live tests check them byte for byte
against the Rust ranks."""

import numpy as np

import harness


def test_mix_matches_kvbridge_rng():
    # kvbridge-plan rng.rs known_values: splitmix(0) = mix(GOLDEN).
    assert harness.mix(harness.GOLDEN) == 0xE220A8397B1DCDAF
    assert harness.mix(0) == 0
    values = np.array([0, 1, harness.GOLDEN, 2**64 - 1, 12345678901234567], dtype=np.uint64)
    assert [int(v) for v in harness.mix(values)] == [harness.mix(int(v)) for v in values]


def test_layer_range_and_heads():
    assert [harness.RankSpec(pp_size=3, pp_rank=r).layer_range(10) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    gqa = harness.ModelSpec(kv_heads=2)
    assert [gqa.global_head(4, r, 0) for r in range(4)] == [0, 0, 1, 1]  # replicated heads
    assert gqa.item_len(1) == 2 * gqa.item_len(2) == 2 * gqa.item_len(4)


def test_tp_slices_tile_the_full_page():
    """The pages two TP ranks hold are the head slices of the TP1 page."""
    model = harness.ModelSpec(kv_heads=4)
    full = harness.page_pattern(model, harness.RankSpec(), 77, 3, 1, 2).reshape(model.page_size, 4, -1)
    for rank in range(2):
        part = harness.page_pattern(model, harness.RankSpec(2, rank), 77, 3, 1, 2)
        assert np.array_equal(part.reshape(model.page_size, 2, -1), full[:, 2 * rank : 2 * rank + 2])


def test_pool_fill_verify_and_corruption():
    pool = harness.KVPool(harness.ModelSpec(), harness.RankSpec(1, 0, 2, 1), pages=8, aux_slots=4)
    pool.fill(5, [6, 1], 2)
    checked, bad = pool.verify(5, [6, 1], 2)
    assert bad == [] and checked == 2 * len(pool.kv) * pool.item_len + sum(pool.model.aux_item_lens)
    assert pool.untouched([6, 1]) and not pool.untouched([6])
    pool.kv[0][pool.item_len + 3] ^= 1
    assert pool.verify(5, [6, 1], 2)[1] == [(0, 1)]
    assert pool.verify(6, [6, 1], 2)[1]  # another room's pattern differs


def test_workload_is_deterministic():
    w = harness.Workload(requests=50, prompt_tokens=100, abort_fraction=0.25)
    plan = w.plan()
    assert plan == w.plan() and len({r.room for r in plan}) == 50
    assert all(75 <= r.tokens <= 125 and 0 <= r.room < 2**63 for r in plan)
    assert 1 <= len(w.aborted_rooms()) < 25
