"""Named model presets, each the config.json a checkpoint of that model would ship.

- `kimi-k3`: the published Kimi K3 config (nested `kimi_k3`, MXFP4 routed experts).
- `kimi-k3.1-pro`: K3 plus the DSA indexer on every full-attention layer (32 heads x 128,
  FP8 keys, top-2048; DESIGN.md "Decisions").
- `kimi-linear-48b-a3b`: the published Kimi-Linear config (flat `kimi_linear`).
- `k3-tiny`, `k3.1-pro-tiny`, `kimi-linear-tiny`: CPU-sized models of the same structure, with
  the compact vocabulary of the tiny checkpoints (see `COMPACT_VOCAB`).
- `k3-slice`: 12 layers with K3's real per-layer dimensions, 128 experts top-16: the
  single-GPU benchmark model.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

# K3's special tokens sit at 163584 and above, after 163584 regular tokens. The tiny
# checkpoints' compact vocabulary keeps that shape: 256 byte tokens + 128 merges = 384 regular
# tokens, then id = 384 + (K3 id - 163584) for the first 126 special slots, and [UNK] / [PAD]
# (163838 / 163839) at 510 / 511. The tokenizer, not this table, is the authority on ids.
COMPACT_VOCAB_SIZE = 512
COMPACT_SPECIAL_BASE = 384
K3_SPECIAL_BASE = 163584


def compact_special_id(k3_id: int) -> int:
    """Compact-vocabulary id of a K3 special token id."""
    if k3_id >= 163838:
        return COMPACT_VOCAB_SIZE - (163840 - k3_id)
    return COMPACT_SPECIAL_BASE + (k3_id - K3_SPECIAL_BASE)


def _layer_lists(num_layers: int, full_attn_1based: list[int]) -> dict[str, list[int]]:
    return {"kda_layers": [i for i in range(1, num_layers + 1) if i not in full_attn_1based],
            "full_attn_layers": list(full_attn_1based)}


def _mxfp4_quantization() -> dict[str, Any]:
    """compressed-tensors MXFP4 on the routed experts only (everything else is ignored)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "input_activations": None,
            "output_activations": None,
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
        }},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
                   r"re:.*block_sparse_moe\.gate$", r"re:.*routed_expert_(down|up)_proj.*",
                   "language_model.lm_head", "re:vision_tower.*", "re:mm_projector.*"],
        "kv_cache_scheme": None,
    }


def _k3_text() -> dict[str, Any]:
    """Kimi K3's published text_config."""
    return {
        "model_type": "kimi_linear",
        "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
        "num_attention_heads": 96, "num_key_value_heads": 96, "head_dim": 74,
        "intermediate_size": 33792, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 1048576,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "attn_res_block_size": 12,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
            **_layer_lists(93, list(range(4, 93, 4)) + [93]),
        },
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "dtype": "bfloat16",
        "quantization_config": _mxfp4_quantization(),
    }


# a CPU-sized MoonViT tower with the K3 vision config's field names (vt_*, qkv_hidden_size != hidden)
TINY_VISION_CONFIG: dict[str, Any] = {
    "model_type": "kimi_k3_vision", "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
    "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 2, "vt_hidden_size": 32, "vt_intermediate_size": 64, "qkv_hidden_size": 48,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
    "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "attn_bias": False, "patch_embed_proj_bias": False,
    "linear_bias": False, "activation_func": "gelu_pytorch_tanh", "pos_emb_interpolation_mode": "bilinear",
}


# the published K3 tower (MoonViT-V2: 27 layers, width 1024, 12 heads of 128, MLP 4096, ~0.4B
# parameters; the values third-party checks of the released config.json pin), in the same spelling;
# `_nest` adds text_hidden_size (the text model's width)
K3_VISION_CONFIG: dict[str, Any] = {
    **TINY_VISION_CONFIG, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27, "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "qkv_hidden_size": 1536,
    "mm_hidden_size": 1024,
}


def _nest(text: dict[str, Any], *, media_placeholder: int, vision: bool = True,
          vision_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Wrap a text config as the published nested `kimi_k3` config."""
    top: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"], "media_placeholder_token_id": media_placeholder,
        "ignore_index": -100, "image_placeholder": "<|kimi_image_placeholder|>",
        "dtype": text["dtype"],
        "text_config": text,
        "quantization_config": copy.deepcopy(text.get("quantization_config")),
    }
    if vision_config is not None:
        top["vision_config"] = {**copy.deepcopy(vision_config), "text_hidden_size": text["hidden_size"]}
    elif vision:  # K3's MoonViT tower (k3.vision builds it)
        top["vision_config"] = {**copy.deepcopy(K3_VISION_CONFIG), "text_hidden_size": text["hidden_size"]}
    if top["quantization_config"] is None:
        del top["quantization_config"]
    return top


def kimi_k3() -> dict[str, Any]:
    return _nest(_k3_text(), media_placeholder=163605)


def kimi_k3_1_pro() -> dict[str, Any]:
    text = _k3_text()
    text.update(index_n_heads=32, index_head_dim=128, index_topk=2048)
    return _nest(text, media_placeholder=163605)


def kimi_linear_48b_a3b() -> dict[str, Any]:
    """The published Kimi-Linear-48B-A3B config (flat)."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
        "intermediate_size": 9216, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "model_max_length": 1048576,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": True,
        "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
        "moe_intermediate_size": 1024, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 2.446, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0, "rope_theta": 10000.0, "rope_scaling": None,
        "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                               **_layer_lists(27, [4, 8, 12, 16, 20, 24, 27])},
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
    }


def _tiny_text() -> dict[str, Any]:
    """k3-tiny: K3's structure at CPU size.

    8 layers: MLA at 0-based 3, 6, 7 (the last two both MLA, as in K3), KDA elsewhere; layer 0
    dense; AttnRes blocks of 3 layers (embedding + 2 completed blocks + a partial);
    LatentMoE (latent 32) with 8 MXFP4 experts, top-2, and two shared experts.
    """
    return {
        "model_type": "kimi_linear",
        "vocab_size": COMPACT_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 128, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "attn_res_block_size": 3,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               **_layer_lists(8, [4, 7, 8])},
        "bos_token_id": compact_special_id(163584),
        "eos_token_id": compact_special_id(163586),      # <|end_of_msg|>
        "pad_token_id": compact_special_id(163839),
        "dtype": "bfloat16",
        "quantization_config": _mxfp4_quantization(),
    }


def k3_tiny() -> dict[str, Any]:
    """K3's structure at CPU size with a tiny MoonViT tower and projector (k3.vision): serves images."""
    return _nest(_tiny_text(), media_placeholder=compact_special_id(163605), vision_config=TINY_VISION_CONFIG)


def k3_tiny_vision() -> dict[str, Any]:
    """The same as k3-tiny (the name from before k3-tiny had a tower)."""
    return k3_tiny()


def k3_tiny_text() -> dict[str, Any]:
    """k3-tiny without a vision tower (identical text weights): a model that takes no images."""
    return _nest(_tiny_text(), media_placeholder=compact_special_id(163605), vision=False)


def k3_tiny_tiles() -> dict[str, Any]:
    """k3-tiny's text model with routed experts that divide into the 128 x 64 MXFP4 tiles of
    `k3.quant.mxfp4_tiles` (latent 128, expert width 64): a platform that repacks the experts
    tile-major (the nvidia plugin's moe_experts_bf16) does so on this model, so the model cases
    run that layout end to end."""
    text = _tiny_text()
    text.update(routed_expert_hidden_size=128, moe_intermediate_size=64)
    return _nest(text, media_placeholder=compact_special_id(163605), vision=False)


def k3_tiny_mtp() -> dict[str, Any]:
    """k3-tiny with one MTP layer (index 8: MLA, LatentMoE), for the "mtp" speculative method."""
    text = _tiny_text()
    text["num_nextn_predict_layers"] = 1
    return _nest(text, media_placeholder=compact_special_id(163605), vision=False)


def k3_1_pro_tiny() -> dict[str, Any]:
    """k3-tiny plus a DSA indexer whose top-16 is smaller than test contexts (sparsity is exercised).

    16 index heads (K3.1 Pro has 32): with random weights a score is exactly 0 when every head's
    ReLU is (probability 2^-heads), and exact ties at the top-k cut are broken differently by
    different top-k implementations; with 4 heads they were common enough to make an oracle
    comparison meaningless, with 16 they are about one pair in 65,000."""
    text = _tiny_text()
    text.update(index_n_heads=16, index_head_dim=32, index_topk=16)
    return _nest(text, media_placeholder=compact_special_id(163605), vision=False)


def kimi_linear_tiny() -> dict[str, Any]:
    """Kimi-Linear's structure at CPU size: softplus gate, low-rank output gate, plain q_proj,
    SiLU, no AttnRes, no latent, routed scaling 2.446, bf16 experts."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": COMPACT_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "model_max_length": 4096,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "mla_use_nope": True,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 32, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 2.446, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                               **_layer_lists(6, [4, 6])},
        "bos_token_id": compact_special_id(163584),
        "eos_token_id": compact_special_id(163586),      # <|im_end|> in the K2-style vocabulary
        "pad_token_id": compact_special_id(163839),
        "dtype": "bfloat16",
    }


def k3_slice() -> dict[str, Any]:
    """12 layers of real K3 width: MLA at 1-based 4, 8, 12; one AttnRes block; 128 experts top-16."""
    text = _k3_text()
    text.update(num_hidden_layers=12, num_experts=128)
    text["linear_attn_config"].update(_layer_lists(12, [4, 8, 12]))
    return _nest(text, media_placeholder=163605)


def k3_tiny_dspark() -> dict[str, Any]:
    """A DSpark-style draft (`k3_dspark`) for k3-tiny: 2 MLA layers with RoPE, taps after target
    layers 1, 4 and 6, a 4-token query block, a rank-16 Markov head; the mask token is a
    reserved special token of the compact vocabulary."""
    return {
        "model_type": "k3_dspark", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "intermediate_size": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "vocab_size": COMPACT_VOCAB_SIZE, "target_hidden_size": 64, "target_layer_ids": [1, 4, 6],
        "block_size": 4, "mask_token_id": compact_special_id(163700), "markov_rank": 16, "dtype": "bfloat16",
    }


# Draft models (speculative decoding) for the presets above: `k3 checkpoint init` writes them.
DRAFT_PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "k3-tiny-dspark": k3_tiny_dspark,
}


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "kimi-k3": kimi_k3,
    "kimi-k3.1-pro": kimi_k3_1_pro,
    "kimi-linear-48b-a3b": kimi_linear_48b_a3b,
    "k3-tiny": k3_tiny,
    "k3-tiny-mtp": k3_tiny_mtp,
    "k3-tiny-vision": k3_tiny_vision,
    "k3-tiny-text": k3_tiny_text,
    "k3-tiny-tiles": k3_tiny_tiles,
    "k3.1-pro-tiny": k3_1_pro_tiny,
    "kimi-linear-tiny": kimi_linear_tiny,
    "k3-slice": k3_slice,
}


def preset_dict(name: str) -> dict[str, Any]:
    """The config.json dict of a preset (a fresh copy)."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
