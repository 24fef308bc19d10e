"""DeepSeek-V4 (compressed MLA) pools for the real-scheduler suite
(``sched_world.World``, layout ``"dsv4"``), built as sglang 0.5.23's model
runner and scheduler build them, through ``sched_hybrid.build``.

Construction, all sglang's own code:

* the sizes: ``DSV4PoolConfigurator`` (what ``KVCacheConfigurator``
  picks for a DeepSeek-V4 model) turns a full-pool token count into the
  SWA, C4, C128 and compress-state sizes (``_compute_dsv4_sizes``,
  ``_to_config``, ``finalize_with_max_running_requests``), and
  ``KVCacheConfigurator._derive_pool_sizes`` into ``_init_pools``'s sizes;
* the pools: ``KVCacheConfigurator._init_pools`` builds
  ``DeepSeekV4TokenToKVPool`` (``_build_dsv4_kv_pool``: the paged SWA
  pool, the C4 and C128 compressed KV pools, the C4 indexer pool, the C4
  compressor and indexer states, the request-scoped C128 state; layout
  from ``select_dsv4_kv_layout``, which picks ``V4`` off SM100), the
  ``SWATokenToKVPoolAllocator`` and the ``ReqToTokenPool`` /
  ``DecodeReqToTokenPool``; the tree cache from ``build_kv_cache``;
* ``KVArgs``: ``setup_state_kv_args`` and ``get_pd_kv_layout`` inside
  ``init_disaggregation``, untouched: ``mla_compression_ratios``, the
  ``kv_layout`` tag (``"v4,c4:v4,c128:v4"``), KV ``[C4 KV, C4 indexer,
  C128 KV]``, state ``SWA`` ``[SWA KV per layer, C4 compressor states,
  C4 indexer states]`` and ``DSV4_REQUEST_STATE`` (``c128_state``:
  the C128 compressor ring).

What is stood in for, and why:

* **The sizing's input** (``calculate_pool_sizes``: GPU memory
  profiling): the full pool's token count is given (``Shape.pool_tokens``);
  everything else is sglang's sizing from it. The SWA share is given as
  an operator would (``--swa-full-tokens-ratio 0.5``; sglang's default 0.1
  leaves a 4096-token pool a single 256-token SWA page). The
  ``"fp8_e4m3"`` KV dtype is what sglang's DeepSeek-V4 argument hook
  (``_deepseek_v4_kv_cache_dtype``) resolves ``"auto"`` to; the published
  args name a dummy model, so the hook does not run here.
* **The forward** (FlashMLA, the compressor and indexer kernels: CUDA
  only): :func:`write` writes a byte pattern into every item sglang
  registers for transfer that the request's forward would fill, found
  through the pool's own ``get_contiguous_buf_infos`` /
  ``get_state_buf_infos`` / ``get_request_state_buf_infos``: the
  request's full pages of every compressed KV and indexer buffer, its SWA
  pages (``translate_swa_indices_for_transfer``) of every SWA KV and C4
  state buffer, and its C128 state ring page
  (``request_state_transfer_indices``). An item is written whole (the
  page or ring rows, not token by token inside the FlashMLA page layout):
  sglang moves whole items, so the decode checks whole items.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import sched_models

#: Tags of the byte patterns per buffer group (``kv_pattern``'s K/V argument).
KV, SWA_STATE, REQUEST_STATE = 4, 5, 6
#: What an operator passes as --swa-full-tokens-ratio here (module docstring).
SWA_FULL_TOKENS_RATIO = 0.5


def server_args_extra(mode: str, shape) -> dict:
    """Server args for a DeepSeek-V4 rank (module docstring)."""
    extra = {"kv_cache_dtype": "fp8_e4m3", "swa_full_tokens_ratio": SWA_FULL_TOKENS_RATIO,
             "_swa_full_tokens_ratio_explicitly_set": True}
    if mode == "decode":
        extra["disaggregation_decode_extra_slots"] = 2 * shape.max_running
        if shape.device == "cpu":
            # As for the SWA hybrid: the default backup is a cudaHostRegister'd host pool.
            extra["disaggregation_decode_retraction_backup"] = "cpu_tensor"
    return extra


def pool_sizes(configurator, shape):
    """``_init_pools``'s sizes from sglang's DeepSeek-V4 sizer, given the
    full pool's token count instead of the profiled memory."""
    from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator

    sizer = DSV4PoolConfigurator(configurator)
    config = sizer._to_config(sizer._compute_dsv4_sizes(shape.pool_tokens, shape.page_size))
    config.max_running_requests = shape.max_running
    config = sizer.finalize_with_max_running_requests(config)
    return configurator._derive_pool_sizes(config=config)


# -- the items a request owns ---------------------------------------------------

def _tensors(pool) -> Dict[int, object]:
    """Every buffer of a ``DeepSeekV4TokenToKVPool`` by ``data_ptr``."""
    out = list(pool.swa_kv_pool.kv_buffer)
    for kv_pool in pool.kv_pools.values():
        if kv_pool is not None:
            out.extend(kv_pool.kv_buffer)
    for index_pool in pool.index_pools.values():
        out.extend(index_pool.contiguous_page_row_buffers())
    for state in pool.compress_state_pools + pool.indexer_compress_state_pools:
        if state is not None:
            out.append(state.kv_score_buffer.kv_score)
    return {t.data_ptr(): t for t in out}


def groups(world) -> Dict[int, List[object]]:
    """``{tag: [uint8 view [items, item bytes]]}`` of what sglang registers
    for transfer, in its order: KV (``get_contiguous_buf_infos``), SWA
    state (``get_state_buf_infos``), request state
    (``get_request_state_buf_infos``)."""
    import torch

    pool = world.kv_pool
    if getattr(world, "_dsv4_groups", None) is None:
        tensors = _tensors(pool)
        out = {}
        for tag, infos in ((KV, pool.get_contiguous_buf_infos()), (SWA_STATE, pool.get_state_buf_infos()),
                           (REQUEST_STATE, pool.get_request_state_buf_infos())):
            views = []
            for ptr, length, item in zip(*infos):
                t = tensors[ptr]
                assert length <= t.nbytes, (tag, length, t.nbytes)
                views.append(t.view(torch.uint8).reshape(-1)[:length // item * item].view(-1, item))
            out[tag] = views
        world._dsv4_groups = out
    return world._dsv4_groups


def _pages(world, slots):
    """sglang's page ids of token slots (``kv_to_page_indices``)."""
    import torch
    from sglang.srt.mem_cache.common import kv_to_page_indices

    return torch.as_tensor(kv_to_page_indices(slots, world.shape.page_size), dtype=torch.long)


def window_start(world, n: int) -> int:
    """First token position whose SWA page the prefill sends (``_swa_payload``)."""
    page = world.shape.page_size
    return max(0, n - world.kv_result.sliding_window_size) // page * page


def items(world, req, n: int, swa_from: int = 0) -> Dict[int, Tuple[object, range]]:
    """``{tag: (item ids, ordinals)}`` of ``req``'s first ``n`` tokens:
    full pages (ordinal = page of the request), SWA pages of the positions
    from ``swa_from`` (ordinal = the full page they cover), the C128 state
    ring page."""
    page = world.shape.page_size
    row = world.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    swa = world.allocator.translate_swa_indices_for_transfer(row[swa_from:n])
    request = world.kv_pool.request_state_transfer_indices(int(req.kv.req_pool_idx), n)
    return {KV: (_pages(world, row[:n]), range(0, -(-n // page))),
            SWA_STATE: (_pages(world, swa), range(swa_from // page, -(-n // page))),
            REQUEST_STATE: (list(map(int, request)), range(len(request)))}


def _pattern(world, room: int, tag: int, index: int, ordinals: range, item_bytes: int):
    device = world.shape.device.split(":")[0]
    return sched_models.kv_pattern(room, index, tag, ordinals, [0], item_bytes, device)[:, 0]


def write(world, req) -> None:
    """The forward's writes for ``req`` (module docstring)."""
    n = req.extend_end
    for tag, (ids, ordinals) in items(world, req, n).items():
        assert len(ids) == len(ordinals), (tag, len(ids), len(ordinals))
        for index, view in enumerate(groups(world)[tag]):
            if len(ids):
                view[ids] = _pattern(world, req.bootstrap_room, tag, index, ordinals, view.shape[-1])


def verify(world, req) -> Dict[str, int]:
    """Every item of ``req`` sglang sent to this decode rank against the
    pattern: all KV pages, the SWA pages of the window, the C128 state;
    ``{"bytes", "mismatched"}``."""
    n = len(req.origin_input_ids)
    checked = bad = 0
    for tag, (ids, ordinals) in items(world, req, n, swa_from=window_start(world, n)).items():
        assert len(ids) == len(ordinals), (tag, len(ids), len(ordinals))
        for index, view in enumerate(groups(world)[tag]):
            got = view[ids]
            checked += got.numel()
            bad += int((got != _pattern(world, req.bootstrap_room, tag, index, ordinals, view.shape[-1])).sum())
    return {"bytes": checked, "mismatched": bad}


# -- what the decode must hold -----------------------------------------------------

def expected_bytes(layers: int, tokens: int) -> int:
    """Bytes one room of ``tokens`` leaves on a decode rank, from the model's
    shape (FlashMLA V4 pages: fp8 nope, bf16 rope, one fp8 scale per 64
    nope values and a pad byte per token, pages padded to 576 bytes; fp8
    indexer keys with an fp32 scale; fp32 compressor states, rings of 8 (C4,
    overlapping: two blocks) and 128 (C128) rows)."""
    m = sched_models.MODELS["dsv4"]
    page, window = m["_page_size"], m["sliding_window"]
    nope, rope, index = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["index_head_dim"]
    ratios = [m["compress_ratios"][i % len(m["compress_ratios"])] for i in range(layers)]
    c4, c128 = ratios.count(4), ratios.count(128)

    def page_bytes(p):
        return -(-p * (nope + 2 * rope + nope // 64 + 1) // 576) * 576

    head = nope + rope
    pages = -(-tokens // page)
    swa_pages = pages - max(0, tokens - window) // page
    kv = c4 * (page_bytes(page // 4) + page // 4 * (index + 4)) + c128 * page_bytes(page // 128)
    swa = layers * page_bytes(page) + c4 * 8 * 4 * (head + index) * 4
    request = c128 * 128 * 2 * head * 4 if tokens % 128 else 0
    return pages * kv + swa_pages * swa + request
