"""W4A16 routed experts (compressed-tensors `pack-quantized` int4): a checkpoint whose experts
k3's own packer wrote loads, holds exactly the dequantised weights, and its float64 forward
equals a dense-expert model built from weights dequantised here, independently, bit by bit."""

from __future__ import annotations

import copy

import pytest
import torch

from k3.cache.pool import CachePool
from k3.checkpoint.loader import CheckpointError, load_model
from k3.checkpoint.random_init import random_checkpoint
from k3.checkpoint.writer import model_tensors, write_checkpoint
from k3.config import ConfigError, K3Config
from k3.model import contiguous_block_table
from k3.model.ffn import MoE
from k3.model.metadata import ForwardMetadata
from k3.quant.int4_pack import int4_quantize

GROUP = 16


def w4a16_quantization(group_size: int = GROUP) -> dict:
    """The quantization_config compressed-tensors writes for W4A16 experts (symmetric int4)."""
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size,
                            "symmetric": True, "dynamic": False, "actorder": None, "observer": "memoryless_minmax"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
                       r"re:.*block_sparse_moe\.gate$", r"re:.*routed_expert_(down|up)_proj.*", "language_model.lm_head"]}


def configs(preset: str = "k3-tiny", group_size: int = GROUP) -> tuple[K3Config, K3Config]:
    """(dense-expert config, the same with W4A16 experts)."""
    raw = K3Config.preset(preset).to_dict()
    raw.pop("quantization_config", None)
    text = raw.get("text_config", raw)
    text.pop("quantization_config", None)
    dense = K3Config.from_dict(copy.deepcopy(raw))
    text["quantization_config"] = w4a16_quantization(group_size)
    return dense, K3Config.from_dict(raw)


def write_w4a16_checkpoint(out, preset: str = "k3-tiny", *, seed: int = 0, group_size: int = GROUP):
    """k3's own writer: a random dense checkpoint whose expert weights `int4_quantize` packs
    (bf16 scales, `weight_shape` records, as compressed-tensors writes them)."""
    dense, quant = configs(preset, group_size)
    tensors = []
    for name, t in random_checkpoint(dense, seed=seed):
        if ".experts." in name and name.endswith(".weight"):
            packed, scale = int4_quantize(t, group_size)              # bf16 weights and scales
            base = name[:-len("weight")]
            tensors += [(base + "weight_packed", packed), (base + "weight_scale", scale),
                        (base + "weight_shape", torch.tensor(t.shape))]
        else:
            tensors.append((name, t))
    write_checkpoint(out, quant, tensors)
    return dense, quant, dict(tensors)


def independent_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale from the bits, in float64, without k3's codec: word c, nibble j is column 8c + j, q = nibble - 8."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    cols = [((words >> (4 * j)) & 0xF) - 8 for j in range(8)]
    q = torch.stack(cols, dim=-1).reshape(packed.shape[0], -1).double()       # [out, in]
    return q * scale.double().repeat_interleave(q.shape[1] // scale.shape[1], dim=1)


def logits(model, ids: list[int]) -> torch.Tensor:
    page = 16
    pages = -(-len(ids) // page)
    cache = CachePool.for_model(model, 1 + pages, block_size=page).views      # a state row, then the pages
    meta = ForwardMetadata.build([ids], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, pages) + 1, page_size=page, all_logits=True)
    return model(meta, cache).logits


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3-tiny-w4a16")
    dense, quant, tensors = write_w4a16_checkpoint(out)
    return out, dense, quant, tensors


def test_config_reads_w4a16(written):
    from k3.cli.info import summarize
    from k3.model.params import count_parameters

    _, dense, quant, _ = written
    assert quant.experts_int4 and not quant.experts_mxfp4
    assert quant.quantization.format == "pack-quantized" and quant.quantization.type == "int"
    assert quant.quantization.group_size == GROUP
    assert summarize(quant)["moe"]["expert_format"] == \
        f"w4a16 (int4, group {GROUP}; dequantised to the model dtype at load)"
    assert count_parameters(quant) == count_parameters(dense)        # 8 logical parameters a word, scales none
    from k3.cache.capacity import weight_bytes_per_gpu
    assert weight_bytes_per_gpu(quant, 1) == weight_bytes_per_gpu(dense, 1)   # held dense after load


def test_load_holds_the_dequantised_experts_and_frees_the_planes(written):
    out, _, quant, tensors = written
    model = load_model(out, dtype=torch.float64, progress=False)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all("w13_packed" not in dict(m.named_buffers()) for m in moes)
    layer = [i for i in range(quant.num_hidden_layers) if quant.is_moe_layer(i)][-1]
    moe = model.model.layers[layer].block_sparse_moe
    prefix = f"language_model.model.layers.{layer}.block_sparse_moe.experts"
    inter = quant.moe_intermediate_size
    for e in range(quant.num_experts):
        w = {p: independent_dequantize(tensors[f"{prefix}.{e}.{p}.weight_packed"], tensors[f"{prefix}.{e}.{p}.weight_scale"])
             for p in ("w1", "w2", "w3")}
        assert torch.equal(moe.w13[e, :inter], w["w1"]) and torch.equal(moe.w13[e, inter:], w["w3"])
        assert torch.equal(moe.w2[e], w["w2"])
    assert moe.w13.dtype == torch.float64 and not torch.equal(moe.w13, torch.zeros_like(moe.w13))
    with pytest.raises(ValueError, match="cannot save W4A16 experts"):
        model_tensors(model)


def test_forward_equals_a_dense_expert_model(written, tmp_path):
    out, dense, _, tensors = written
    dense_tensors = []
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[:-len("weight_packed")]
            dense_tensors.append((base + "weight", independent_dequantize(t, tensors[base + "weight_scale"])))
        elif not name.endswith((".weight_scale", ".weight_shape")):
            dense_tensors.append((name, t))
    write_checkpoint(tmp_path, dense, dense_tensors)
    quantised = load_model(out, dtype=torch.float64, progress=False)
    reference = load_model(tmp_path, dtype=torch.float64, progress=False)
    ids = torch.randint(0, dense.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    a, b = logits(quantised, ids), logits(reference, ids)
    assert a.shape == (40, dense.vocab_size) and torch.isfinite(a).all()
    assert torch.equal(a, b)
    # the experts matter: zeroing one W4A16 layer's experts changes the logits
    moe = next(m for m in quantised.modules() if isinstance(m, MoE))
    with torch.no_grad():
        moe.w2.zero_()
    assert not torch.equal(logits(quantised, ids), b)


def test_dummy_weights_dequantise_too(written, tmp_path):
    from k3.checkpoint.dummy import load_dummy_weights
    from k3.model import K3ForCausalLM

    _, _, quant, _ = written
    model = K3ForCausalLM(quant, dtype=torch.float32)
    load_dummy_weights(model, seed=1, progress=False)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    rms = moe.w13.pow(2).mean().sqrt().item()
    assert "w13_packed" not in dict(moe.named_buffers()) and 0.3 < rms * quant.expert_hidden_size ** 0.5 < 3
    assert torch.isfinite(logits(model, [1, 2, 3, 4])).all()


def test_random_checkpoint_of_a_w4a16_config_loads(written, tmp_path):
    _, _, quant, _ = written
    write_checkpoint(tmp_path, quant, random_checkpoint(quant, seed=2))      # no weight_shape: it is optional
    model = load_model(tmp_path, dtype=torch.float32, progress=False)
    assert torch.isfinite(logits(model, [5, 6, 7])).all()


def _rewrite(out, tmp_path, change):
    from safetensors.torch import load_file, save_file
    import shutil

    shutil.copytree(out, tmp_path / "c")
    for f in (tmp_path / "c").glob("*.safetensors"):
        tensors = load_file(str(f))
        change(tensors)
        save_file(tensors, str(f))
    return tmp_path / "c"


def test_a_misshaped_packed_tensor_names_it_and_its_shape(written, tmp_path):
    out, _, quant, _ = written
    layer = next(i for i in range(quant.num_hidden_layers) if quant.is_moe_layer(i))
    key = f"language_model.model.layers.{layer}.block_sparse_moe.experts.3.w2.weight_packed"

    def narrow(tensors):
        if key in tensors:
            tensors[key] = tensors[key][:, :-1].contiguous()
    bad = _rewrite(out, tmp_path, narrow)
    rows, cols = quant.expert_hidden_size, quant.moe_intermediate_size // 8
    with pytest.raises(CheckpointError, match=rf"tensor {key} has shape \[{rows}, {cols - 1}\] \(I32\), expected "
                                              rf"shape \[{rows}, {cols}\].*moe_intermediate_size / 8.*dtype I32"):
        load_model(bad, progress=False)


def test_a_wrong_shape_record_or_dtype_is_named(written, tmp_path):
    out, _, quant, _ = written
    layer = next(i for i in range(quant.num_hidden_layers) if quant.is_moe_layer(i))
    base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.0.w1."

    def change(tensors):
        if base + "weight_shape" in tensors:
            tensors[base + "weight_shape"] = torch.tensor([quant.moe_intermediate_size, 8])
    with pytest.raises(CheckpointError, match=rf"tensor {base}weight_shape records shape "
                                              rf"\[{quant.moe_intermediate_size}, 8\], expected "
                                              rf"\[{quant.moe_intermediate_size}, {quant.expert_hidden_size}\]"):
        load_model(_rewrite(out, tmp_path / "a", change), progress=False)

    def as_uint8(tensors):
        if base + "weight_packed" in tensors:
            tensors[base + "weight_packed"] = tensors[base + "weight_packed"].view(torch.uint8)[:, ::4].contiguous()
    with pytest.raises(CheckpointError, match=rf"{base}weight_packed has dtype U8, expected I32 \(packed int4"):
        load_model(_rewrite(out, tmp_path / "b", as_uint8), progress=False)


@pytest.mark.parametrize("field,change,message", [
    ("quantization_config.format", lambda q: q.update(format="nvfp4-pack-quantized"),
     "mxfp4-pack-quantized .* and pack-quantized .*got 'nvfp4-pack-quantized'"),
    ("quantization_config.config_groups.group_0.weights.symmetric",
     lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "symmetric int4 only"),
    ("quantization_config.config_groups.group_0.weights.strategy",
     lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="channel"), "strategy 'group'"),
    ("quantization_config.config_groups.group_0.weights.num_bits",
     lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "4-bit weights, got 8"),
    ("quantization_config.config_groups.group_0.weights.type",
     lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "holds int weights"),
    ("quantization_config.config_groups.group_0.weights.actorder",
     lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "activation ordering"),
    ("quantization_config.config_groups.group_0.weights.group_size",
     lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=None), "positive integer"),
    ("quantization_config.config_groups.group_0.format",
     lambda q: q["config_groups"]["group_0"].update(format="mxfp4-pack-quantized"), "contradicts"),
])
def test_unsupported_quantization_names_the_field(field, change, message):
    raw = K3Config.preset("kimi-linear-tiny").to_dict()
    raw["quantization_config"] = w4a16_quantization()
    change(raw["quantization_config"])
    with pytest.raises(ConfigError, match=message) as e:
        K3Config.from_dict(raw)
    assert e.value.field == field


def test_a_group_not_dividing_the_expert_widths_names_the_field():
    raw = K3Config.preset("kimi-linear-tiny").to_dict()
    raw["quantization_config"] = w4a16_quantization(group_size=64)           # widths are 32 and 64
    with pytest.raises(ConfigError, match="32 is not a multiple of the W4A16 group size 64") as e:
        K3Config.from_dict(raw)
    assert e.value.field == "moe_intermediate_size"
