"""Checkpoints: round trip, published name variants, MXFP4 experts, and named errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.checkpoint.loader import CheckpointError, load_model
from k3.checkpoint.random_init import random_checkpoint
from k3.checkpoint.writer import model_tensors, write_checkpoint
from k3.config import K3Config
from k3.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize


def _logits(model, tokens=(5, 17, 200, 3, 99, 42, 7)):
    from k3.cache.pool import CachePool
    from k3.model import contiguous_block_table
    from k3.model.metadata import ForwardMetadata

    cache = CachePool.for_model(model, 2, block_size=16).views                # a state row, a page
    batch = ForwardMetadata.build([list(tokens)], context_lens=[0], state_indices=[0],
                               block_table=contiguous_block_table(1, 1) + 1, page_size=16, all_logits=True)
    return model(batch, cache).logits


def _all_tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rewrite(src, dst, cfg, edit):
    """Copy checkpoint src to dst with edit(dict of tensors) applied."""
    tensors = _all_tensors(src)
    edit(tensors)
    write_checkpoint(dst, cfg, sorted(tensors.items()), max_shard_bytes=256 * 1024)
    return dst


@pytest.mark.parametrize("preset", ["k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny"])
def test_save_load_round_trip(preset, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(preset)
    model = load_model(src, progress=False)
    assert model.dtype == torch.bfloat16
    write_checkpoint(tmp_path, model.cfg, model_tensors(model))
    again = load_model(tmp_path, progress=False)
    torch.testing.assert_close(_logits(again), _logits(model), rtol=0, atol=0)
    a, b = _all_tensors(src), _all_tensors(tmp_path)
    a = {k: t for k, t in a.items() if not k.startswith(("vision_tower.", "mm_projector."))}   # k3-tiny's tower
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert K3Config.from_pretrained(tmp_path) == model.cfg


def test_published_k3_names(tiny_checkpoint):
    names = _all_tensors(tiny_checkpoint("k3-tiny")).keys()
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight_scale" in names
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names
    assert "language_model.lm_head.weight" in names
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in names
    names = _all_tensors(tiny_checkpoint("k3.1-pro-tiny")).keys()
    assert "language_model.model.layers.3.self_attn.indexer.k_norm.bias" in names
    names = _all_tensors(tiny_checkpoint("kimi-linear-tiny")).keys()
    assert "model.layers.0.self_attn.g_a_proj.weight" in names and "lm_head.weight" in names


def test_mxfp4_experts_equal_the_bf16_weights_they_were_made_from(tiny_checkpoint, tmp_path):
    cfg = K3Config.preset("k3-tiny")
    g = torch.Generator().manual_seed(7)
    dense = {}

    def edit(t):
        # bf16 weights on the MXFP4 grid, re-encoded by the codec into compressed-tensors planes
        for name in [n for n in t if n.endswith("weight_packed")]:
            packed = torch.randint(0, 256, t[name].shape, generator=g, dtype=torch.uint8)
            scale = torch.randint(118, 124, t[name.replace("packed", "scale")].shape, generator=g).to(torch.uint8)
            w = mxfp4_dequantize(packed, scale, dtype=torch.bfloat16)
            dense[name] = w
            t[name], t[name.replace("packed", "scale")] = mxfp4_quantize(w)

    path = _rewrite(tiny_checkpoint("k3-tiny"), tmp_path, cfg, edit)
    model = load_model(path, progress=False)
    moe = model.model.layers[2].block_sparse_moe
    w13, w2 = moe.expert_weights()
    prefix = "language_model.model.layers.2.block_sparse_moe.experts"
    for e in range(cfg.num_experts):
        w1, w3 = dense[f"{prefix}.{e}.w1.weight_packed"], dense[f"{prefix}.{e}.w3.weight_packed"]
        assert torch.equal(w13.dequantize(torch.bfloat16, index=e), torch.cat([w1, w3]))
        assert torch.equal(w2.dequantize(torch.bfloat16, index=e), dense[f"{prefix}.{e}.w2.weight_packed"])


def test_accepted_name_and_shape_variants(tiny_checkpoint, tmp_path, capsys):
    cfg = K3Config.preset("k3-tiny-text")          # no tower: the one vision tensor below is the only one
    base = load_model(tiny_checkpoint("k3-tiny-text"), dtype=torch.float64, progress=False)

    def edit(t):
        for name in list(t):
            if name.startswith("language_model.model.layers."):     # prefix variant
                t[name.replace("language_model.model.layers.", "language_model.layers.")] = t.pop(name)
        a_log = "language_model.layers.0.self_attn.A_log"
        t[a_log] = t[a_log].reshape(1, 1, -1, 1)                  # legacy A_log
        conv = "language_model.layers.0.self_attn.q_conv1d.weight"
        t[conv] = t[conv].squeeze(1)                               # 2-D conv weight
        t["vision_tower.encoder.weight"] = torch.zeros(2)           # skipped with a notice
        t["language_model.model.layers.99.self_attn.q_proj.weight"] = torch.zeros(2)   # MTP layer: skipped

    capsys.readouterr()
    model = load_model(_rewrite(tiny_checkpoint("k3-tiny-text"), tmp_path, cfg, edit), dtype=torch.float64,
                       progress=False)
    torch.testing.assert_close(_logits(model), _logits(base), rtol=0, atol=0)
    notices = [line for line in capsys.readouterr().err.splitlines() if "vision" in line]
    assert notices == ["k3: skipped 1 vision tensors (the tower loads through k3.vision.weights)"]      # one notice


def test_kimi_linear_dense_layer_saved_by_transformers(tiny_checkpoint, tmp_path):
    cfg = K3Config.preset("kimi-linear-tiny")
    base = load_model(tiny_checkpoint("kimi-linear-tiny"), dtype=torch.float64, progress=False)

    def edit(t):
        for part in ("gate", "up", "down"):
            t[f"model.layers.0.block_sparse_moe.{part}_proj.weight"] = t.pop(f"model.layers.0.mlp.{part}_proj.weight")

    model = load_model(_rewrite(tiny_checkpoint("kimi-linear-tiny"), tmp_path, cfg, edit),
                       dtype=torch.float64, progress=False)
    torch.testing.assert_close(_logits(model), _logits(base), rtol=0, atol=0)


BROKEN = {
    "missing": (lambda t: t.pop("language_model.model.layers.3.self_attn.q_b_proj.weight"),
                r"missing tensor.*language_model\.model\.layers\.3\.self_attn\.q_b_proj\.weight \(shape \[96, 32\]"),
    "missing expert": (lambda t: t.pop("language_model.model.layers.1.block_sparse_moe.experts.5.w3.weight_scale"),
                       r"experts\.5\.w3\.weight_scale \(shape \[32, 1\], dtype U8\)"),
    "unexpected": (lambda t: t.__setitem__("language_model.model.layers.2.self_attn.bogus.weight", torch.zeros(3)),
                   r"unexpected tensor.*self_attn\.bogus\.weight"),
    "shape": (lambda t: t.__setitem__("language_model.model.norm.weight", torch.zeros(65, dtype=torch.bfloat16)),
              r"language_model\.model\.norm\.weight has shape \[65\] \(BF16\), expected shape \[64\] "
              r"\(size = text_config\.hidden_size\), dtype (BF16|F32)"),
    "dtype": (lambda t: t.__setitem__("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed",
                                      torch.zeros(32, 16, dtype=torch.bfloat16)),
              r"experts\.0\.w1\.weight_packed has dtype BF16, expected U8"),
    "expert out of range": (lambda t: t.__setitem__(
        "language_model.model.layers.1.block_sparse_moe.experts.8.w2.weight_scale", torch.zeros(32, 1, dtype=torch.uint8)),
        r"expert 8 does not exist \(num_experts = 8\)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_names_the_tensor(case, tiny_checkpoint, tmp_path):
    edit, message = BROKEN[case]
    path = _rewrite(tiny_checkpoint("k3-tiny"), tmp_path, K3Config.preset("k3-tiny"), edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(path, progress=False)


def test_index_listing_a_missing_shard(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("kimi-linear-tiny")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(tmp_path, progress=False)


def test_random_checkpoint_is_deterministic():
    cfg = K3Config.preset("kimi-linear-tiny")
    a = dict(random_checkpoint(cfg, seed=3))
    b = dict(random_checkpoint(cfg, seed=3))
    c = dict(random_checkpoint(cfg, seed=4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_the_router_gate_is_held_in_fp32_and_saved_in_the_model_dtype(tiny_checkpoint, tmp_path):
    """The gate is upcast exactly at load (the router computes in fp32) and written back in the
    model's dtype, as K3 checkpoints publish it."""
    path = tiny_checkpoint("k3-tiny")
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    gates = {name: p for name, p in model.named_parameters() if name.endswith(".gate")}
    assert gates and all(p.dtype == torch.float32 for p in gates.values())
    saved = dict(model_tensors(model))
    routers = {k: v for k, v in saved.items() if k.endswith("gate.weight")}
    assert routers and all(v.dtype == torch.bfloat16 for v in routers.values())
    stored = _all_tensors(path)
    for name, tensor in routers.items():
        assert torch.equal(tensor, stored[name].to(torch.bfloat16)), name
