"""Routed experts packed by the `compressed-tensors` library itself load in k3 (peer venv).

The library's own lifecycle quantises random dense expert weights: `apply_quantization_config`
with its MXFP4A16 / W4A16 preset scheme, scales from its `calculate_qparams` on each group's
min / max (what a memoryless min-max observer hands it), `ModelCompressor.compress_model`, and
`ModelCompressor.update_config` writes the `quantization_config` of config.json. The packed
tensors replace k3's own experts in a k3-tiny checkpoint; k3 must parse the library's config,
load the bytes unchanged and dequantise them exactly as the library's decompressors do.

Compared with k3's own packers on the same dense weights (what the tests pin down):
- MXFP4: same layout (uint8 [out, in/2], low nibble = even column, sign bit 3; E8M0 uint8
  [out, in/32], bias 127) and the same E2M1 rounding (half to even, saturating at 6) for a
  given scale, and dequantisation agrees bit for bit. The shared exponent differs: the library
  rounds each group's amax to a power of two first (`round_to_power_2` adds a quarter of the
  significand and truncates), so a group whose amax significand is >= 1.75 gets an E8M0 byte
  one higher than OCP's floor(log2(amax)) - 2 that k3 uses (about 27% of Gaussian groups); its
  codes are then those of that larger scale (no clipping of the top values, coarser steps). An
  all-zero group gets byte 0 from the library (log2(0) = -inf, clamped) and 124 from k3; a
  -0.0 weight gets code 0 (+0) from the library (`torch.sign`) and 8 (-0) from k3 (`signbit`).
  Both decode every one of these to the same values.
- W4A16: k3's `int4_quantize` follows the library's rule in the weight's dtype, so its words
  and scales equal the library's; k3's dequantisation equals the library's decompressor.

The library's `FP4_E2M1_DATA.cast_to_fp4` is a `torch.compile` function (about 15 s to compile
here); the lifecycle runs it eagerly, and one test checks compiled == eager on every rounding
boundary.
"""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch

pytestmark = pytest.mark.oracle
if find_spec("compressed_tensors") is None:
    pytest.skip("needs the compressed-tensors library (the peer venv: .ci/peers.sh)",
                allow_module_level=True)

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA  # noqa: E402
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

from k3.checkpoint.loader import load_model  # noqa: E402
from k3.checkpoint.random_init import random_checkpoint  # noqa: E402
from k3.checkpoint.writer import write_checkpoint  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.ffn import MoE  # noqa: E402
from k3.quant.fp4 import e2m1_encode, pack_nibbles  # noqa: E402
from k3.quant.int4_pack import int4_dequantize, int4_quantize  # noqa: E402
from k3.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize  # noqa: E402

PRESET = "k3-tiny"
EXPERTS = "language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{part}"
IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
          r"re:.*block_sparse_moe\.gate$", r"re:.*routed_expert_(down|up)_proj.*", "language_model.lm_head"]
W4A16_GROUP = 32


def _expert_shapes(cfg: K3Config) -> dict[str, tuple[int, int]]:
    """Linear name (as the checkpoint spells it, without .weight) -> [out, in] of every routed expert."""
    inter, lat = cfg.moe_intermediate_size, cfg.expert_hidden_size
    shapes = {}
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            for e in range(cfg.num_experts):
                for part, shape in (("w1", (inter, lat)), ("w2", (lat, inter)), ("w3", (inter, lat))):
                    shapes[EXPERTS.format(layer=layer, expert=e, part=part)] = shape
    return shapes


def _dense(shapes: dict[str, tuple[int, int]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=g) * shape[1] ** -0.5).to(torch.bfloat16)
            for name, shape in shapes.items()}


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    *parents, leaf = name.split(".")
    for p in parents:
        if not hasattr(root, p):
            root.add_module(p, torch.nn.Module())
        root = getattr(root, p)
    root.add_module(leaf, module)


def library_compress(dense: dict[str, torch.Tensor], preset: str, out_dir, *, group_size: int | None = None):
    """The library's lifecycle over Linear modules named as the checkpoint names them: returns
    the compressed state dict; config.json in out_dir gets the library's quantization_config."""
    root = torch.nn.Module()
    for name, w in dense.items():
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
        _set_module(root, name, linear)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    apply_quantization_config(root, QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE))
    with torch.no_grad():
        for name, module in root.named_modules():
            if isinstance(module, torch.nn.Linear):
                groups = module.weight.unflatten(-1, (-1, module.quantization_scheme.weights.group_size))
                scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), module.quantization_scheme.weights)
                module.weight_scale.copy_(scale)
                module.weight_zero_point.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(root)
    with torch._dynamo.config.patch(disable=True):       # cast_to_fp4 eagerly (see the module docstring)
        compressor.compress_model(root)
    compressor.update_config(str(out_dir))
    return {k: v.detach().clone() for k, v in root.state_dict().items()}


def library_checkpoint(out, preset: str, dense: dict[str, torch.Tensor], *, group_size: int | None = None):
    """k3-tiny's random non-expert tensors, the library's expert tensors, and config.json with
    the quantization_config the library writes (verbatim, in place of k3's own). Returns the
    library's tensors."""
    raw = K3Config.preset(PRESET).to_dict()
    raw.pop("quantization_config", None)
    raw["text_config"].pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw))
    packed = library_compress(dense, preset, out, group_size=group_size)
    written = json.loads((out / "config.json").read_text())
    others = [(n, t) for n, t in random_checkpoint(K3Config.preset(PRESET), seed=0) if ".experts." not in n]
    write_checkpoint(out, K3Config.from_dict(written), others + sorted(packed.items()))
    (out / "config.json").write_text(json.dumps(written))                       # the library's, verbatim
    return packed


def _moes(model) -> dict[int, MoE]:
    return {i: layer.block_sparse_moe for i, layer in enumerate(model.model.layers) if layer.is_moe}


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(checkpoint dir, dense weights, the library's tensors) for MXFP4 experts."""
    out = tmp_path_factory.mktemp("ct-mxfp4")
    dense = _dense(_expert_shapes(K3Config.preset(PRESET)), seed=1)
    return out, dense, library_checkpoint(out, "MXFP4A16", dense)


def test_k3_parses_the_quantization_config_the_library_writes(mxfp4):
    out, _, _ = mxfp4
    written = json.loads((out / "config.json").read_text())
    q = written["quantization_config"]
    assert "quantization_config" not in written["text_config"]
    assert q["format"] == "mxfp4-pack-quantized" and q["quant_method"] == "compressed-tensors"
    assert q["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.uint8"
    cfg = K3Config.from_pretrained(out)
    assert cfg.experts_mxfp4 and cfg.quantization.group_size == 32 and cfg.quantization.raw == q


def test_k3_loads_the_library_mxfp4_bytes_unchanged(mxfp4):
    out, _, packed = mxfp4
    model = load_model(out, dtype=torch.float32, progress=False)
    cfg, inter = model.cfg, model.cfg.moe_intermediate_size
    for layer, moe in _moes(model).items():
        for e in range(cfg.num_experts):
            name = EXPERTS.format(layer=layer, expert=e, part="{}")
            for plane in ("packed", "scale"):
                w13 = getattr(moe, f"w13_{plane}")[e]
                assert torch.equal(w13[:inter], packed[f"{name.format('w1')}.weight_{plane}"])
                assert torch.equal(w13[inter:], packed[f"{name.format('w3')}.weight_{plane}"])
                assert torch.equal(getattr(moe, f"w2_{plane}")[e], packed[f"{name.format('w2')}.weight_{plane}"])


def test_mxfp4_dequantisation_equals_the_library_decompressor(mxfp4):
    _, dense, packed = mxfp4
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    for name in dense:
        p, s = packed[f"{name}.weight_packed"], packed[f"{name}.weight_scale"]
        theirs = MXFP4PackedCompressor.decompress({"weight_packed": p, "weight_scale": s}, scheme)["weight"]
        assert theirs.dtype == torch.bfloat16
        assert torch.equal(mxfp4_dequantize(p, s, dtype=torch.bfloat16), theirs)
        assert torch.equal(mxfp4_dequantize(p, s, dtype=torch.float32), theirs.float())   # exact in bf16


def test_mxfp4_against_k3s_own_packer(mxfp4):
    """Layout and element rounding agree; the shared exponent differs exactly where the group's
    amax significand is >= 1.75 (module docstring)."""
    _, dense, packed = mxfp4
    higher = total = 0
    for name, w in dense.items():
        p, s = packed[f"{name}.weight_packed"], packed[f"{name}.weight_scale"]
        kp, ks = mxfp4_quantize(w)
        groups = w.float().unflatten(-1, (-1, 32))                                 # [out, in/32, 32]
        significand, _ = torch.frexp(groups.abs().amax(-1))                        # in [0.5, 1)
        up = significand >= 0.875                                                  # amax = 1.75..2 x 2^k
        assert torch.equal(s.int() - ks.int(), up.int()), name                     # +1 there, equal elsewhere
        codes = e2m1_encode(groups * torch.pow(2.0, 127 - s.float()).unsqueeze(-1)).reshape(w.shape)
        assert torch.equal(pack_nibbles(codes), p), name                           # same codes at their scale
        same = (~up).repeat_interleave(16, dim=-1)                                 # bytes of agreeing groups
        assert torch.equal(p[same], kp[same]), name
        agree = (~up).repeat_interleave(32, dim=-1)
        assert torch.equal(mxfp4_dequantize(p, s)[agree], mxfp4_dequantize(kp, ks)[agree])
        higher, total = higher + int(up.sum()), total + up.numel()
    assert 0.15 < higher / total < 0.4, (higher, total)                            # the difference is real


def test_mxfp4_bytes_equal_where_the_two_rules_agree(tmp_path):
    """Groups scaled so that no amax significand reaches 1.75: the library's bytes are k3's."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g).unflatten(-1, (-1, 32))
    target = 2.0 ** torch.randint(-8, 2, (64, 4, 1), generator=g) * (1 + 0.7 * torch.rand(64, 4, 1, generator=g))
    w = (w / w.abs().amax(-1, keepdim=True) * target).flatten(-2).to(torch.bfloat16)   # amax 1.0..1.7 x 2^k
    (tmp_path / "config.json").write_text("{}")
    packed = library_compress({"experts.0.w1": w}, "MXFP4A16", tmp_path)
    kp, ks = mxfp4_quantize(w)
    assert torch.equal(packed["experts.0.w1.weight_packed"], kp)
    assert torch.equal(packed["experts.0.w1.weight_scale"], ks)


def test_mxfp4_zero_group_and_negative_zero():
    """The only other byte differences; both decode to the same zeros."""
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    w = torch.zeros(1, 64)
    w[0, 32:] = torch.linspace(-1, 1, 32)
    w[0, 40] = -0.0
    groups = w.unflatten(-1, (-1, 32))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    with torch._dynamo.config.patch(disable=True):
        out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    kp, ks = mxfp4_quantize(w)
    assert out["weight_scale"].tolist() == [[0, ks[0, 1].item()]] and ks[0, 0].item() == 124
    assert out["weight_packed"][0, 20].item() & 0xF == 0 and kp[0, 20].item() & 0xF == 8      # -0.0: +0 / -0
    assert torch.equal(mxfp4_dequantize(out["weight_packed"], out["weight_scale"]), mxfp4_dequantize(kp, ks))


def test_k3_written_mxfp4_decompresses_in_the_library():
    """The other direction: k3's own bytes read by the library's decompressor."""
    w = (torch.randn(48, 96, generator=torch.Generator().manual_seed(7)) * 0.1).to(torch.bfloat16)
    kp, ks = mxfp4_quantize(w)
    theirs = MXFP4PackedCompressor.decompress({"weight_packed": kp, "weight_scale": ks},
                                              preset_name_to_scheme("MXFP4A16", ["Linear"]))["weight"]
    assert torch.equal(theirs, mxfp4_dequantize(kp, ks, dtype=torch.bfloat16))


def test_compiled_fp4_cast_equals_eager():
    """The library's cast_to_fp4 under torch.compile (its default) equals the eager run the
    lifecycle above uses: on every rounding boundary, its neighbours and random values."""
    edges = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    near = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
    x = torch.cat([near, -near, torch.randn(400, generator=torch.Generator().manual_seed(0)) * 3]).reshape(-1, 8)
    compiled = FP4_E2M1_DATA.cast_to_fp4(x.clone())
    with torch._dynamo.config.patch(disable=True):
        eager = FP4_E2M1_DATA.cast_to_fp4(x.clone())
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled.abs(), torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])[e2m1_encode(x).long() & 7])


# --------------------------------------------------------------------------- W4A16
@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    """(checkpoint dir, dense weights, the library's tensors) for W4A16 experts, group 32."""
    out = tmp_path_factory.mktemp("ct-w4a16")
    dense = _dense(_expert_shapes(K3Config.preset(PRESET)), seed=2)
    return out, dense, library_checkpoint(out, "W4A16", dense, group_size=W4A16_GROUP)


def test_w4a16_config_and_tensors_as_the_library_writes_them(w4a16):
    out, dense, packed = w4a16
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["type"] == "int"
    cfg = K3Config.from_pretrained(out)
    assert cfg.experts_int4 and cfg.quantization.group_size == W4A16_GROUP and cfg.quantization.raw == q
    name = next(iter(dense))
    assert packed[f"{name}.weight_packed"].dtype == torch.int32
    assert packed[f"{name}.weight_scale"].dtype == torch.bfloat16
    assert packed[f"{name}.weight_shape"].tolist() == list(dense[name].shape)
    assert f"{name}.weight_zero_point" not in packed                             # symmetric


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w4a16_k3_dequantisation_equals_the_library_decompressor(w4a16, dtype):
    out, dense, packed = w4a16
    model = load_model(out, dtype=dtype, progress=False)
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = W4A16_GROUP
    inter = model.cfg.moe_intermediate_size
    for layer, moe in _moes(model).items():
        assert "w13_packed" not in dict(moe.named_buffers())
        for e in range(model.cfg.num_experts):
            theirs = {}
            for part in ("w1", "w2", "w3"):
                name = EXPERTS.format(layer=layer, expert=e, part=part)
                state = {k.rsplit(".", 1)[-1]: packed[k] for k in packed if k.startswith(name + ".")}
                state["weight_scale"] = state["weight_scale"].to(dtype)                  # decompress in `dtype`
                theirs[part] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
            assert theirs["w1"].dtype == dtype
            assert torch.equal(moe.w13[e, :inter], theirs["w1"]) and torch.equal(moe.w13[e, inter:], theirs["w3"])
            assert torch.equal(moe.w2[e], theirs["w2"])


def test_w4a16_k3_packer_equals_the_library(w4a16):
    _, dense, packed = w4a16
    for name, w in dense.items():
        kp, ks = int4_quantize(w, W4A16_GROUP)
        assert torch.equal(kp, packed[f"{name}.weight_packed"]), name
        assert torch.equal(ks, packed[f"{name}.weight_scale"]), name
        assert torch.equal(int4_dequantize(kp, ks, dtype=torch.bfloat16),
                           int4_dequantize(packed[f"{name}.weight_packed"], packed[f"{name}.weight_scale"],
                                           dtype=torch.bfloat16))
