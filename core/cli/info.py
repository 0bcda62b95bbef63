"""`k3 info`: architecture summary of a preset or checkpoint (stdout: the report or JSON only)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from k3.config import K3Config

from .common import add_model_arguments, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")


def summarize(cfg: K3Config) -> dict[str, Any]:
    """Everything `k3 info` reports, as plain data."""
    from k3.cache.records import attention_bytes_per_token, index_record_bytes, kda_state_bytes
    from k3.model.params import count_parameters

    la = cfg.linear_attn
    params = count_parameters(cfg)
    out: dict[str, Any] = {
        "family": cfg.family,
        "total_parameters": params.total,
        "active_parameters": params.active,
        "model_type": cfg.model_type,
        "dtype": cfg.dtype,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": list(cfg.layer_types),
        "kda_layers": list(cfg.kda_layer_ids),
        "mla_layers": list(cfg.mla_layer_ids),
        "dense_ffn_layers": [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)],
        "moe_layers": [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)],
        "attn_res": None if not cfg.uses_attn_res else {
            "block_size": cfg.attn_res_block_size,
            "completed_blocks": cfg.num_attn_res_blocks,
            "max_sources": cfg.num_attn_res_blocks + 1,
            "block_write_layers": list(range(0, cfg.num_hidden_layers, cfg.attn_res_block_size)),
        },
        "kda": None if la is None else {
            "num_heads": la.num_heads, "head_dim": la.head_dim,
            "short_conv_kernel_size": la.short_conv_kernel_size,
            "gate": "bounded sigmoid" if la.gate_lower_bound is not None else "softplus",
            "gate_lower_bound": la.gate_lower_bound,
            "output_gate": "full rank" if la.use_full_rank_gate else "low rank",
        },
        "mla": None if not cfg.mla_layer_ids else {
            "num_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_head_dim": cfg.mla_qk_head_dim,
            "v_head_dim": cfg.v_head_dim, "rotary": False, "output_gate": cfg.mla_use_output_gate,
            "latent_elements_per_token": cfg.mla_latent_size,
        },
        "dsa": None if not cfg.uses_dsa else {
            "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
            "index_topk": cfg.index_topk,
        },
        "moe": None if cfg.num_experts is None else {
            "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
            "expert_intermediate_size": cfg.moe_intermediate_size,
            "expert_hidden_size": cfg.expert_hidden_size, "latent": cfg.uses_latent_moe,
            "latent_norm": cfg.latent_moe_use_norm,
            "shared_intermediate_size": cfg.shared_expert_intermediate_size,
            "router": cfg.moe_router_activation_func, "routed_scaling_factor": cfg.routed_scaling_factor,
            "expert_format": _expert_format(cfg),
        },
        "cache": {
            "attention_bytes_per_token": {dt: attention_bytes_per_token(cfg, kv_cache_dtype=dt)
                                          for dt in ("bf16", "fp8")},
            "index_key_bytes_per_token_per_layer": index_record_bytes(cfg, "fp8"),
            "kda_state_bytes_per_request": kda_state_bytes(cfg),
        },
        "activation": cfg.hidden_act if cfg.hidden_act != "situ" else
            f"situ (beta {cfg.situ_beta:g}, linear beta {cfg.activation_situ_linear_beta})",
        "special_tokens": {"bos": cfg.bos_token_id, "eos": list(cfg.eos_token_ids),
                           "pad": cfg.pad_token_id, "media_placeholder": cfg.media_placeholder_token_id},
        "notes": list(cfg.notes),
    }
    return out


def _expert_format(cfg) -> str:
    """How the checkpoint stores the routed experts (and how k3 holds them)."""
    if cfg.experts_mxfp4:
        return "mxfp4"
    if cfg.experts_int4:
        return f"w4a16 (int4, group {cfg.quantization.group_size}; dequantised to the model dtype at load)"
    return cfg.dtype


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    if not ids:
        return "none"
    parts, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def render(s: dict[str, Any]) -> str:
    c = s["cache"]
    lines = [f"{s['family']} ({s['model_type']}, {s['dtype']})",
             f"  parameters: {_count(s['total_parameters'])} total, {_count(s['active_parameters'])} active per token",
             f"  width {s['hidden_size']}, {s['num_hidden_layers']} layers, vocabulary {s['vocab_size']}, "
             f"context {s['max_position_embeddings']}",
             f"  KDA layers (0-based): {_ranges(s['kda_layers'])}",
             f"  MLA layers (0-based): {_ranges(s['mla_layers'])}",
             f"  FFN: dense at {_ranges(s['dense_ffn_layers'])}; MoE at {_ranges(s['moe_layers'])}; "
             f"activation {s['activation']}"]
    if s["attn_res"]:
        a = s["attn_res"]
        lines.append(f"  AttnRes: blocks of {a['block_size']} layers, {a['completed_blocks']} completed "
                     f"blocks + the partial sum (at most {a['max_sources']} sources)")
    else:
        lines.append("  residual: plain pre-norm stream (no AttnRes)")
    if s["kda"]:
        k = s["kda"]
        lines.append(f"  KDA: {k['num_heads']} heads x {k['head_dim']}, conv {k['short_conv_kernel_size']}, "
                     f"{k['gate']} gate, {k['output_gate']} output gate")
    if s["mla"]:
        m = s["mla"]
        lines.append(f"  MLA: {m['num_heads']} heads, q rank {m['q_lora_rank']}, latent {m['kv_lora_rank']} "
                     f"+ {m['latent_elements_per_token'] - m['kv_lora_rank']} (NoPE), qk {m['qk_head_dim']}, "
                     f"v {m['v_head_dim']}, output gate {m['output_gate']}")
    if s["dsa"]:
        d = s["dsa"]
        lines.append(f"  DSA indexer: {d['index_n_heads']} heads x {d['index_head_dim']}, top-{d['index_topk']}")
    if s["moe"]:
        m = s["moe"]
        lines.append(f"  MoE: {m['num_experts']} experts top-{m['top_k']} ({m['expert_format']}), expert width "
                     f"{m['expert_intermediate_size']} in {m['expert_hidden_size']}"
                     f"{' (latent, normed)' if m['latent_norm'] else ' (latent)' if m['latent'] else ''}, "
                     f"shared {m['shared_intermediate_size']}, {m['router']} router x{m['routed_scaling_factor']:g}")
    per_token = c["attention_bytes_per_token"]
    lines.append(f"  cache: {per_token['bf16']:,} B/token with bf16 latents ({per_token['fp8']:,} with fp8)"
                 + (" incl. fp8 index keys" if s["dsa"] else "")
                 + f"; KDA state {c['kda_state_bytes_per_request'] / 2**20:,.1f} MiB per request (TP 1)")
    for note in s["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    summary = summarize(cfg)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(summary))
    return 0
