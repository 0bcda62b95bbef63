"""transformers' Kimi-Linear runtime names (`save_pretrained(save_original_format=False)`) and
config.json spellings load onto k3's model, and mis-shaped tensors name the config field.

The checkpoints here are k3's kimi-linear-tiny rewritten into transformers' layout by this file
(the oracle tier, tests/oracles, loads checkpoints transformers itself wrote)."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.checkpoint.loader import CheckpointError, load_checkpoint, load_model
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.parallel import ParallelContext

PRESET = "kimi-linear-tiny"


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def transformers_config(raw: dict) -> dict:
    """A k3 config dict in the spelling transformers' save_pretrained writes (flat KDA fields,
    per-layer lists, attribute-map targets)."""
    out = dict(raw)
    la = out.pop("linear_attn_config")
    n = out["num_hidden_layers"]
    out.update(linear_num_heads=la["num_heads"], linear_head_dim=la["head_dim"],
               linear_conv_kernel_dim=la["short_conv_kernel_size"],
               layer_types=["linear_attention" if i + 1 in la["kda_layers"] else "full_attention" for i in range(n)],
               mlp_layer_types=["dense" if i < out["first_k_dense_replace"] else "sparse" for i in range(n)])
    return out


def runtime_names(tensors: dict[str, torch.Tensor], cfg: K3Config) -> dict[str, torch.Tensor]:
    """k3's canonical Kimi-Linear tensors renamed, fused and stacked as transformers holds them."""
    out = dict(tensors)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        if cfg.is_kda_layer(layer):
            out[p + "self_attn.conv1d.weight"] = torch.cat([out.pop(f"{p}self_attn.{x}_conv1d.weight") for x in "qkv"])
            for leaf in ("f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias"):
                out[f"{p}self_attn.forget_gate.{leaf}"] = out.pop(f"{p}self_attn.{leaf}")
        if cfg.is_moe_layer(layer):
            moe = p + "block_sparse_moe."
            experts = range(cfg.num_experts)
            out[p + "mlp.experts.gate_up_proj"] = torch.stack([     # [E, 2I, d]: each expert's gate rows, then up
                torch.cat([out.pop(f"{moe}experts.{e}.w1.weight"), out.pop(f"{moe}experts.{e}.w3.weight")])
                for e in experts])
            out[p + "mlp.experts.down_proj"] = torch.stack([out.pop(f"{moe}experts.{e}.w2.weight") for e in experts])
            for name in [n for n in out if n.startswith(moe)]:
                out[name.replace(moe, p + "mlp.")] = out.pop(name)
    return out


def _write(path, raw_config: dict, tensors: dict[str, torch.Tensor]):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw_config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def canonical(tmp_path_factory):
    from k3.checkpoint.random_init import random_checkpoint
    from k3.checkpoint.writer import write_checkpoint

    cfg = K3Config.preset(PRESET)
    return write_checkpoint(tmp_path_factory.mktemp("canonical"), cfg, random_checkpoint(cfg, seed=5))


@pytest.fixture(scope="module")
def runtime(canonical, tmp_path_factory):
    cfg = K3Config.from_pretrained(canonical)
    raw = transformers_config(cfg.to_dict())
    return _write(tmp_path_factory.mktemp("runtime"), raw, runtime_names(_tensors(canonical), cfg))


def test_runtime_names_hold_what_transformers_holds(runtime):
    t = _tensors(runtime)
    assert t["model.layers.0.self_attn.conv1d.weight"].shape == (192, 1, 4)       # [3P, 1, W]
    assert t["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)      # [E, 2I, d]
    assert t["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, 32)         # [E, d, I]
    assert "model.layers.0.self_attn.forget_gate.A_log" in t and "model.layers.1.mlp.gate.weight" in t
    assert "model.layers.0.mlp.gate_proj.weight" in t                             # the dense layer


def _params(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("rank,world", [(0, 1), (0, 2), (1, 2)])
def test_runtime_names_load_as_the_canonical_checkpoint(canonical, runtime, rank, world):
    """Every parameter (each rank's shard of it: the q, k and v rows of the fused conv, this
    rank's experts) equals the one loaded from the canonical names."""
    models = []
    for path in (canonical, runtime):
        cfg = K3Config.from_pretrained(path)
        model = K3ForCausalLM(cfg, parallel=ParallelContext(rank=rank, world_size=world), dtype=torch.float64)
        load_checkpoint(model, path, progress=False)
        models.append(_params(model))
    assert models[0].keys() == models[1].keys()
    for name, value in models[0].items():
        assert torch.equal(value, models[1][name]), name


def test_gate_up_row_order_is_gate_then_up(canonical, runtime):
    """A model whose w13 took transformers' up rows as gate would differ: the loaded stack's
    first half is w1 (gate) of the canonical checkpoint."""
    moe = load_model(runtime, dtype=torch.float64, progress=False).model.layers[1].block_sparse_moe
    w1 = _tensors(canonical)["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    assert torch.equal(moe.w13[3, : w1.shape[0]], w1.to(torch.float64))


def _broken(runtime, tmp_path, edit):
    raw = json.loads((runtime / "config.json").read_text())
    tensors = _tensors(runtime)
    edit(tensors)
    return _write(tmp_path / "broken", raw, tensors)


BROKEN = {
    "f_a rows": (lambda t: t.__setitem__("model.layers.0.self_attn.forget_gate.f_a_proj.weight", torch.zeros(128, 64)),
                 "tensor model.layers.0.self_attn.forget_gate.f_a_proj.weight has shape [128, 64] (F32), expected "
                 "shape [16, 64] (rows = linear_head_dim, columns = hidden_size)"),
    "fused conv": (lambda t: t.__setitem__("model.layers.0.self_attn.conv1d.weight", torch.zeros(192, 1, 3)),
                   "tensor model.layers.0.self_attn.conv1d.weight has shape [192, 1, 3] (F32), expected shape "
                   "[192, 1, 4] (dim 0 = 3 * linear_num_heads * linear_head_dim, dim 2 = linear_conv_kernel_dim)"),
    "stacked experts": (lambda t: t.__setitem__("model.layers.2.mlp.experts.gate_up_proj", torch.zeros(8, 32, 64)),
                        "tensor model.layers.2.mlp.experts.gate_up_proj has shape [8, 32, 64] (F32), expected shape "
                        "[8, 64, 64] (dim 0 = num_experts, dim 1 = 2 * moe_intermediate_size, dim 2 = hidden_size)"),
    "too few experts": (lambda t: t.__setitem__("model.layers.2.mlp.experts.down_proj", torch.zeros(4, 64, 32)),
                        "down_proj has shape [4, 64, 32] (F32), expected shape [8, 64, 32]"),
    "fused in an MLA layer": (lambda t: t.__setitem__("model.layers.3.self_attn.conv1d.weight", torch.zeros(192, 1, 4)),
                              "unexpected tensor(s): model.layers.3.self_attn.conv1d.weight"),
    "both spellings": (lambda t: t.__setitem__("model.layers.0.self_attn.q_conv1d.weight", torch.zeros(64, 1, 4)),
                       "tensor model.layers.0.self_attn.q_conv1d.weight appears twice in the checkpoint"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_runtime_checkpoint_names_tensor_shape_and_field(case, runtime, tmp_path):
    edit, message = BROKEN[case]
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(_broken(runtime, tmp_path, edit), progress=False)


def test_missing_part_of_a_fused_tensor_is_named(runtime, tmp_path):
    path = _broken(runtime, tmp_path, lambda t: t.pop("model.layers.4.self_attn.conv1d.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.4\.self_attn\.q_conv1d\.weight"):
        load_model(path, progress=False)
