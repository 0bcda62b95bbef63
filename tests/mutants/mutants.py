"""One-line mutations of k3's model math, each a mistake an implementer could plausibly make.

Every mutant must change the tiny models' float64 logits (run_mutants.py checks that first) and
must then make a test fail. `old` must occur exactly once in `path`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str          # relative to the repository root
    old: str
    new: str
    why: str           # the pitfall it models (k3-architecture.md section 7 and friends)


MUTANTS: tuple[Mutant, ...] = (
    Mutant("mla_output_gate_dropped", "core/model/mla.py",
           "o = (o.to(cd) * gate).to(x.dtype)", "o = o.to(x.dtype)",
           "MLA without its sigmoid output gate (Gated MLA)"),
    Mutant("mla_gate_sigmoid_identity", "core/model/mla.py",
           "gate = self.kernels.elementwise.sigmoid(g[0])", "gate = g[0].to(cd)",
           "MLA output gate without the sigmoid"),
    Mutant("kda_output_gate_identity", "core/reference/norms.py",
           "y = y * torch.sigmoid(g)", "y = y * g",
           "KDA gated RMSNorm: gate multiplied raw instead of through sigmoid"),
    Mutant("kda_beta_without_sigmoid", "core/model/kda.py",
           "beta = self.kernels.elementwise.sigmoid(b)", "beta = b.to(g.dtype)",
           "KDA beta used as a raw logit"),
    Mutant("kda_gate_bound_4", "core/model/kda.py",
           "lower_bound=self.cfg.linear_attn.gate_lower_bound)", "lower_bound=-4.0)",
           "KDA bounded gate with -4 instead of the config's -5 (and a bound where Kimi-Linear has none)"),
    Mutant("kda_query_scale_dropped", "core/ops_helpers/kda_inputs.py",
           "scale = K**-0.5 if scale is None else scale", "scale = 1.0 if scale is None else scale",
           "KDA q without the 1/sqrt(K) after its L2 norm"),
    Mutant("short_conv_window_3", "platforms/torch_kernels/short_conv.py",
           "y = sum(xp[:, j: j + L] * w[:, j] for j in range(W))",
           "y = sum(xp[:, j: j + L] * w[:, j] for j in range(1, W))",
           "short conv window off by one (the oldest tap dropped)"),
    Mutant("attn_res_block_boundary_shifted", "core/model/model.py",
           "l, starts_block = layer.layer, layer.layer % block == 0",
           "l, starts_block = layer.layer, (layer.layer + 1) % block == 0",
           "AttnRes blocks start one layer late"),
    Mutant("attn_res_temperature", "core/reference/attn_res.py",
           "logits = (v @ query.to(cd)) * inv_rms",
           "logits = (v @ query.to(cd)) * inv_rms / v.shape[-1] ** 0.5",
           "AttnRes logits scaled by 1/sqrt(d) (K3 has no temperature)"),
    Mutant("attn_res_values_normalised", "core/reference/attn_res.py",
           "return (p.unsqueeze(-1) * v).sum(0).to(sources.dtype)",
           "return (p.unsqueeze(-1) * v * inv_rms.unsqueeze(-1)).sum(0).to(sources.dtype)",
           "AttnRes mixes the normalised sources (values must stay raw)"),
    Mutant("situ_beta_1", "core/model/ffn.py",
           '"beta": cfg.situ_beta if cfg.hidden_act == "situ" else None',
           '"beta": 1.0 if cfg.hidden_act == "situ" else None',
           "SiTU with the library fallback beta 1 instead of the config's 4"),
    Mutant("situ_linear_cap_dropped", "core/model/ffn.py",
           '"linear_beta": cfg.activation_situ_linear_beta if cfg.hidden_act == "situ" else None',
           '"linear_beta": None if cfg.hidden_act == "situ" else None',
           "SiTU without the up-branch soft cap (activation_situ_linear_beta 25)"),
    Mutant("routed_scale_ignored", "core/model/ffn.py",
           "routed_scaling_factor=cfg.routed_scaling_factor", "routed_scaling_factor=1.0",
           "routed_scaling_factor ignored (Kimi-Linear: 2.446)"),
    Mutant("shared_experts_skipped", "core/model/ffn.py",
           "return y if self.shared_experts is None else y + self.shared_experts(h, lora=lora)", "return y",
           "MoE output without the shared experts"),
    Mutant("topk_renormalisation_flipped", "core/model/ffn.py",
           "renormalize=cfg.moe_renormalize", "renormalize=not cfg.moe_renormalize",
           "top-k weights not renormalised"),
    Mutant("router_bias_in_weights", "core/reference/router.py",
           "weights = scores.gather(1, ids)  # [T, k] unbiased", "weights = sel.gather(1, ids)",
           "the selection-only correction bias leaks into the expert weights"),
    Mutant("router_softmax", "core/reference/router.py",
           "scores = torch.sigmoid(lf)  # [T, E]", "scores = torch.softmax(lf, dim=-1)",
           "softmax router scores where K3 uses sigmoid"),
    Mutant("latent_norm_skipped", "core/model/ffn.py",
           "u = self.kernels.elementwise.rms_norm(u, self.routed_expert_norm, cfg.rms_norm_eps)", "u = u",
           "LatentMoE without the RMSNorm on the combined latent"),
    Mutant("rms_norm_eps_ignored", "core/reference/norms.py",
           "y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)",
           "y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)",
           "RMSNorm with the library default eps 1e-6 instead of the config's rms_norm_eps (1e-5)"),
    Mutant("mla_scale_nope_only", "core/config.py",
           "return self.mla_qk_head_dim ** -0.5", "return (self.qk_nope_head_dim or 0) ** -0.5",
           "MLA softmax scale 1/sqrt(128) (NoPE still scales by 1/sqrt(192))"),
    Mutant("mla_rope_on_k_pe", "core/model/mla.py",
           "row = torch.cat([k.elementwise.rms_norm(kv[:, :r], self.kv_a_layernorm, eps), kv[:, r:]], -1)",
           "row = torch.cat([k.elementwise.rms_norm(kv[:, :r], self.kv_a_layernorm, eps), "
           "kv[:, r:] * torch.cos(meta.positions[:, None].to(kv.dtype))], -1)",
           "a positional rotation (RoPE's cosine term) on k_pe where K3 is NoPE"),
    Mutant("dsa_topk_one_short", "core/reference/indexer.py",
           "k = min(topk, L)", "k = min(topk - 1, L)",
           "DSA top-k off by one"),
    Mutant("mxfp4_scale_bias_126", "core/quant/mxfp4.py",
           "E8M0_BIAS = 127", "E8M0_BIAS = 126",
           "MXFP4 E8M0 scale exponent bias off by one"),
)


def misplaced(mutants, root: Path) -> list[str]:
    """Mutants whose line to change does not occur exactly once in its file under `root` (the
    code moved): run_mutants.py refuses to start on them, the main tier's unit test fails."""
    out = []
    for m in mutants:
        path = root / m.path
        count = path.read_text().count(m.old) if path.is_file() else 0
        if count != 1:
            out.append(f"{m.name}: the line to change occurs {count} times in {m.path}")
    return out
