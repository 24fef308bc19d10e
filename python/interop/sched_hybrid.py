"""Hybrid pools for the real-scheduler suite (``sched_world.World``): a
mamba hybrid (Qwen3-Next-shaped: gated-delta-net linear-attention layers
with conv + temporal state, every second layer full attention) and a
sliding-window hybrid (gpt-oss-shaped: sliding and full attention layers
alternate), built as sglang 0.5.23's model runner and scheduler build them.

Construction, all sglang's own code:

* the pools: ``KVCacheConfigurator._init_pools`` (what
  ``ModelRunner`` runs once it sized the pools), which picks
  ``HybridReqToTokenPool`` (with its ``MambaPool``) or, on a decode,
  ``HybridMambaDecodeReqToTokenPool``, ``HybridLinearKVPool``, or
  ``SWAKVPool`` + ``SWATokenToKVPoolAllocator``; the layer split from
  ``resolve_layer_indices``;
* the tree cache and the scheduler's hybrid fields: ``build_kv_cache``
  (what ``Scheduler.__init__`` runs), over a real ``TpModelWorker``
  created without ``__init__``; it picks sglang's ``UnifiedRadixCache``
  with the FULL + MAMBA or FULL + SWA components;
* ``KVArgs`` (``state_types``, ``state_data_ptrs``, ``state_dim_per_tensor``,
  ``state_conv_shard_groups``, ``state_layer_ids``...): ``setup_state_kv_args``
  inside ``init_disaggregation``, untouched.

What is stood in for, and why:

* **The sizing** (``configure``: GPU memory profiling, ``MemoryPoolConfig``):
  the sizes are given (:func:`pool_sizes`); ``max_mamba_cache_size`` and
  ``disaggregation_decode_extra_slots``, which sglang's sizer resolves,
  are passed as server args (:func:`server_args_extra`).
* **The model** (``load_model``): a namespace with ``start_layer`` /
  ``end_layer`` for ``resolve_layer_indices``; the sliding window is
  gpt-oss's ``get_attention_sliding_window_size`` (``sliding_window - 1``),
  computed here as the model class would.
* **The forward**: :func:`write_state` writes a byte pattern into what a
  forward would fill: every transferable mamba state entry (sglang's
  ``MambaPool._iter_transfer_state_entries``, the list
  ``get_contiguous_buf_infos`` registers) at the request's mamba slot, and
  the KV of sliding-window layers at the SWA slots the allocator mapped the
  request's tokens to (``translate_loc_from_full_to_swa``). The gated-delta
  and causal-conv kernels themselves are never run (CUDA/Triton only).
"""

from __future__ import annotations

import types
from typing import Dict, List, Tuple

import sched_dsv4
import sched_models

#: Tags of the state byte patterns (``kv_pattern``'s K/V argument).
CONV, TEMPORAL = 2, 3


def kind(layout: str) -> str:
    """"mamba", "swa", "dsv4" (``sched_dsv4``) or "" (not a hybrid layout)."""
    return sched_models.MODELS[layout].get("_hybrid", "")


def server_args_extra(layout: str, mode: str, shape) -> dict:
    """Server args sglang's sizer would have resolved for these pools."""
    if kind(layout) == "dsv4":
        return sched_dsv4.server_args_extra(mode, shape)
    extra = {}
    if kind(layout) == "mamba":
        # Mamba slots: a main one and the ping-pong tracking ones per request.
        extra["max_mamba_cache_size"] = 4 * shape.max_running
        # What sglang's _mamba_radix_cache_resolution picks for Qwen3-Next at
        # page_size > 1 (the radix cache's MambaComponent needs it there).
        extra["mamba_radix_cache_strategy"] = "extra_buffer"
    if mode == "decode":
        extra["disaggregation_decode_extra_slots"] = 2 * shape.max_running
        if kind(layout) == "swa" and shape.device == "cpu":
            # sglang's default retraction backup for an SWA decode is a host
            # pool pinned with cudaHostRegister (CUDA only): on CPU, its
            # other backup (the one it picks for mamba models).
            extra["disaggregation_decode_retraction_backup"] = "cpu_tensor"
    return extra


def sliding_window(model_config) -> int:
    """gpt-oss's ``get_attention_sliding_window_size``: the window the
    scheduler's ``sliding_window_size`` (and so the SWA payload) uses."""
    return model_config.hf_config.sliding_window - 1


def pool_sizes(shape, is_hybrid_swa: bool):
    """The sizes sglang's sizer would hand ``_init_pools``: the full pool of
    ``shape.pool_tokens``, the SWA pool half of it."""
    from sglang.srt.mem_cache.kv_cache_configurator import _PoolSizes

    return _PoolSizes(
        max_total_num_tokens=shape.pool_tokens, max_running_requests=shape.max_running,
        full_max_total_num_tokens=shape.pool_tokens if is_hybrid_swa else None,
        swa_max_total_num_tokens=shape.pool_tokens // 2 if is_hybrid_swa else None,
        c4_max_total_num_tokens=0, c128_max_total_num_tokens=0, c4_state_pool_size=0, c128_state_pool_size=0,
        c4_state_dtype=None, c128_state_dtype=None)


def build(world):
    """sglang's pools and tree cache for ``world`` (module docstring).
    Returns ``(KVCacheBuildResult, tp_worker)``."""
    import torch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.kv_cache_builder import build_kv_cache
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import resolve_layer_indices
    from sglang.srt.model_executor.model_runner_components.load_model_utils import resolve_sliding_window_size
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    s, mc = world.shape, world.model_config
    dsv4 = kind(s.layout) == "dsv4"
    start, end = world.layer_range()
    model = types.SimpleNamespace(start_layer=start, end_layer=end)  # the loaded model's layer range
    layer_info = resolve_layer_indices(model=model, model_config=mc, is_draft_worker=False)
    # DeepSeek-V4's model class has no window of its own: sglang's resolution
    # takes the config's; gpt-oss's get_attention_sliding_window_size.
    window = resolve_sliding_window_size(model, mc) if dsv4 else sliding_window(mc) if mc.is_hybrid_swa else None
    # DeepSeek-V4: the fp8 KV sglang resolves "auto" to (sched_dsv4).
    dtype, dtype_str = (torch.float8_e4m3fn, "fp8_e4m3") if dsv4 else (torch.bfloat16, "auto")
    configurator = KVCacheConfigurator(
        device=s.device, gpu_id=0, attn_dp_size=1, pp_size=s.pp_size, pp_group=get_parallel().pp_group,
        model=model, model_config=mc, server_args=world.server_args, kv_cache_dtype=dtype,
        kv_cache_dtype_str=dtype_str, model_dtype=torch.bfloat16, page_size=s.page_size, sliding_window_size=window,
        spec_algorithm=SpeculativeAlgorithm.NONE, is_draft_worker=False, post_capture_kv_active=False,
        spec_aux_config=None, is_hybrid_swa=mc.is_hybrid_swa, is_hybrid_swa_compress=False,
        use_mla_backend=False, layer_info=layer_info, forward_stream=None, req_to_token_pool=None,
        token_to_kv_pool_allocator=None, memory_pool_config=None)
    sizes = sched_dsv4.pool_sizes(configurator, s) if dsv4 else pool_sizes(s, mc.is_hybrid_swa)
    pools = configurator._init_pools(sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None)
    # The model runner's fields after its pools exist (ModelRunner stand-in).
    runner = types.SimpleNamespace(
        model_config=mc, token_to_kv_pool=pools.token_to_kv_pool, req_to_token_pool=pools.req_to_token_pool,
        token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator, is_hybrid_swa=mc.is_hybrid_swa,
        sliding_window_size=window, full_max_total_num_tokens=sizes.full_max_total_num_tokens,
        swa_max_total_num_tokens=sizes.swa_max_total_num_tokens or s.pool_tokens,
        effective_logical_max_total_num_tokens=s.pool_tokens, kv_cache_dtype_str=dtype_str,
        mtp_draft_device_pools=(), mtp_draft_mamba_pools=(), spec_algorithm=SpeculativeAlgorithm.NONE,
        forward_stream=None, model=model)
    tp_worker = object.__new__(TpModelWorker)
    tp_worker._model_runner = runner
    tp_worker.model_runner_list = None
    result = build_kv_cache(server_args=world.server_args, model_config=mc, tp_worker=tp_worker,
                            page_size=s.page_size, spec_algorithm=SpeculativeAlgorithm.NONE, enable_metrics=False,
                            enable_kv_cache_events=False, enable_hierarchical_cache=False)
    return result, tp_worker


def scheduler_fields(world) -> dict:
    """What ``Scheduler.__init__`` copies from ``build_kv_cache``'s result."""
    r = world.kv_result
    return dict(is_hybrid_swa=r.is_hybrid_swa, is_hybrid_ssm=r.is_hybrid_ssm,
                sliding_window_size=r.sliding_window_size, full_tokens_per_layer=r.full_tokens_per_layer,
                swa_tokens_per_layer=r.swa_tokens_per_layer, disable_radix_cache=r.disable_radix_cache,
                tp_worker=world.tp_worker)


# -- what the forward writes ------------------------------------------------

def kv_layers(world) -> List[Tuple[int, int, object, bool]]:
    """``(global layer, K/V, uint8 view [slots, heads, head bytes], is_swa)``
    of every attention layer of this stage, through the pool's own
    ``get_key_buffer`` / ``get_value_buffer`` (which route a global layer id
    to the full or the SWA sub-pool)."""
    torch, pool = world.torch, world.kv_pool
    mc = world.model_config
    start, end = world.layer_range()
    if kind(world.shape.layout) == "dsv4":
        return []  # whole items of sglang's transfer buffers instead (sched_dsv4)
    if kind(world.shape.layout) == "swa":
        swa = set(mc.swa_attention_layer_ids)
        layers = [(layer, layer in swa) for layer in range(start, end)]
    else:
        layers = [(layer, False) for layer in mc.hf_config.full_attention_layer_ids if start <= layer < end]
    out = []
    for layer, is_swa in layers:
        out.append((layer, 0, pool.get_key_buffer(layer).view(torch.uint8), is_swa))
        out.append((layer, 1, pool.get_value_buffer(layer).view(torch.uint8), is_swa))
    return out


def swa_slots(world, full_slots):
    """The SWA-pool slots of full-pool slots (sglang's allocator mapping)."""
    return world.allocator.translate_swa_indices_for_transfer(full_slots).long()


def swa_window(world, n: int) -> range:
    """Token positions whose SWA KV the prefill sends (``_swa_payload``:
    the last ``sliding_window_size`` tokens, floored to a page)."""
    page = world.shape.page_size
    start = max(0, n - world.kv_result.sliding_window_size)
    return range(start // page * page, n)


def _conv_rows(groups: List[int], tp_size: int, tp_rank: int) -> List[int]:
    """Global rows of a rank's conv state: the q/k/v sub-blocks (full sizes
    ``groups``) are each head-sharded across attention TP."""
    rows, base = [], 0
    for g in groups:
        per = g // tp_size
        rows.extend(range(base + tp_rank * per, base + (tp_rank + 1) * per))
        base += g
    return rows


def state_entries(world) -> List[Tuple[int, int, object, List[int]]]:
    """``(global layer, tag, uint8 view [slots, rows, row bytes], global rows)``
    of every mamba state entry sglang registers for transfer, in its order
    (``MambaPool._iter_transfer_state_entries``): rows along the axis TP
    slices, so any TP split reads the same bytes for the same row."""
    torch = world.torch
    mamba = world.req_to_token_pool.mamba_pool
    s = world.shape
    out = []
    for field, tensor, axis, layer in mamba._iter_transfer_state_entries():
        assert axis == 0, f"{field}: slice axis {axis}"
        slots, rows = tensor.shape[0], tensor.shape[1]
        view = tensor.view(torch.uint8).reshape(slots, rows, -1)
        if field == "conv":
            global_rows = _conv_rows(list(mamba.conv_shard_groups), s.tp_size, s.tp_rank)
            assert len(global_rows) == rows, (mamba.conv_shard_groups, rows)
            out.append((layer, CONV, view, global_rows))
        else:
            out.append((layer, TEMPORAL, view, list(range(s.tp_rank * rows, (s.tp_rank + 1) * rows))))
    return out


def mamba_slot(world, req) -> int:
    """The request's mamba slot (``_mamba_payload``'s index)."""
    pool = world.req_to_token_pool
    return int(pool.translate_mamba_indices(pool.req_index_to_mamba_index_mapping[req.kv.req_pool_idx]))


def _state_pattern(world, room: int, layer: int, tag: int, rows: List[int], row_bytes: int):
    return sched_models.kv_pattern(room, layer, tag, [0], rows, row_bytes, world.shape.device.split(":")[0])[0]


def write_state(world, req) -> None:
    """The forward's state writes for ``req`` beyond full-attention KV: the
    mamba state at its slot (written whole, as the last chunk's forward
    leaves it); DeepSeek-V4's every transfer item (``sched_dsv4.write``)."""
    if kind(world.shape.layout) == "dsv4":
        return sched_dsv4.write(world, req)
    if kind(world.shape.layout) != "mamba":
        return
    slot = mamba_slot(world, req)
    for layer, tag, view, rows in state_entries(world):
        view[slot] = _state_pattern(world, req.bootstrap_room, layer, tag, rows, view.shape[-1])


def verify_state(world, req) -> Dict[str, int]:
    """Every mamba state byte of ``req`` on this decode rank against the
    pattern (DeepSeek-V4: every item sglang sent, ``sched_dsv4.verify``);
    ``{"bytes", "mismatched"}``."""
    if kind(world.shape.layout) == "dsv4":
        return sched_dsv4.verify(world, req)
    if kind(world.shape.layout) != "mamba":
        return {"bytes": 0, "mismatched": 0}
    slot = mamba_slot(world, req)
    checked = bad = 0
    for layer, tag, view, rows in state_entries(world):
        got = view[slot]
        checked += got.numel()
        bad += int((got != _state_pattern(world, req.bootstrap_room, layer, tag, rows, view.shape[-1])).sum())
    return {"bytes": checked, "mismatched": bad}


def leaks(world) -> Dict[str, int]:
    """Free capacity of each hybrid pool against its size, on a prefill
    after every room concluded: each pair must match."""
    alloc, tree = world.allocator, world.tree_cache
    out = {"free_kv_tokens": alloc.full_available_size() + tree.full_evictable_size()
           if hasattr(alloc, "full_available_size") else alloc.available_size() + tree.full_evictable_size(),
           "pool_tokens": world.shape.pool_tokens}
    if kind(world.shape.layout) in ("swa", "dsv4"):
        out["swa_free_tokens"] = alloc.swa_available_size() + tree.swa_evictable_size()
        out["swa_pool_tokens"] = alloc.size_swa
    else:
        pool = world.req_to_token_pool
        out["mamba_free_slots"] = pool.mamba_allocator.available_size() + tree.mamba_evictable_size()
        out["mamba_slots"] = pool.mamba_pool.size
    return out


# -- what the decode must hold ------------------------------------------------

def expected_bytes(layout: str, layers: int, decode_tp: int, rank: int, tokens: int) -> int:
    """KV and state bytes one room of ``tokens`` leaves on decode rank
    ``rank`` of ``decode_tp`` (bf16 KV, bf16 conv and fp32 temporal state)."""
    if kind(layout) == "dsv4":
        return sched_dsv4.expected_bytes(layers, tokens)  # replicated on every rank (MLA)
    m = sched_models.MODELS[layout]
    heads = len(sched_models.local_kv_heads(m["num_key_value_heads"], decode_tp, rank))
    per_token_layer = 2 * heads * m["head_dim"] * 2
    if kind(layout) == "swa":
        kinds = [m["layer_types"][i % len(m["layer_types"])] for i in range(layers)]
        page, window = 16, m["sliding_window"] - 1
        swa_tokens = tokens - max(0, tokens - window) // page * page
        return per_token_layer * sum(tokens if k == "full_attention" else swa_tokens for k in kinds)
    full = sum(1 for i in range(layers) if (i + 1) % m["full_attention_interval"] == 0)
    conv_dim = 2 * m["linear_key_head_dim"] * m["linear_num_key_heads"] + \
        m["linear_value_head_dim"] * m["linear_num_value_heads"]
    conv = conv_dim // decode_tp * (m["linear_conv_kernel_dim"] - 1) * 2
    temporal = m["linear_num_value_heads"] // decode_tp * m["linear_value_head_dim"] * m["linear_key_head_dim"] * 4
    return per_token_layer * tokens * full + (layers - full) * (conv + temporal)
