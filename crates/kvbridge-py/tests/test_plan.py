"""kvbridge.plan(): the planner on `kvbridge plan` scenarios, as numpy arrays."""

import glob
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from conftest import REPO, addr, session_of

import kvbridge

FIXTURES = os.path.join(REPO, "tests", "fixtures")
SCENARIOS = sorted(
    glob.glob(os.path.join(FIXTURES, "plan-scenarios", "*.json"))
    + glob.glob(os.path.join(FIXTURES, "plan-examples", "*.json"))
)


def expected(path):
    d, name = os.path.split(path)
    with open(os.path.join(d, "expected", name)) as f:
        return json.load(f)


def read(path):
    with open(path) as f:
        return f.read()


def as_rows(blocks):
    return [tuple(int(x) for x in row) for row in blocks]


def test_fixtures_found():
    assert len(SCENARIOS) > 100


@pytest.mark.parametrize("path", SCENARIOS, ids=os.path.basename)
def test_plan_matches_the_expected_result(path):
    want = expected(path)
    if "error" in want:
        with pytest.raises(kvbridge.PlanError) as err:
            kvbridge.plan(read(path))
        assert str(err.value)
        return
    got = kvbridge.plan(read(path))
    assert got.dtype == np.uint64 and got.ndim == 2 and got.shape[1] == 3
    assert got.flags["C_CONTIGUOUS"]
    assert as_rows(got) == [tuple(b) for b in want["blocks"]]


def test_plan_matches_the_cli():
    cli = os.environ.get("KVBRIDGE_CLI") or shutil.which("kvbridge")
    if not cli:
        pytest.skip("no kvbridge binary (set KVBRIDGE_CLI)")
    for path in SCENARIOS:
        out = json.loads(subprocess.run([cli, "plan", path], check=True, capture_output=True).stdout)
        if "error" in out:
            with pytest.raises(kvbridge.PlanError) as err:
                kvbridge.plan(read(path))
            assert str(err.value) == out["error"], path
        else:
            assert as_rows(kvbridge.plan(read(path))) == [tuple(b) for b in out["blocks"]], path


def test_dict_and_bytes_inputs_and_emission_order():
    path = os.path.join(FIXTURES, "plan-examples", "mha_equal_tp.json")
    text = read(path)
    canonical = kvbridge.plan(text)
    np.testing.assert_array_equal(kvbridge.plan(json.loads(text)), canonical)
    np.testing.assert_array_equal(kvbridge.plan(text.encode()), canonical)
    raw = kvbridge.plan(text, canonical=False)
    assert raw.dtype == np.uint64 and raw[:, 2].sum() == canonical[:, 2].sum()
    # 6 KV buffers x 2 runs + 2 aux blocks, as `kvbridge plan --bench` counts.
    assert raw.shape == (14, 3)


def test_unreadable_scenarios_raise_scenario_error():
    text = read(os.path.join(FIXTURES, "plan-examples", "mha_equal_tp.json"))
    bad = json.loads(text)
    bad["surprise"] = 1
    with pytest.raises(kvbridge.ScenarioError, match="surprise"):
        kvbridge.plan(bad)
    with pytest.raises(kvbridge.ScenarioError):
        kvbridge.plan("{")
    with pytest.raises(ValueError):  # both exceptions are ValueErrors
        kvbridge.plan(dict(json.loads(text), page_size=0))
    assert issubclass(kvbridge.PlanError, ValueError)


def test_planned_blocks_move_the_pages(pair):
    # MHA, 2 layers (K0 K1 V0 V1), 64-byte pages; the chunk's prefill pages
    # 0, 1, 2 go to decode pages 5, 3, 4, the aux row 1 to decode row 2.
    a, b = pair
    page, pages = 64, 8
    src = [np.random.default_rng(i).integers(0, 256, page * pages, dtype=np.uint8) for i in range(4)]
    dst = [np.zeros(page * pages, dtype=np.uint8) for _ in range(4)]
    src_aux = np.arange(64, dtype=np.uint8)
    dst_aux = np.zeros(64, dtype=np.uint8)
    scenario = {
        "engine_rank": 0,
        "page_size": 16,
        "kv_data_ptrs": [addr(x) for x in src],
        "kv_item_lens": [page] * 4,
        "aux_data_ptrs": [addr(src_aux)],
        "aux_item_lens": [16],
        "dst_kv_ptrs": [addr(x) for x in dst],
        "dst_aux_ptrs": [addr(dst_aux)],
        "dst_tp_rank": 0,
        "dst_attn_tp_size": 1,
        "dst_kv_item_len": page,
        "dst_kv_indices": [5, 3, 4],
        "dst_aux_index": 2,
        "prefill_kv_indices": [0, 1, 2],
        "prefill_aux_index": 1,
    }
    blocks = kvbridge.plan(scenario, canonical=False)
    assert a.batch_register_memory([addr(x) for x in src] + [addr(src_aux)], [x.nbytes for x in src] + [64]) == 0
    assert b.batch_register_memory([addr(x) for x in dst] + [addr(dst_aux)], [x.nbytes for x in dst] + [64]) == 0
    assert a.batch_transfer_sync_write(session_of(b), blocks[:, 0], blocks[:, 1], blocks[:, 2]) == 0
    for s, d in zip(src, dst):
        for p_src, p_dst in [(0, 5), (1, 3), (2, 4)]:
            np.testing.assert_array_equal(d[p_dst * page : (p_dst + 1) * page], s[p_src * page : (p_src + 1) * page])
        for untouched in (0, 1, 2, 6, 7):
            assert not d[untouched * page : (untouched + 1) * page].any()
    np.testing.assert_array_equal(dst_aux[32:48], src_aux[16:32])
    assert not dst_aux[:32].any() and not dst_aux[48:].any()
