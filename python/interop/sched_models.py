"""The real-scheduler suite's models and patterns: tiny model
configurations by layout name (``config.json`` written per world), the KV
pattern a "forward pass" writes (a function of room, layer, K/V, position,
global head and byte only, so any TP split reads the same bytes for the same
head), and sglang's split of KV heads over attention-TP ranks. Read by the
world (``sched_world``) and its hybrid and DeepSeek-V4 pools alike.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import List

#: Tiny model configurations (HF ``config.json``), by layout name.
MODELS = {
    # Llama-shaped MHA: 8 KV heads, head_dim 32.
    "mha": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
            "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32},
    # GQA: 4 KV heads for 8 query heads.
    "gqa": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32},
    # DeepSeek-V3-shaped MLA: one latent of kv_lora_rank + qk_rope_head_dim.
    "mla": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
            "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": None, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 64, "first_k_dense_replace": 4,
            "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
    # Qwen3-Next-shaped mamba hybrid (sched_hybrid): gated-delta-net layers
    # (conv state over q/k/v, temporal state per value head) with every
    # second layer full attention (GQA, 2 KV heads); Qwen3-Next has every fourth.
    "mamba": {"_hybrid": "mamba", "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
              "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
              "full_attention_interval": 2, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
              "shared_expert_intermediate_size": 64},
    # gpt-oss-shaped sliding-window hybrid (sched_hybrid): sliding and full
    # attention layers alternate, GQA with 4 KV heads; a 64-token window
    # (gpt-oss: 128), so a prompt's window is a tail of it.
    "swa": {"_hybrid": "swa", "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
            "num_experts_per_tok": 2},
    # DeepSeek-V4-shaped compressed MLA (sched_dsv4): every layer keeps a
    # 128-token sliding window of the 512-dim latent (448 nope + 64 rope);
    # compress_ratios per layer (cycled): none, C4 (with its indexer), C128.
    # V4's own head sizes (the FlashMLA V4 page layout asserts 584 bytes a
    # token); sglang's V4 pools need 256-token pages.
    "dsv4": {"_hybrid": "dsv4", "_page_size": 256, "_pool_tokens": 8192, "architectures": ["DeepseekV4ForCausalLM"],
             "model_type": "deepseek_v4", "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 1,
             "head_dim": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448, "v_head_dim": 512,
             "kv_lora_rank": 512, "q_lora_rank": 64, "sliding_window": 128, "index_head_dim": 128,
             "index_n_heads": 4, "index_topk": 64, "compress_ratios": [0, 4, 128, 4], "n_routed_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_shared_experts": 1, "n_group": 1,
             "topk_group": 1, "routed_scaling_factor": 1.0},
}


def write_model_dir(layout: str, layers: int) -> str:
    """A directory holding a tiny ``config.json`` for ``layout``."""
    model = {k: v for k, v in MODELS[layout].items() if not k.startswith("_")}
    for per_layer in ("layer_types", "compress_ratios"):
        if per_layer in model:
            model[per_layer] = [model[per_layer][i % len(model[per_layer])] for i in range(layers)]
    cfg = dict(model, num_hidden_layers=layers, intermediate_size=512, vocab_size=1000,
               max_position_embeddings=8192, torch_dtype="bfloat16", rms_norm_eps=1e-6)
    d = tempfile.mkdtemp(prefix=f"kvb-sched-{layout}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def layout_shape(layout: str) -> dict:
    """Shape fields a layout needs other than the defaults (page size,
    pool tokens)."""
    m = MODELS[layout]
    return {k: m["_" + k] for k in ("page_size", "pool_tokens") if "_" + k in m}


def mix64(x):
    """A 64-bit integer hash of a torch int64 tensor (splitmix64's finaliser,
    wrapped to signed int64 arithmetic)."""

    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
    x = x ^ (x >> 30) & 0x3FFFFFFFF
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27) & 0x1FFFFFFFFF
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ (x >> 31) & 0x1FFFFFFFF


def kv_pattern(room: int, layer: int, kv: int, positions, heads, head_bytes: int, device: str):
    """The bytes the "forward pass" writes: ``[len(positions), len(heads),
    head_bytes]`` uint8, a function of (room, layer, K/V, token position,
    global head, byte) only, so any TP split of the same model reads the
    same bytes for the same head."""
    import torch

    p = torch.as_tensor(positions, dtype=torch.int64, device=device).view(-1, 1, 1)
    h = torch.as_tensor(heads, dtype=torch.int64, device=device).view(1, -1, 1)
    b = torch.arange(head_bytes, dtype=torch.int64, device=device).view(1, 1, -1)
    seed = (room * 1_000_003 + layer * 7919 + kv * 104_729) & 0x3FFF_FFFF_FFFF_FFFF
    x = mix64(mix64(p * 0x10000 + h * 0x100_0000_0000 + b) + seed)
    return (x & 0xFF).to(torch.uint8)


def first_token(room: int) -> int:
    """The token the prefill "samples" for ``room`` (the decode checks it)."""
    return 1 + room % 997


def local_kv_heads(total: int, tp_size: int, tp_rank: int) -> List[int]:
    """Global KV heads this attention-TP rank holds (sglang's split:
    replicated when there are fewer heads than ranks)."""
    if total >= tp_size:
        per = total // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    return [tp_rank * total // tp_size]
