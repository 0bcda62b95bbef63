"""MLA (K3's NoPE multi-head latent attention) kernel entries: `MLAKernels`.

Per token the latent cache holds one row `[c (R) | k_pe (Dr)]`: the latent after
kv_a_layernorm and the shared, never rotated, pe key. `kv_b_proj.weight` is `[H*(Dn+Dv), R]`:
per head Dn rows of k_nope, then Dv rows of v. K3: H = 96, Dn = 128, Dr = 64, Dv = 128,
R = 512, scale = 1/sqrt(Dn+Dr).

Varlen rule (shared with the DSA indexer): sequence n has kv_len_n context tokens and
q_len_n <= kv_len_n queries, its last q_len_n tokens; query i sits at position
kv_len_n - q_len_n + i and attends to positions <= its own. `topk_indices` (int `[T, k]`,
positions within the sequence, -1 padding) restricts a query to the selected positions, still
causally (DSA sparse MLA). A query with nothing to attend to outputs zeros. Both entries return
`[T, H, Dv]` in the query dtype with scores, softmax and sums in the compute dtype, and read
the cache, never write it.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class MLAPrefill(Protocol):
    """`mla.prefill`: the expanded (MHA) form over each sequence's gathered context.

    q `[T, H, Dn+Dr]` (nothing rotated); latent `[S, R]`; k_pe `[S, Dr]`; kv_b_weight
    `[H*(Dn+Dv), R]`; cu_seqlens_q / cu_seqlens_kv int `[N+1]` (kv = each sequence's earlier
    context then its new tokens), read on the host; scale; qk_nope_head_dim (Dn); v_head_dim
    (Dv); topk_indices or None. Returns o `[T, H, Dv]`.
    """

    def __call__(self, q: Tensor, latent: Tensor, k_pe: Tensor, kv_b_weight: Tensor, *, cu_seqlens_q: Tensor,
                 cu_seqlens_kv: Tensor, scale: float, qk_nope_head_dim: int, v_head_dim: int,
                 topk_indices: Tensor | None = None) -> Tensor: ...


class MLADecode(Protocol):
    """`mla.decode`: the absorbed (MQA) form over a paged latent cache (decode, speculative
    verify, and DSA sparse prefill with `cu_seqlens_q` and `topk_indices`).

    q_nope `[T, H, Dn]`, q_pe `[T, H, Dr]`; kv_cache `[P, page_size, R+Dr]` (bf16 / fp32 / fp64,
    or fp8 with a per-tensor fp32 kv_cache_scale); block_table int `[N, max_pages]`: position p
    of sequence n is kv_cache[block_table[n, p // page_size], p % page_size]; seq_lens int
    `[N]`: context including the query tokens (already written); w_uk `[H, Dn, R]`, w_uv
    `[H, R, Dv]`; scale; cu_seqlens_q int `[N+1]` or None (one query per sequence);
    topk_indices or None. Score = [q_nope w_uk | q_pe] . row * scale; the softmax-weighted sum of
    row[:R], times w_uv. Returns o `[T, H, Dv]`. No host synchronisation (pad to
    max_pages * page_size and mask; pages past seq_lens may hold anything, NaN included).
    kv_cache is a strided view of the packed cache (any strides): under a decode graph's context
    bound shorter than one page (`k3.model.paging.bounded_pages`) each page is cut to its first
    `bound` slots, so page_size is always kv_cache.shape[1], never a ratio of strides.
    """

    def __call__(self, q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                 w_uk: Tensor, w_uv: Tensor, *, scale: float, cu_seqlens_q: Tensor | None = None,
                 kv_cache_scale: Tensor | float | None = None, topk_indices: Tensor | None = None) -> Tensor: ...
