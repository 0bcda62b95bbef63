"""K3.1 Pro's DSA indexer from implementations k3 did not write.

vLLM's kimi_k3 model has no sparse indexer (every K3 MLA layer is built dense), so the
selection comes from HF transformers' DeepSeek-V3.2 indexer (`DeepseekV32Indexer`: index
queries from the MLA query latent through `wq_b`, one LayerNorm-ed key per token through `wk` /
`k_norm`, per-head weights from `weights_proj` scaled by n_heads^-0.5 * head_dim^-0.5, ReLU
scores, causal top-k), loaded with the checkpoint's `self_attn.indexer.*` tensors. K3.1 Pro is
NoPE, so the indexer's rotary embedding is the identity (cos 1, sin 0).

transformers scores in full precision and skips the Hadamard rotation and the FP8 rounding of
DeepSeek's reference (the rotation is orthogonal, the FP8 rounding a precision choice). K3.1 Pro
follows the reference there (DESIGN.md "Decisions"): keys are cached rotated in FP8 with one
fp32 scale amax / 448 per token, and queries are rounded to FP8 per (token, head) the same way
before scoring (`act_quant` + `fp8_index`). That rounding moves scores enough to change a top-k
on random weights, so the oracle's keys and queries get it too, written here from the reference
semantics with the Sylvester Hadamard matrix built below: x -> H^T dequant(fp8(H x)), so that
q' . k' = dequant(fp8(H q)) . dequant(fp8(H k)).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def sylvester_hadamard(n: int) -> torch.Tensor:
    """H_n / sqrt(n), H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]] (n a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def fp8_rounded(k: torch.Tensor) -> torch.Tensor:
    """k [..., D] -> H^T dequant(fp8(H k)): the vector as the FP8 indexer sees it, in k's basis
    (float64; one scale per row)."""
    d = k.shape[-1]
    h = sylvester_hadamard(d)                                            # symmetric, orthonormal
    rotated = k.to(torch.float64) @ h
    scale = (rotated.abs().amax(-1, keepdim=True) / 448.0).to(torch.float32).to(torch.float64)
    stored = (rotated / scale).to(torch.float8_e4m3fn).to(torch.float64) * scale
    return stored @ h.t()


class OracleIndexer:
    """transformers' DeepseekV32Indexer for one K3.1 Pro MLA layer, in float64."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, hidden_size: int, q_lora_rank: int, n_heads: int,
                 head_dim: int, topk: int, rope_dim: int):
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

        config = SimpleNamespace(hidden_size=hidden_size, index_n_heads=n_heads, index_head_dim=head_dim,
                                 qk_rope_head_dim=rope_dim, index_topk=topk, q_lora_rank=q_lora_rank)
        self.module = DeepseekV32Indexer(config, layer_idx=0).to(torch.float64).eval()
        missing, unexpected = self.module.load_state_dict({k: v.to(torch.float64) for k, v in tensors.items()},
                                                          strict=True)
        assert not missing and not unexpected
        norm, wq_b = self.module.k_norm, self.module.wq_b
        key, query = norm.forward, wq_b.forward
        norm.forward = lambda x: fp8_rounded(key(x))
        wq_b.forward = lambda c: fp8_rounded(query(c).unflatten(-1, (n_heads, head_dim))).flatten(-2)
        self.rope_dim = rope_dim
        self.ties_at_cut = 0          # rows so far whose top-k cut fell on a tie (see _ties_at_cut)

    @torch.no_grad()
    def select(self, x: torch.Tensor, q_latent: torch.Tensor) -> torch.Tensor:
        """x [T, d] the layer input, q_latent [T, q_lora_rank] the normed MLA query latent ->
        allowed [T, T] bool: the causal positions each query attends to."""
        t = x.shape[0]
        cos = torch.ones(1, t, self.rope_dim, dtype=torch.float64)
        sin = torch.zeros(1, t, self.rope_dim, dtype=torch.float64)
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None]
        picked = self.module(x.to(torch.float64)[None], q_latent.to(torch.float64)[None], (cos, sin), causal,
                             None)[0].long()                                   # [T, k]
        allowed = torch.zeros(t, t, dtype=torch.bool).scatter(1, picked, True) & causal[0]
        self.ties_at_cut += self._ties_at_cut(x, q_latent, allowed)
        return allowed

    def _ties_at_cut(self, x: torch.Tensor, q_latent: torch.Tensor, allowed: torch.Tensor) -> int:
        """Rows whose best unselected causal position scores exactly as the worst selected one:
        there any top-k is as right as another, so k3's (lower position wins) may differ."""
        m = self.module
        t, heads, dim = x.shape[0], m.n_heads, m.head_dim
        q = m.wq_b(q_latent.to(torch.float64)).view(t, heads, dim)
        k = m.k_norm(m.wk(x.to(torch.float64)))
        w = m.weights_proj(x.to(torch.float64)) * heads ** -0.5 * m.softmax_scale
        scores = (w[:, :, None] * torch.relu(torch.einsum("thd,sd->ths", q, k))).sum(1)     # [T, T]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        kept = scores.masked_fill(~allowed, float("inf")).amin(-1)
        dropped = scores.masked_fill(allowed | ~causal, float("-inf")).amax(-1)
        return int((kept == dropped).sum())
