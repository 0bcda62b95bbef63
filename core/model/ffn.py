"""FFNs: the dense GLU MLP (layers < first_k_dense_replace) and (Latent)MoE.

Dense MLP and shared experts are split over the TP ranks by intermediate width (a partial sum
each, reduced). Routed experts are split by expert in contiguous blocks: without an EP group
over the TP group (every rank sees every token, the latent partials are reduced across ranks);
with one (`ParallelContext.ep`) over the EP group, each token's rows sent to their experts'
owners by all-to-all (`k3.model.expert_dispatch`). K3's Stable LatentMoE: router and shared
experts read the full hidden state, routed experts live in the latent
(routed_expert_hidden_size), the RMSNorm and the replicated up-projection follow the combine.
Kimi-Linear's MoE has no latent (no down/up/norm).
"""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.plugin.tables import KernelSet
from k3.quant.int4_pack import INT4_PER_WORD, int4_dequantize
from k3.quant.mxfp4 import MXFP4Tensor
from k3.quant.mxfp4_tiles import TileMajorMXFP4, tileable, to_tile_major

from .expert_dispatch import dispatch_combine, peer_rows, tp_slice
from .lora import apply_lora, expert_lora
from .module import K3Module, WeightSpec
from .parallel import ParallelContext


def _activation(cfg: K3Config) -> dict:
    return {"activation": cfg.hidden_act, "beta": cfg.situ_beta if cfg.hidden_act == "situ" else None,
            "linear_beta": cfg.activation_situ_linear_beta if cfg.hidden_act == "situ" else None}


class GLUMLP(K3Module):
    """down(act(gate_up(x))) with gate_proj / up_proj fused into one [2 I_local, d] weight."""

    LORA_PARAMS = ("gate_up_proj", "down_proj")     # what a LoRA adapter may add to (`k3.model.lora`)

    def __init__(self, cfg: K3Config, *, intermediate: int, kernels: KernelSet, parallel: ParallelContext,
                 dtype, device=None, intermediate_field: str = "intermediate_size"):
        super().__init__()
        self.cfg, self.kernels, self.parallel = cfg, kernels, parallel
        d = cfg.hidden_size
        i0, il = parallel.shard(intermediate, "FFN intermediate size")
        self.add_fused_weight("gate_up_proj", [(f"{part}.weight", (intermediate, d), (0, i0, il),
                                                (intermediate_field, "hidden_size"))
                                               for part in ("gate_proj", "up_proj")], dtype, device)
        self.add_weight("down_proj", (d, il), dtype, device, full_shape=(d, intermediate), shard=(1, i0, il),
                        dims=("hidden_size", intermediate_field))

    def forward(self, x: torch.Tensor, *, decode: bool = False, lora=None) -> torch.Tensor:
        """x [T, d] -> [T, d], reduced over ranks. lora: the rows' adapters (`ForwardMetadata.lora`)."""
        linear = self.kernels.dense.linear
        gate_up = apply_lora(self, "gate_up_proj", x, linear(x, self.gate_up_proj), lora)
        a = self.kernels.elementwise.glu_activation(gate_up, **_activation(self.cfg))
        return self.parallel.all_reduce(apply_lora(self, "down_proj", a, linear(a, self.down_proj), lora))


class MoE(K3Module):
    """Routed experts (MXFP4 or dense, stacked [E_local, ...]) plus shared experts.

    W4A16 experts (compressed-tensors `pack-quantized`) load into packed int32 planes and fp32
    scales; `dequantize_int4_experts` turns them into the dense stacks (the model's dtype)
    once every tensor is read, and frees the planes: the kernels see dense experts.

    LoRA adapters (`k3.model.lora`) may add to every routed expert's w1 / w3 / w2 (bf16 adapters
    beside MXFP4 or dense bases) and to the latent projections; a batch with expert adapters
    runs its routed experts on the `lora.experts` kernel entry."""

    LORA_PARAMS = ("w13", "w2", "routed_expert_down_proj", "routed_expert_up_proj")

    def __init__(self, cfg: K3Config, *, kernels: KernelSet, parallel: ParallelContext, dtype, device=None):
        super().__init__()
        self.cfg, self.kernels, self.parallel, self.dtype = cfg, kernels, parallel, dtype
        d, e, lat, inter = cfg.hidden_size, cfg.num_experts, cfg.expert_hidden_size, cfg.moe_intermediate_size
        self.expert_start, self.num_local_experts = parallel.expert_shard(e)
        el = self.num_local_experts
        router_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        # the router runs in fp32 (k3.reference.router_logits upcasts both operands): the gate is
        # held in fp32 from load (an exact upcast of the checkpoint's bf16), so a step does not
        # cast the whole [E, d] weight in every MoE layer (twice its bf16 bytes in memory)
        self.add_weight("gate", (e, d), router_dtype, device, dims=("num_experts", "hidden_size"))
        self.add_weight("e_score_correction_bias", (e,), router_dtype, device,
                        checkpoint="gate.e_score_correction_bias", dims=("num_experts",))
        LAT = "routed_expert_hidden_size" if cfg.uses_latent_moe else "hidden_size"
        if cfg.uses_latent_moe:
            self.add_weight("routed_expert_down_proj", (lat, d), dtype, device, dims=(LAT, "hidden_size"))
            self.add_weight("routed_expert_up_proj", (d, lat), dtype, device, dims=("hidden_size", LAT))
            if cfg.latent_moe_use_norm:
                self.add_weight("routed_expert_norm", (lat,), dtype, device, dims=(LAT,))
        # Experts are stacked [E_local, ...]; w13 holds w1 (gate) rows then w3 (up) rows.
        # MXFP4: compressed-tensors planes per expert, weight_packed [out, in/2] (two logical
        # parameters per byte) and weight_scale [out, in/32] (not parameters). W4A16:
        # weight_packed int32 [out, in/8] and weight_scale [out, in/group], read into fp32.
        stack = (e, self.expert_start, el)
        scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if cfg.experts_mxfp4:
            planes = (("packed", 2, 2, torch.uint8), ("scale", 32, 0, torch.uint8))
        elif cfg.experts_int4:
            planes = (("packed", INT4_PER_WORD, INT4_PER_WORD, torch.int32),
                      ("scale", cfg.quantization.group_size, 0, scale_dtype))
            for param, rows, cols in (("w13", 2 * inter, lat), ("w2", lat, inter)):  # filled at load's end
                setattr(self, param, torch.nn.Parameter(torch.empty((el, rows, cols), dtype=dtype, device=device),
                                                        requires_grad=False))
        else:
            planes = (("", 1, 1, dtype),)
        for param, parts, out_rows, in_dim, dims in (("w13", ("w1", "w3"), inter, lat, ("moe_intermediate_size", LAT)),
                                                     ("w2", ("w2",), lat, inter, (LAT, "moe_intermediate_size"))):
            for plane, in_per_col, per_element, plane_dtype in planes:
                name = f"{param}_{plane}" if plane else param
                width = in_dim // in_per_col
                suffix = f"weight_{plane}" if plane else "weight"
                self.add_weight(
                    name, (el, out_rows * len(parts), width), plane_dtype, device,
                    buffer=bool(plane), sources=[
                        WeightSpec(f"experts.{{expert}}.{part}.{suffix}", name, (out_rows, width),
                                   dest=(slice(j * out_rows, (j + 1) * out_rows),), stack=stack,
                                   logical_per_element=per_element,
                                   dims=dims if in_per_col == 1 else (dims[0], f"{dims[1]} / {in_per_col}"))
                        for j, part in enumerate(parts)])
        self.shared_experts = (GLUMLP(cfg, intermediate=cfg.shared_expert_intermediate_size, kernels=kernels,
                                      parallel=parallel, dtype=dtype, device=device,
                                      intermediate_field="num_shared_experts * moe_intermediate_size")
                               if cfg.num_shared_experts else None)

    def expert_weights(self):
        """(w13, w2) as the reference ops take them: MXFP4Tensor (a TileMajorMXFP4 once
        `hold_experts_tile_major` ran) or dense stacks (W4A16 experts are dense once loaded, MXFP4
        experts once `hold_experts_dense` ran)."""
        if self.cfg.experts_mxfp4 and "w13_packed" in self._buffers:
            return self._planes("w13"), self._planes("w2")
        return self.w13, self.w2

    def _planes(self, param: str) -> MXFP4Tensor:
        kind = TileMajorMXFP4 if getattr(self, "experts_tile_major", False) else MXFP4Tensor
        return kind(self._buffers[f"{param}_packed"], self._buffers[f"{param}_scale"])

    @torch.no_grad()
    def hold_experts_tile_major(self) -> bool:
        """Repack the MXFP4 routed experts' planes tile by tile (`k3.quant.mxfp4_tiles`), for a
        platform whose kernels stream that layout (from its `k3_process_weights`): each weight's
        planes replaced by their tile-major copy (one weight's planes held twice meanwhile);
        `expert_weights` then returns TileMajorMXFP4s, which dequantise as before. Returns
        whether it repacked (False: not MXFP4, already tile-major, dense, or the expert
        dimensions do not divide into 128 x 64 tiles)."""
        if (not self.cfg.experts_mxfp4 or "w13_packed" not in self._buffers
                or getattr(self, "experts_tile_major", False)
                or not all(tileable(self._planes(param)) for param in ("w13", "w2"))):
            return False
        for param in ("w13", "w2"):
            tiles = to_tile_major(self._planes(param))
            self._buffers[f"{param}_packed"], self._buffers[f"{param}_scale"] = tiles.packed, tiles.scales
        self.experts_tile_major = True
        return True

    @torch.no_grad()
    def hold_experts_dense(self) -> int:
        """The expert cache (`k3.engine.expert_cache`): MXFP4 routed experts dequantised once
        (`MXFP4Tensor.dequantize`: exact in bf16 / fp32) into dense stacks w13 [E_local, 2I, L]
        and w2 [E_local, L, I] in the model's dtype, one expert at a time, each weight's planes
        freed once its stack is full; every kernel then sees dense experts. Returns the bytes
        the stacks hold (0: nothing to do, not MXFP4 or done already)."""
        if not self.cfg.experts_mxfp4 or "w13_packed" not in self._buffers:
            return 0
        held = 0
        for param in ("w13", "w2"):
            planes = self._planes(param)                                     # either layout dequantises alike
            dense = torch.empty(planes.shape, dtype=self.dtype, device=planes.device)    # [E_local, out, in]
            for e in range(dense.shape[0]):
                dense[e] = planes.dequantize(self.dtype, index=e)
            del self._buffers[f"{param}_packed"], self._buffers[f"{param}_scale"], planes
            setattr(self, param, torch.nn.Parameter(dense, requires_grad=False))
            held += dense.numel() * dense.element_size()
        return held

    @torch.no_grad()
    def dequantize_int4_experts(self) -> None:
        """W4A16 experts: w13 / w2 = q * scale of the loaded planes (computed in fp32, one
        rounding to the model's dtype, `k3.quant.int4_pack.int4_dequantize`), then the planes
        are freed. Called by the loaders after the last tensor; a no-op otherwise or twice."""
        if not self.cfg.experts_int4 or "w13_packed" not in self._buffers:
            return
        for param in ("w13", "w2"):
            dense = getattr(self, param)
            dense.copy_(int4_dequantize(self._buffers.pop(f"{param}_packed"), self._buffers.pop(f"{param}_scale"),
                                        dtype=dense.dtype))     # [E_local, out, in]

    def forward(self, h: torch.Tensor, *, decode: bool = False, ep_dispatch: str | None = None,
                ep_capacity: int | None = None, lora=None) -> torch.Tensor:
        """h [T, d] -> [T, d]: router and shared experts on h, routed experts in the latent,
        combined (reduced over the TP ranks, or dispatched over the EP group) before the norm and
        the up-projection. decode: dispatch without host synchronisation (every local expert,
        masked; without EP). ep_dispatch / ep_capacity: this step's EP dispatch and static
        capacity (None: `ExpertParallel.dispatch` / `.capacity`), the same on every EP rank."""
        ep = self.parallel.ep
        if ep is None:
            u = self.parallel.all_reduce(self._routed(h, decode, lora))                        # [T, L]
        else:
            if lora is not None:
                raise NotImplementedError("LoRA adapters with expert parallelism are not built yet")
            u = self._expert_parallel(h, ep_dispatch, ep_capacity)                              # [T, L]
        y = self._latent_out(u, lora)
        return y if self.shared_experts is None else y + self.shared_experts(h, lora=lora)

    def idle(self, dispatch: str | None = None, capacity: int | None = None) -> None:
        """Take part in this layer's EP collectives with zero local tokens (every rank of a
        data-parallel replica without work this step); dispatch / capacity as forward's
        ep_dispatch / ep_capacity. A no-op without EP."""
        if self.parallel.ep is None:
            return
        h = torch.zeros(0, self.cfg.hidden_size, dtype=self.dtype, device=self.gate.device)    # [0, d]
        self._expert_parallel(h, dispatch, capacity)

    def _expert_parallel(self, h: torch.Tensor, dispatch: str | None, capacity: int | None) -> torch.Tensor:
        """The routed experts of the whole EP group on h [T, d]: [T, L]. Tokens replicated over
        TP: TP rank r routes and dispatches only its slice, the slices are all-gathered."""
        tp, ep = self.parallel, self.parallel.ep
        rows = peer_rows(ep, dispatch, capacity, h.shape[0], top_k=self.cfg.num_experts_per_token,
                         tp_size=tp.world_size)
        if not (ep.split_tokens_over_tp and tp.world_size > 1):
            return self._dispatched(h, rows)
        n = h.shape[0]
        lo, hi, c = tp_slice(n, tp.rank, tp.world_size)
        part = self._dispatched(h[lo:hi], rows)                                                # [hi - lo, L]
        part = torch.cat([part, part.new_zeros(c - (hi - lo), part.shape[1])])                 # [c, L]
        return tp.all_gather(part, dim=0)[:n]                                                  # [T, L]

    def _select(self, h: torch.Tensor):
        cfg, k = self.cfg, self.kernels
        grouped = cfg.use_grouped_topk
        return k.moe.select_experts(
            k.moe.router_logits(h, self.gate), top_k=cfg.num_experts_per_token,
            correction_bias=self.e_score_correction_bias, scoring=cfg.moe_router_activation_func,
            renormalize=cfg.moe_renormalize, routed_scaling_factor=cfg.routed_scaling_factor,
            num_expert_group=cfg.num_expert_group if grouped else 1, topk_group=cfg.topk_group if grouped else 1)

    def _latent_in(self, h: torch.Tensor, lora=None) -> torch.Tensor:
        if not self.cfg.uses_latent_moe:
            return h
        z = self.kernels.dense.linear(h, self.routed_expert_down_proj)                           # [T, L]
        return apply_lora(self, "routed_expert_down_proj", h, z, lora)

    def _latent_out(self, u: torch.Tensor, lora=None) -> torch.Tensor:
        cfg = self.cfg
        if cfg.latent_moe_use_norm:
            u = self.kernels.elementwise.rms_norm(u, self.routed_expert_norm, cfg.rms_norm_eps)
        if not cfg.uses_latent_moe:
            return u
        y = self.kernels.dense.linear(u, self.routed_expert_up_proj)                             # [T, d]
        return apply_lora(self, "routed_expert_up_proj", u, y, lora)

    def _routed(self, h: torch.Tensor, decode: bool, lora=None) -> torch.Tensor:
        """This rank's experts on every token: [T, L], the partial sum over the local experts
        (with the rows' expert adapters when `lora` has any)."""
        chosen = self._select(h)
        x = self._latent_in(h, lora)
        adapters = expert_lora(self, lora)
        if adapters is not None:
            w13, w2 = self.expert_weights()
            w13_lora, w2_lora, scales = adapters
            return self.kernels.lora.experts(x, w13, w2, chosen.weights, chosen.ids, lora.token_slots,
                                             w13_lora=w13_lora, w2_lora=w2_lora, scales=scales,
                                             expert_start=self.expert_start, **_activation(self.cfg))
        return self._run_experts(x, chosen.ids, chosen.weights, decode)

    def _dispatched(self, h: torch.Tensor, capacity_rows: int | None) -> torch.Tensor:
        """The routed experts of the whole EP group on h [T, d]: [T, L] (EP all-to-all)."""
        chosen = self._select(h)
        return dispatch_combine(self._latent_in(h), chosen.ids, chosen.weights, ep=self.parallel.ep,
                                num_experts=self.cfg.num_experts, run=self._run_experts,
                                capacity_rows=capacity_rows)

    def _run_experts(self, x, ids, weights, dense: bool) -> torch.Tensor:
        w13, w2 = self.expert_weights()
        return self.kernels.moe.experts(x, w13, w2, weights, ids, expert_start=self.expert_start,
                                        dense_dispatch=dense, **_activation(self.cfg))
