"""The decode role as sglang's decode scheduler builds it: its ``KVArgs`` has
no KV head counts when the manager is created (``_init_kv_manager`` sets
``kv_head_num`` / ``total_kv_head_num`` afterwards, only for staging, right
before ``set_kv_buffer_tensors``)."""

import importlib.util
import json
import os
import sys
import types

import numpy as np
import pytest
from conftest import HOST, REPO, addr, start_engine

from kvbridge import _kvbridge

PAGE_BYTES = 16 * 64  # 16 tokens x 1 head x 64 bytes


def spec(kv, aux, **heads):
    """A role description of a TP 2 MHA rank over numpy buffers; ``heads``
    adds ``kv_head_num`` / ``total_kv_head_num`` as sglang would."""
    kv_args = {
        "engine_rank": 0,
        "kv_data_ptrs": [addr(b) for b in kv],
        "kv_data_lens": [b.nbytes for b in kv],
        "kv_item_lens": [PAGE_BYTES] * len(kv),
        "aux_data_ptrs": [addr(aux)],
        "aux_data_lens": [aux.nbytes],
        "aux_item_lens": [64],
        "page_size": 16,
        **heads,
    }
    return json.dumps({"kv_args": kv_args, "parallel": {"attn_tp_size": 2, "attn_tp_rank": 0}})


@pytest.fixture
def pools():
    return [np.zeros(8 * PAGE_BYTES, dtype=np.uint8) for _ in range(4)], np.zeros(4 * 64, dtype=np.uint8)


def decode_config(staging):
    return json.dumps({"local_ip": HOST, "attn_tp_size": 2, "staging": {"enabled": staging, "pool_bytes": 1 << 20}})


@pytest.mark.parametrize("staging", [False, True])
def test_a_decode_starts_without_kv_head_num(pools, staging):
    kv, aux = pools
    m = _kvbridge.DecodeManager(start_engine(), spec(kv, aux), decode_config(staging))
    try:
        assert (m.staging_ring() is not None) == staging
        # What set_kv_buffer_tensors hands over once sglang set the heads.
        m.set_kv_heads(1, 2)
        m.set_kv_heads(1)
        with pytest.raises(_kvbridge.KvArgsError, match="kv_head_num"):
            m.set_kv_heads(0, 2)
        with pytest.raises(_kvbridge.KvArgsError, match="below"):
            m.set_kv_heads(4, 2)
    finally:
        m.teardown()


def test_a_prefill_still_needs_kv_head_num(pools):
    kv, aux = pools
    with pytest.raises(_kvbridge.KvArgsError, match="kv_head_num"):
        _kvbridge.PrefillManager(start_engine(), spec(kv, aux), json.dumps({"local_ip": HOST}))


def _backend():
    """``kvbridge.sglang_backend``, with the interop suite's import stubs for
    the heavy packages sglang imports (skipped where sglang is missing)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed here")
    interop = os.path.join(REPO, "python", "interop")
    if interop not in sys.path:
        sys.path.insert(0, interop)
    try:
        import sgl_stubs

        sgl_stubs.install()
        from kvbridge import sglang_backend
    except ImportError as e:
        pytest.skip(f"sglang does not import here: {e}")
    return sglang_backend


class _Rust:
    """Records what the shell hands the Rust decode manager."""

    def __init__(self):
        self.heads = []

    def set_kv_heads(self, kv_head_num, total_kv_head_num=None):
        self.heads.append((kv_head_num, total_kv_head_num))


def test_set_kv_buffer_tensors_hands_the_heads_to_the_decode():
    backend = _backend()
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mgr = object.__new__(backend.KVManager)
    mgr.kv_args = types.SimpleNamespace()  # as sglang creates it: no heads yet
    mgr.disaggregation_mode = DisaggregationMode.DECODE
    mgr.is_mla_backend = False
    mgr._rust = _Rust()
    mgr.set_kv_buffer_tensors([], [], 16)
    assert mgr._rust.heads == []
    # sglang sets the heads on the same KVArgs, then calls this.
    mgr.kv_args.kv_head_num = 4
    mgr.kv_args.total_kv_head_num = 8
    mgr.set_kv_buffer_tensors([], [], 16, slot_layer_ids=[0, 1])
    assert mgr._rust.heads == [(4, 8)]
    assert mgr.kv_buffer_tensors["page_size"] == 16
    # A prefill's heads were known at start: nothing to hand over.
    mgr.disaggregation_mode = DisaggregationMode.PREFILL
    mgr.set_kv_buffer_tensors([], [], 16)
    assert mgr._rust.heads == [(4, 8)]


@pytest.mark.parametrize("intra", [False, True])
def test_sglang_staging_handler_accepts_the_decode(pools, monkeypatch, intra):
    """sglang's decode scheduler builds its ``DecodeStagingHandler`` from the
    manager whenever SGLANG_DISAGG_STAGING_BUFFER is set, and refuses one
    without an allocator. On CUDA IPC (intra-node) the role keeps no ring:
    the manager must still offer one, empty (the H100 run found this)."""
    backend = _backend()
    import torch
    from sglang.srt.disaggregation.common.staging_handler import DecodeStagingHandler
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if intra:
        monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    else:
        monkeypatch.delenv("MC_INTRANODE_NVLINK", raising=False)
        monkeypatch.delenv("MC_INTRA_NVLINK", raising=False)
    kv, aux = pools
    m = _kvbridge.DecodeManager(start_engine(), spec(kv, aux), decode_config(True))
    try:
        assert (m.staging_ring() is None) == intra
        allocator = backend._staging_allocator(m, DisaggregationMode.DECODE, True)
        assert allocator is not None
        assert allocator.get_total_size() == (0 if intra else m.staging_ring()[1])
        assert backend._staging_allocator(m, DisaggregationMode.PREFILL, True) is None
        # sglang's own factory over the manager's shape (a device-tagged
        # buffer stands in for the CUDA tensor; nothing touches its memory).
        kv_manager = types.SimpleNamespace(
            _staging_ctx=backend._StagingContext(allocator),
            kv_buffer_tensors={"k_buffers": [types.SimpleNamespace(device=torch.device("cuda", 0))]},
            attn_tp_size=2,
            kv_args=types.SimpleNamespace(kv_head_num=1, total_kv_head_num=2),
        )
        handler = DecodeStagingHandler.create(kv_manager, scheduler=None, tp_rank=0)
        assert handler.staging_allocator is allocator and handler.total_kv_heads == 2
    finally:
        m.teardown()
    # Staging off: no allocator, as sglang's own manager has none then.
    m = _kvbridge.DecodeManager(start_engine(), spec(kv, aux), decode_config(False))
    try:
        assert backend._staging_allocator(m, DisaggregationMode.DECODE, False) is None
    finally:
        m.teardown()
