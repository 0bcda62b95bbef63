"""KDA mixer (Kimi Delta Attention layer), sharded by heads under tensor parallelism.

Projections q, k, v, the output gate and the decay go through a short causal conv (q, k, v
only, SiLU), per-head L2 norm (q and k), the KDA gate and beta = sigmoid(b), the chunked KDA
recurrence from the sequence's cached state, a per-head gated RMSNorm and o_proj (reduced over
ranks). K3: full-rank `g_proj` and the bounded gate; Kimi-Linear: low-rank `g_a_proj` /
`g_b_proj` and the softplus gate.
"""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.model.metadata import CacheViews, ForwardMetadata, ForwardMode
from k3.plugin.tables import KernelSet

from .kda_verify import commit_records, verify
from .lora import apply_lora
from .module import K3Module
from .parallel import ParallelContext


def checkpoint_offsets(meta: ForwardMetadata):
    """(offsets [N, C] into this call's tokens, valid [N, C], destination rows [N, C]) of the
    KDA checkpoints (`meta.checkpoints`) that fall inside this prefill chunk, or None. A
    checkpoint at absolute position p (the state after p tokens) lies in the chunk when
    context_len <= p <= context_len + q_len; others point at the chunk end and are not written."""
    if meta.checkpoints is None:
        return None
    positions = meta.checkpoints.positions
    q_lens = meta.q_lens[:, None]
    rel = positions - meta.context_lens[:, None]                               # [N, C]
    valid = (positions >= 0) & (rel >= 0) & (rel <= q_lens)
    if not bool(valid.any()):
        return None
    return torch.where(valid, rel, q_lens), valid, meta.checkpoints.state_indices


class KDAMixer(K3Module):
    # the products a LoRA adapter may add to (`k3.model.lora`): q/k/v/g (or g_a)/f_a/b, f_b, g_b, o
    LORA_PARAMS = ("in_proj", "f_b_proj", "g_b_proj", "o_proj")

    def __init__(self, cfg: K3Config, *, kda_index: int, kernels: KernelSet, parallel: ParallelContext,
                 dtype: torch.dtype, device=None):
        super().__init__()
        la = cfg.linear_attn
        self.cfg, self.kernels, self.parallel, self.kda_index = cfg, kernels, parallel, kda_index
        self.head_dim = la.head_dim
        h0, self.num_heads = parallel.shard(la.num_heads, "linear_attn_config.num_heads")
        d, hd, hl = cfg.hidden_size, la.head_dim, self.num_heads
        p_full, p_local, c0 = la.num_heads * hd, hl * hd, h0 * hd
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        rows = (0, c0, p_local)

        # the config fields behind each weight's dimensions (named in shape errors)
        H, HD, D = "linear_attn_config.num_heads", "linear_attn_config.head_dim", "hidden_size"
        P = f"{H} * {HD}"

        def proj(name, full_rows, local_rows, start, in_dim, dims):
            self.add_weight(name, (local_rows, in_dim), dtype, device,
                            full_shape=(full_rows, in_dim), shard=(0, start, local_rows), dims=dims)

        # The low-rank projections (the decay's f_a / f_b, Kimi-Linear's output gate g_a / g_b)
        # have rank head_dim, as vLLM and transformers build them (128 in every published
        # checkpoint). Every projection of x is fused into one weight (one launch a step), rows in
        # this order: q, k, v [P each], the output gate g [P] (Kimi-Linear: its low-rank g_a
        # [rank]), the decay's f_a [rank], beta's b [H]; `_project` splits the product.
        rank = hd
        full_gate = la.use_full_rank_gate
        parts = [(f"{name}.weight", (p_full, d), rows, (P, D)) for name in ("q_proj", "k_proj", "v_proj")]
        parts.append(("g_proj.weight", (p_full, d), rows, (P, D)) if full_gate
                     else ("g_a_proj.weight", (rank, d), None, (HD, D)))
        parts += [("f_a_proj.weight", (rank, d), None, (HD, D)),
                  ("b_proj.weight", (la.num_heads, d), (0, h0, hl), (H, D))]
        q, kk, v, *rest = self.add_fused_weight("in_proj", parts, dtype, device)
        self.in_proj_split = (q + kk + v, *rest)                               # qkv, g (or g_a), f_a, b
        # the short-conv weights of q, k and v likewise: the [3P, W] view the kernels take
        w = la.short_conv_kernel_size
        conv_dims = (P, "1", "linear_attn_config.short_conv_kernel_size")
        self.add_fused_weight("qkv_conv1d", [(f"{part}_conv1d.weight", (p_full, 1, w), rows, conv_dims)
                                             for part in "qkv"], dtype, device, alt_shapes=((p_full, w),))
        proj("f_b_proj", p_full, p_local, c0, rank, (P, HD))
        if not full_gate:
            proj("g_b_proj", p_full, p_local, c0, rank, (P, HD))
        self.add_weight("A_log", (hl,), state_dtype, device, checkpoint="A_log", full_shape=(la.num_heads,),
                        shard=(0, h0, hl), alt_shapes=((1, 1, la.num_heads, 1),), dims=(H,))
        self.add_weight("dt_bias", (p_local,), state_dtype, device, checkpoint="dt_bias",
                        full_shape=(p_full,), shard=rows, dims=(P,))
        self.add_weight("o_norm", (hd,), dtype, device, dims=(HD,))
        self.add_weight("o_proj", (d, p_local), dtype, device, full_shape=(d, p_full), shard=(1, c0, p_local),
                        dims=(D, P))

    def _project(self, x: torch.Tensor, lora=None) -> tuple[torch.Tensor, ...]:
        """x [T, d] through the fused `in_proj`: (qkv [T, 3P], output gate [T, H, K], f [T, H, K]
        (after f_b), b [T, H]); qkv and b are column views of one product. lora: the rows'
        adapters (`ForwardMetadata.lora`), None for the base model."""
        t, hl, hd = x.shape[0], self.num_heads, self.head_dim
        linear = self.kernels.dense.linear
        qkv, g, f_a, b = apply_lora(self, "in_proj", x, linear(x, self.in_proj), lora).split(self.in_proj_split, -1)
        if not self.cfg.linear_attn.use_full_rank_gate:
            g = apply_lora(self, "g_b_proj", g, linear(g, self.g_b_proj), lora)
        f = apply_lora(self, "f_b_proj", f_a, linear(f_a, self.f_b_proj), lora)
        return qkv, g.reshape(t, hl, hd), f.view(t, hl, hd), b

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, cache: CacheViews,
                *, per_position_states: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, d] (AttnRes-mixed, input_layernorm-ed). Returns (out [T, d] reduced over ranks,
        per-position states [T, H_local, K, V] or None). Reads and writes this layer's state rows.

        A MIXED call (one-token steps first, `meta.num_decodes`) runs them as a decode step and
        the prefill chunks after them as a prefill call, so a decode's output does not depend
        on the chunks sharing its batch (and skips the chunked kernel, which would give each
        one-token sequence a chunk of its own). In the batch-invariant mode every call, decode
        or prefill, takes the one path through the `chunked` entry (docs/batch-invariance.md)."""
        path = self._path(meta, per_position_states)
        if self.kernels.batch_invariant and path in ("split", "fused_decode"):
            path = "recurrent"
        if path == "split":
            o = torch.cat([self._mix(x[cut], part, cache, self._path(part, False))[0]
                           for cut, part in meta.split_decodes()])
            states = None
        else:
            o, states = self._mix(x, meta, cache, path)
        o = apply_lora(self, "o_proj", o, self.kernels.dense.linear(o, self.o_proj), meta.lora)
        return self.parallel.all_reduce(o), states

    @staticmethod
    def _path(meta: ForwardMetadata, per_position_states: bool) -> str:
        """The one dispatch on the call's mode: "split" (MIXED), "fused_decode" (a DECODE call
        saving no prefix-cache checkpoint: one fused `kda.decode_step`), "verify" (VERIFY),
        "per_position" (every token's state asked for) or "recurrent" (PREFILL, and a DECODE
        call that saves a checkpoint)."""
        mode = meta.mode
        if mode is ForwardMode.VERIFY:
            return "verify"
        if per_position_states:
            return "per_position"
        if mode is ForwardMode.MIXED:
            return "split"
        if mode is ForwardMode.DECODE and checkpoint_offsets(meta) is None:
            return "fused_decode"
        return "recurrent"

    def _mix(self, x: torch.Tensor, meta: ForwardMetadata, cache: CacheViews,
             path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer before o_proj on one path (`_path`): (o [T, H_local * V] gated and
        normalised, per-position states or None)."""
        k = self.kernels
        t = x.shape[0]
        hl, hd = self.num_heads, self.head_dim
        rows = meta.state_indices
        fresh = (meta.context_lens == 0)                                        # [N]
        view = cache.kda[self.kda_index]

        qkv, gate, f, b = self._project(x, meta.lora)                                   # qkv [T, 3P]: q | k | v
        conv_w = self.qkv_conv1d.squeeze(1)                                     # [3P, W]
        if path == "fused_decode":
            o = k.kda.decode_step(qkv, conv_w, f, self.A_log, self.dt_bias.view(hl, hd), b, gate, self.o_norm,
                                  view.recurrent, view.conv, rows, fresh,
                                  lower_bound=self.cfg.linear_attn.gate_lower_bound,
                                  norm_eps=self.cfg.rms_norm_eps)                 # [N, H, V], normalised
            return o.reshape(t, hl * hd), None
        # the chunked and verify paths take whole tensors, as the unfused projections gave them
        qkv, gate = qkv.contiguous(), gate.contiguous()
        conv_in = view.conv[rows].masked_fill(fresh[:, None, None], 0)           # [N, 3P, W-1]
        s0 = view.recurrent[rows].masked_fill(fresh[:, None, None, None], 0)     # [N, H, K, V]
        g, beta = self.decay_and_beta(f, b)
        if path == "verify":
            o, states = verify(self, meta, cache, qkv, conv_w, conv_in, s0, g, beta)
        else:
            o, states = self._recur(meta, view, qkv, conv_w, conv_in, s0, g, beta, path == "per_position")
        return self.output_norm(o, gate), states

    def decay_and_beta(self, f: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """f [T, H, K] (after f_b), b [T, H] -> (the log decay g [T, H, K] fp32, beta [T, H])."""
        hl, hd = self.num_heads, self.head_dim
        g = self.kernels.kda.gate(f, self.A_log, self.dt_bias.view(hl, hd),
                                  lower_bound=self.cfg.linear_attn.gate_lower_bound)       # [T, H, K] fp32
        beta = self.kernels.elementwise.sigmoid(b)                              # [T, H]
        return g, beta

    def output_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The recurrence's o [T, H, V] through the gated per-head RMSNorm: [T, H * V]."""
        return self.kernels.elementwise.gated_rms_norm(o, gate, self.o_norm, self.cfg.rms_norm_eps).reshape(
            o.shape[0], self.num_heads * self.head_dim)

    def heads(self, y: torch.Tensor):
        """Conv output [.., 3P] -> L2-normalised q, k and v, each [T, H_local, K]."""
        q, kk, v = y.reshape(-1, 3, self.num_heads, self.head_dim).unbind(1)
        return self.kernels.elementwise.l2_norm(q), self.kernels.elementwise.l2_norm(kk), v

    def _recur(self, meta, view, qkv, conv_w, conv_in, s0, g, beta, per_position_states):
        """Decode and prefill (with prefix-cache checkpoints): returns (o [T, H, V], states)."""
        k, rows, cu, t = self.kernels, meta.state_indices, meta.cu_seqlens, qkv.shape[0]
        # Decode (one token per sequence) runs as a batch of N length-1 sequences: no cu_seqlens,
        # so no host synchronisation; prefill packs the sequences along T with cu_seqlens. The
        # batch-invariant mode packs decodes as prefills do (the same entries for both).
        decode = meta.mode is ForwardMode.DECODE and not self.kernels.batch_invariant
        checkpoints = checkpoint_offsets(meta)
        emit = {} if checkpoints is None or decode else {"checkpoint_offsets": checkpoints[0]}
        if per_position_states and checkpoints is not None:
            raise NotImplementedError("KDA checkpoints are emitted on the chunked path, not with per-position states")
        if decode:
            conv = k.kda.short_conv(qkv.unsqueeze(1), conv_w, conv_state=conv_in)      # y [N, 1, 3P]
        else:
            conv = k.kda.short_conv(qkv.unsqueeze(0), conv_w, conv_state=conv_in, cu_seqlens=cu, **emit)
        conv_out = conv.state
        view.conv[rows] = conv_out
        q, kk, v = self.heads(conv.y)
        shape = (t, 1) if decode else (1, t)                                     # [B, T] of the op
        args = tuple(z.reshape(*shape, *z.shape[1:]) for z in (q, kk, v, g, beta))
        varlen = {} if decode else {"cu_seqlens": cu}
        states = None
        if per_position_states:
            out = k.kda.recurrent(*args, initial_state=s0, output_per_position_states=True, **varlen)
            states = out.states.reshape(t, *out.states.shape[2:])
        elif decode:
            out = k.kda.recurrent(*args, initial_state=s0)
        else:
            out = k.kda.chunked(*args, initial_state=s0, **varlen, **emit)
        o, s1 = out.o, out.state
        view.recurrent[rows] = s1.to(view.recurrent.dtype)
        if checkpoints is not None:     # prefix caching: states at unit boundaries, same pass
            offsets, valid, dest = checkpoints
            for c in range(valid.shape[1]):
                keep = valid[:, c]
                if decode:              # a one-token step: offset 0 is the state before it, 1 after
                    pick = offsets[:, c] == 1
                    state = torch.where(pick[:, None, None, None], s1, s0)
                    window = torch.where(pick[:, None, None], conv_out, conv_in)
                else:
                    state, window = out.checkpoints[c], conv.checkpoints[c]
                view.recurrent[dest[keep, c]] = state[keep].to(view.recurrent.dtype)
                view.conv[dest[keep, c]] = window[keep]
        return o.reshape(t, self.num_heads, self.head_dim), states

    def commit_records(self, cache: CacheViews, slots: torch.Tensor, rows: torch.Tensor,
                       kept: torch.Tensor) -> None:
        """Rollback "recover": rebuild the running state rows after `kept` verified tokens from
        the records of `slots` (see k3.model.kda_verify)."""
        commit_records(self, cache, slots, rows, kept)
