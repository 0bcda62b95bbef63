"""One decoder layer: mixer (KDA or MLA) and FFN (dense or MoE), with their norms and the
AttnRes pseudo-queries. The residual wiring (AttnRes or plain) lives in the model."""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.plugin.tables import KernelSet

from .ffn import GLUMLP, MoE
from .kda import KDAMixer
from .mla import MLAMixer
from .module import K3Module
from .parallel import ParallelContext


class DecoderLayer(K3Module):
    def __init__(self, cfg: K3Config, layer: int, *, kda_index: int | None, mla_index: int | None,
                 kernels: KernelSet, parallel: ParallelContext, dtype: torch.dtype, device=None):
        super().__init__()
        self.layer, self.is_kda, self.is_moe = layer, kda_index is not None, cfg.is_moe_layer(layer)
        d = cfg.hidden_size
        for name in ("input_layernorm", "post_attention_layernorm"):
            self.add_weight(name, (d,), dtype, device, dims=("hidden_size",))
        if cfg.uses_attn_res:
            for prefix in ("self_attention_res", "mlp_res"):
                self.add_weight(f"{prefix}_norm", (d,), dtype, device, dims=("hidden_size",))
                self.add_weight(f"{prefix}_proj", (1, d), dtype, device, dims=("1", "hidden_size"))
        if self.is_kda:
            self.self_attn = KDAMixer(cfg, kda_index=kda_index, kernels=kernels, parallel=parallel, dtype=dtype,
                                      device=device)
        else:
            self.self_attn = MLAMixer(cfg, mla_index=mla_index, kernels=kernels, parallel=parallel, dtype=dtype,
                                      device=device)
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg, kernels=kernels, parallel=parallel, dtype=dtype, device=device)
        else:
            self.mlp = GLUMLP(cfg, intermediate=cfg.intermediate_size, kernels=kernels, parallel=parallel,
                              dtype=dtype, device=device)

    def ffn(self, h: torch.Tensor, *, decode: bool = False, ep_dispatch: str | None = None,
            ep_capacity: int | None = None, lora=None) -> torch.Tensor:
        """decode: a one-token-per-sequence step (MoE dispatch without host synchronisation);
        ep_dispatch / ep_capacity: `MoE.forward`'s (ignored by a dense layer); lora: the rows'
        LoRA adapters (`ForwardMetadata.lora`)."""
        if not self.is_moe:
            return self.mlp(h, lora=lora)
        return self.block_sparse_moe(h, decode=decode, ep_dispatch=ep_dispatch, ep_capacity=ep_capacity, lora=lora)
