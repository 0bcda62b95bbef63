"""AMD's AITER fused ops behind k3's kernel entries: lazy, guarded wrappers, **never executed**
(no AMD GPU has been reachable; AITER raises on import without ROCm).

Served only when K3_AMD_AITER=1 and `aiter` imports on a ROCm device (`load`); the platform's
capabilities then claim `aiter`, which the AITER conformance samples require (skipped by
capability elsewhere). Each wrapper takes the entry's default (Triton, or the reference op) as
`fallback` for the inputs AITER does not take. The argument mapping follows amd-aiter
0.1.7.post2.dev18's Python signatures (`aiter.rmsnorm2d_fwd_with_add`, `aiter.fused_moe`,
`aiter.mla.mla_decode_fwd`); tests/unit/plugin/test_amd_aiter.py checks it against a fake
module, which is a check of the mapping, not of AITER's numerics.

- `add_rms_norm` (elementwise.add_rms_norm): `rmsnorm2d_fwd_with_add(out, x, residual_in,
  residual_out, weight, eps)`, bf16 / fp16.
- `experts_forward` (moe.experts): `fused_moe` over MXFP4 experts (QuantType.per_1x32: AITER's
  A16W4 / A8W4 kernels, as its tuned configuration picks for the arch), SiLU-GLU only (AITER has
  no SiTU: K3's routed experts go to the fallback); weights shuffled once into AITER's layout;
  other ranks' experts get weight 0 (AITER's expert_mask needs the global expert count).
- `mla_decode` (mla.decode): `mla_decode_fwd` over bf16 pages viewed as one-token pages, each
  query token its own batch entry whose kv_indices are the cache rows it attends to (its causal
  prefix, or its DSA selection): one host synchronisation per call for the total row count.
"""

from __future__ import annotations

import functools
import os

import torch

from k3.plugin.kernels import NormedResidual

ENV = "K3_AMD_AITER"
DEVICE_TYPE = "cuda"           # torch's name of a ROCm device (tests of the mapping set "cpu")


class AiterUnavailable(RuntimeError):
    """AITER cannot serve here; the message says why."""


def enabled() -> bool:
    """Whether K3_AMD_AITER opts in ("1", "true", "yes", "on")."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def load():
    """The `aiter` module on a ROCm device, imported once; AiterUnavailable (with the reason)
    without a ROCm build of torch, without a visible GPU or when the import fails."""
    if not torch.version.hip:
        raise AiterUnavailable("not a ROCm build of torch (AITER runs on ROCm only)")
    if not torch.cuda.is_available():
        raise AiterUnavailable("no ROCm GPU is visible")
    try:
        import aiter
    except Exception as e:                   # AITER raises more than ImportError without its runtime
        raise AiterUnavailable(f"`import aiter` failed ({type(e).__name__}: {e}); pip install 'k3[amd]'") from e
    return aiter


def status() -> tuple[bool, str]:
    """(serves, reason): whether the AITER wrappers serve here, and why not."""
    if not enabled():
        return False, f"{ENV} is not set (AITER paths are opt-in: never executed)"
    try:
        load()
    except AiterUnavailable as e:
        return False, str(e)
    return True, "aiter imports on this ROCm device"


# ------------------------------------------------------------------------------ RMSNorm + add

def add_rms_norm(x, residual, weight, eps, *, fallback):
    """`k3.reference.add_rms_norm` (same contract) by AITER's fused add + RMSNorm."""
    if not (x.device.type == DEVICE_TYPE and x.dtype == residual.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and weight is not None and x.shape == residual.shape):
        return fallback(x, residual, weight, eps)
    aiter = load()
    shape = x.shape
    x2, r2 = x.reshape(-1, shape[-1]).contiguous(), residual.reshape(-1, shape[-1]).contiguous()
    out, total = torch.empty_like(x2), torch.empty_like(r2)
    aiter.rmsnorm2d_fwd_with_add(out, x2, r2, total, weight.to(x.dtype).contiguous(), float(eps))
    return NormedResidual(out.view(shape), total.view(shape))


# ---------------------------------------------------------------------------- routed experts

_SHUFFLED: dict[tuple, tuple] = {}


def _shuffled(weight):
    """AITER's layout of one MXFP4 weight, made once per storage: codes shuffled in 16 x 16 tiles
    as fp4x2, E8M0 scales in its scale shuffle as float8_e8m0fnu (flattened to [E * N, K / 32])."""
    key = (weight.packed.data_ptr(), weight.scales.data_ptr(), tuple(weight.packed.shape))
    if key not in _SHUFFLED:
        _SHUFFLED[key] = _shuffle(weight)
    return _SHUFFLED[key]


def _shuffle(weight):
    aiter = load()
    from aiter.ops.shuffle import shuffle_weight
    from aiter.utility import fp4_utils

    codes = shuffle_weight(weight.packed.view(aiter.dtypes.fp4x2), layout=(16, 16))
    e, n, blocks = weight.scales.shape
    scales = fp4_utils.e8m0_shuffle(weight.scales.reshape(e * n, blocks)).view(aiter.dtypes.fp8_e8m0)
    return codes, scales


def covers_experts(x, w13, w2, activation, beta, linear_beta) -> bool:
    """What AITER's fused MoE takes: bf16 activations on the device, MXFP4 experts, SiLU-GLU."""
    from k3.quant.mxfp4 import MXFP4Tensor

    return (isinstance(w13, MXFP4Tensor) and isinstance(w2, MXFP4Tensor) and x.device.type == DEVICE_TYPE
            and x.dtype == torch.bfloat16 and activation == "silu" and beta is None and linear_beta is None)


def experts_forward(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None, expert_start=0,
                    dense_dispatch=False, fallback):
    """`k3.reference.experts_forward` (same contract) by AITER's fused MoE (module docstring)."""
    if not covers_experts(x, w13, w2, activation, beta, linear_beta):
        return fallback(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                        linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=dense_dispatch)
    aiter = load()
    local = topk_ids - expert_start
    mine = (local >= 0) & (local < w13.shape[0])
    ids = torch.where(mine, local, 0).to(torch.int32)                 # other ranks' experts: weight 0
    weights = torch.where(mine, topk_weights.float(), 0.0)
    (w1, s1), (w2q, s2) = _shuffled(w13), _shuffled(w2)
    return aiter.fused_moe(x, w1, w2q, weights, ids, activation=aiter.ActivationType.Silu,
                           quant_type=aiter.QuantType.per_1x32, w1_scale=s1, w2_scale=s2).to(x.dtype)


# -------------------------------------------------------------------------------- MLA decode

def mla_rows(block_table, seq_lens, seq_of, q_pos, page: int, topk_indices=None):
    """(kv_indptr int32 [T+1], kv_indices int32 [rows]): per query token the cache rows (page *
    page_size + offset) it attends to, in position order: its causal prefix, or its DSA
    selection (each position once, causal). One host synchronisation (the row count)."""
    from k3.platforms.torch_kernels.mla_selection import unique_selection

    end = torch.minimum(seq_lens.long()[seq_of], q_pos + 1)            # [T] causal length
    max_kv = block_table.shape[1] * page
    if topk_indices is None:
        pos = torch.arange(max_kv, device=block_table.device).expand(end.shape[0], -1)
    else:
        pos = unique_selection(topk_indices, max_kv).long()
    valid = (pos >= 0) & (pos < end[:, None])
    safe = torch.where(valid, pos, 0)
    rows = block_table.long()[seq_of[:, None], safe // page] * page + safe % page
    indptr = torch.zeros(end.shape[0] + 1, dtype=torch.int32, device=rows.device)
    indptr[1:] = valid.sum(-1).cumsum(0)
    return indptr, rows[valid].to(torch.int32)


def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, w_uk, w_uv, *, scale, cu_seqlens_q=None,
               kv_cache_scale=None, topk_indices=None, fallback):
    """`k3.reference.mla_decode` (same contract) by AITER's MLA decode (module docstring)."""
    from k3.platforms.torch_kernels.mla_selection import query_positions

    if not (q_nope.device.type == DEVICE_TYPE and kv_cache.dtype == torch.bfloat16 and kv_cache.is_contiguous()):
        return fallback(q_nope, q_pe, kv_cache, block_table, seq_lens, w_uk, w_uv, scale=scale,
                        cu_seqlens_q=cu_seqlens_q, kv_cache_scale=kv_cache_scale, topk_indices=topk_indices)
    aiter = load()
    t, h, _ = q_nope.shape
    r = w_uk.shape[-1]
    page = kv_cache.shape[1]
    seq_of, q_pos = query_positions(t, seq_lens, cu_seqlens_q)
    kv_indptr, kv_indices = mla_rows(block_table, seq_lens, seq_of, q_pos, page, topk_indices)
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float())
    q = torch.cat([q_lat, q_pe.float()], -1).to(torch.bfloat16).contiguous()          # [T, H, R + Dr]
    out = torch.empty(t, h, r, dtype=torch.bfloat16, device=q.device)
    one_token = kv_cache.view(-1, 1, 1, kv_cache.shape[-1])                             # [rows, 1, 1, R + Dr]
    qo_indptr = torch.arange(t + 1, dtype=torch.int32, device=q.device)
    last_page_lens = torch.ones(t, dtype=torch.int32, device=q.device)
    aiter.mla.mla_decode_fwd(q, one_token, out, qo_indptr, kv_indptr, kv_indices, last_page_lens, 1,
                             sm_scale=float(scale))
    return torch.einsum("thr,hrv->thv", out.float(), w_uv.float()).to(q_nope.dtype)
