"""K3Config: published configs, presets, defaults, and errors that name the field."""

import copy
import json
from pathlib import Path

import pytest

from k3.config import ConfigError, K3Config
from k3.presets import PRESETS, preset_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture
def k3_raw():
    return json.loads((FIXTURES / "kimi-k3-config.json").read_text())


def test_published_k3_config_layer_schedule(k3_raw):
    cfg = K3Config.from_dict(k3_raw)
    assert cfg.model_type == "kimi_k3" and cfg.num_hidden_layers == 93
    assert cfg.mla_layer_ids == tuple(range(3, 92, 4)) + (92,)
    assert cfg.mla_layer_ids[-2:] == (91, 92)          # the last two layers are both MLA
    assert len(cfg.kda_layer_ids) == 69 and cfg.is_kda_layer(0) and not cfg.is_kda_layer(3)
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 93))
    assert cfg.num_attn_res_blocks == 8
    assert cfg.situ_beta == 4.0 and cfg.activation_situ_linear_beta == 25.0
    assert cfg.experts_mxfp4 and cfg.quantization.group_size == 32
    assert cfg.linear_attn.gate_lower_bound == -5.0 and cfg.linear_attn.use_full_rank_gate
    assert cfg.shared_expert_intermediate_size == 6144 and cfg.expert_hidden_size == 3584
    assert cfg.mla_latent_size == 576 and cfg.mla_softmax_scale == pytest.approx(192 ** -0.5)
    assert cfg.eos_token_ids == (163586,) and cfg.media_placeholder_token_id == 163605
    assert not cfg.uses_dsa and cfg.family == "Kimi K3"


def test_published_config_equals_preset(k3_raw):
    assert K3Config.from_dict(k3_raw) == K3Config.preset("kimi-k3")


def test_unknown_sections_are_kept_and_written_back(k3_raw):
    k3_raw["some_future_section"] = {"x": 1}
    k3_raw["text_config"]["some_future_field"] = [1, 2]
    cfg = K3Config.from_dict(k3_raw)
    assert cfg.extra_top["vision_config"]["model_type"] == "kimi_k3_vision"
    out = cfg.to_dict()
    assert out["vision_config"] == k3_raw["vision_config"]
    assert out["some_future_section"] == {"x": 1}
    assert out["text_config"]["some_future_field"] == [1, 2]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_parse_and_round_trip(name, tmp_path):
    cfg = K3Config.preset(name)
    cfg.to_json_file(tmp_path / "config.json")
    assert K3Config.from_pretrained(tmp_path) == cfg
    assert K3Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_k31_pro_adds_dsa_on_k3():
    pro, k3 = K3Config.preset("kimi-k3.1-pro"), K3Config.preset("kimi-k3")
    assert (pro.index_n_heads, pro.index_head_dim, pro.index_topk) == (32, 128, 2048)
    assert pro.replace(index_n_heads=None, index_head_dim=None, index_topk=None) == k3


def test_tiny_presets_keep_k3_structure():
    for name in ("k3-tiny", "k3.1-pro-tiny"):
        cfg = K3Config.preset(name)
        types = cfg.layer_types
        assert types[-2:] == ("mla", "mla") and "kda" in types
        assert cfg.num_attn_res_blocks >= 2 and not cfg.is_moe_layer(0)
        assert cfg.experts_mxfp4 and cfg.uses_latent_moe and cfg.num_shared_experts >= 1
        assert cfg.vocab_size < 1024 and 1000 <= cfg.max_position_embeddings <= 10000
    assert K3Config.preset("k3.1-pro-tiny").index_topk < 64
    lin = K3Config.preset("kimi-linear-tiny")
    assert lin.family == "Kimi-Linear" and not lin.uses_attn_res and lin.q_lora_rank is None
    assert lin.linear_attn.gate_lower_bound is None and not lin.linear_attn.use_full_rank_gate
    assert lin.routed_scaling_factor == 2.446 and lin.hidden_act == "silu" and not lin.uses_latent_moe


def test_k3_slice_has_real_widths():
    s, k3 = K3Config.preset("k3-slice"), K3Config.preset("kimi-k3")
    assert s.num_hidden_layers == 12 and s.mla_layer_ids == (3, 7, 11)
    assert (s.num_experts, s.num_experts_per_token) == (128, 16) and s.num_attn_res_blocks == 1
    for f in ("hidden_size", "kv_lora_rank", "moe_intermediate_size", "routed_expert_hidden_size",
              "num_attention_heads", "q_lora_rank"):
        assert getattr(s, f) == getattr(k3, f)


def test_kimi_linear_published_values():
    cfg = K3Config.preset("kimi-linear-48b-a3b")
    assert cfg.model_type == "kimi_linear" and cfg.max_position_embeddings == 1048576  # model_max_length
    assert cfg.mla_layer_ids == (3, 7, 11, 15, 19, 23, 26) and cfg.q_lora_rank is None
    assert cfg.routed_scaling_factor == 2.446 and cfg.quantization is None


def _flat(**overrides):
    raw = {"model_type": "kimi_linear", "kv_lora_rank": 16, "qk_nope_head_dim": 8,
           "qk_rope_head_dim": 4, "v_head_dim": 8}
    raw.update(overrides)
    return raw


def test_absent_fields_take_official_defaults():
    cfg = K3Config.from_dict(_flat())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (163840, 4096, 32, 32)
    assert cfg.num_key_value_heads == 32 and cfg.intermediate_size == 11008
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 4096
    assert cfg.hidden_act == "silu" and cfg.num_experts is None and cfg.linear_attn is None
    assert cfg.layer_types == ("mla",) * 32 and not cfg.uses_attn_res
    assert cfg.routed_scaling_factor == 1.0 and cfg.moe_renormalize and cfg.topk_method == "noaux_tc"
    assert cfg.dtype == "bfloat16"


def test_situ_without_beta_uses_official_fallback_and_says_so():
    cfg = K3Config.from_dict(_flat(hidden_act="situ"))
    assert cfg.situ_beta == 1.0 and any("activation_situ_beta" in n for n in cfg.notes)


def test_model_max_length_alias_and_precedence():
    assert K3Config.from_dict(_flat(model_max_length=8192)).max_position_embeddings == 8192
    assert K3Config.from_dict(_flat(model_max_length=8192, max_position_embeddings=100)).max_position_embeddings == 100


def test_quantization_config_in_text_config_only(k3_raw):
    del k3_raw["quantization_config"]
    cfg = K3Config.from_dict(k3_raw)
    assert cfg.experts_mxfp4


def test_mxfp4_implies_group_32(k3_raw):
    del k3_raw["quantization_config"]
    del k3_raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    assert K3Config.from_dict(k3_raw).quantization.group_size == 32


def test_one_layer_list_implies_the_other():
    raw = preset_dict("kimi-linear-tiny")
    del raw["linear_attn_config"]["kda_layers"]
    assert K3Config.from_dict(raw).layer_types == K3Config.preset("kimi-linear-tiny").layer_types


BAD = [
    ("text_config.hidden_size", lambda r: r["text_config"].update(hidden_size=-3)),
    ("text_config.hidden_size", lambda r: r["text_config"].update(hidden_size="7168")),
    ("text_config.num_hidden_layers", lambda r: r["text_config"].update(num_hidden_layers=True)),
    ("text_config.hidden_act", lambda r: r["text_config"].update(hidden_act="gelu")),
    ("text_config.rms_norm_eps", lambda r: r["text_config"].update(rms_norm_eps=0)),
    ("text_config.mla_use_nope", lambda r: r["text_config"].update(mla_use_nope=False)),
    ("text_config.linear_attn_config.kda_layers", lambda r: r["text_config"]["linear_attn_config"].update(kda_layers=[0, 1, 2])),
    ("text_config.linear_attn_config.kda_layers", lambda r: r["text_config"]["linear_attn_config"]["kda_layers"].append(4)),
    ("text_config.linear_attn_config.kda_layers", lambda r: r["text_config"]["linear_attn_config"]["kda_layers"].remove(1)),
    ("text_config.linear_attn_config.gate_lower_bound", lambda r: r["text_config"]["linear_attn_config"].update(gate_lower_bound=-6.0)),
    ("text_config.linear_attn_config.num_heads", lambda r: r["text_config"]["linear_attn_config"].pop("num_heads")),
    ("text_config.num_experts_per_token", lambda r: r["text_config"].update(num_experts_per_token=1000)),
    ("text_config.num_expert_group", lambda r: r["text_config"].update(num_expert_group=5)),
    ("text_config.topk_group", lambda r: r["text_config"].update(num_expert_group=4, topk_group=8)),
    ("text_config.moe_intermediate_size", lambda r: r["text_config"].pop("moe_intermediate_size")),
    ("text_config.index_head_dim", lambda r: r["text_config"].update(index_n_heads=32, index_topk=2048)),
    ("text_config.index_head_dim", lambda r: r["text_config"].update(index_n_heads=32, index_head_dim=96, index_topk=2048)),
    ("text_config.kv_lora_rank", lambda r: r["text_config"].pop("kv_lora_rank")),
    ("text_config.q_lora_rank", lambda r: r["text_config"].update(q_lora_rank=None, index_n_heads=32,
                                                                  index_head_dim=128, index_topk=2048)),
    ("text_config.latent_moe_use_norm", lambda r: r["text_config"].pop("routed_expert_hidden_size")),
    ("text_config.moe_router_activation_func", lambda r: r["text_config"].update(moe_router_activation_func="relu")),
    ("text_config.dtype", lambda r: r["text_config"].update(dtype="int8")),
    ("text_config.model_type", lambda r: r["text_config"].update(model_type="deepseek_v3")),
    ("model_type", lambda r: r.update(model_type="llama")),
    ("eos_token_id", lambda r: r.update(eos_token_id=999999)),
    ("text_config.quantization_config.quant_method", lambda r: r["text_config"]["quantization_config"].update(quant_method="gptq")),
    ("text_config.quantization_config.format", lambda r: r["text_config"]["quantization_config"].update(format="nvfp4-pack-quantized")),
    ("text_config.quantization_config.config_groups.group_0.weights.group_size",
     lambda r: r["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16)),
]


@pytest.mark.parametrize("field,mutate", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_configs_name_the_field(k3_raw, field, mutate):
    raw = copy.deepcopy(k3_raw)
    mutate(raw)
    with pytest.raises(ConfigError) as err:
        K3Config.from_dict(raw)
    assert err.value.field == field, str(err.value)
    assert f"'{field}'" in str(err.value)


def test_flat_bad_field_has_no_prefix():
    with pytest.raises(ConfigError, match="'hidden_size'"):
        K3Config.from_dict(_flat(hidden_size=0))


def test_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_pretrained(tmp_path)


# ---------------------------------------------------------------- transformers' config.json
@pytest.fixture
def hf_raw():
    """What transformers 5.19's KimiLinearConfig.save_pretrained wrote for a 6-layer shape (MLA at
    1-based 4 and 6): flat KDA fields and per-layer lists, no linear_attn_config."""
    return json.loads((FIXTURES / "transformers-kimi-linear-config.json").read_text())


def test_transformers_config_reads_its_flat_fields(hf_raw):
    assert "linear_attn_config" not in hf_raw
    cfg = K3Config.from_dict(hf_raw)
    assert cfg.layer_types == ("kda", "kda", "kda", "mla", "kda", "mla")
    la = cfg.linear_attn
    assert (la.num_heads, la.head_dim, la.short_conv_kernel_size) == (4, 16, 4)
    assert la.gate_lower_bound is None and not la.use_full_rank_gate and la.full_attn_layers == (4, 6)
    assert cfg.first_k_dense_replace == 1 and not cfg.is_moe_layer(0) and cfg.is_moe_layer(5)
    assert cfg.max_position_embeddings == 1048576 and cfg.num_experts == 8 and cfg.num_experts_per_token == 2
    assert cfg.field_name("linear_attn_config.head_dim") == "linear_head_dim"
    assert cfg.field_name("hidden_size") == "hidden_size"
    out = cfg.to_dict()                      # written back in the canonical form, which transformers reads
    assert out["linear_attn_config"]["kda_layers"] == [1, 2, 3, 5]
    assert not {"layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads"} & out.keys()
    assert K3Config.from_dict(out) == cfg


def test_flat_fields_and_linear_attn_config_together_must_agree(hf_raw):
    hf_raw["linear_attn_config"] = {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                                    "full_attn_layers": [4, 6]}
    assert K3Config.from_dict(hf_raw) == K3Config.from_dict({k: v for k, v in hf_raw.items()
                                                             if k != "linear_attn_config"})
    hf_raw["linear_head_dim"] = 32
    with pytest.raises(ConfigError, match=r"'linear_head_dim': 32 contradicts linear_attn_config.head_dim = 16"):
        K3Config.from_dict(hf_raw)
    hf_raw["linear_head_dim"] = 16
    hf_raw["layer_types"][0] = "full_attention"
    with pytest.raises(ConfigError, match=r"'layer_types': makes full_attn_layers \[1, 4, 6\]"):
        K3Config.from_dict(hf_raw)


def test_linear_attn_config_takes_missing_keys_from_the_flat_fields(hf_raw):
    hf_raw["linear_attn_config"] = {"num_heads": 4}
    cfg = K3Config.from_dict(hf_raw)
    assert cfg.linear_attn.head_dim == 16 and cfg.linear_attn.kda_layers == (1, 2, 3, 5)


def test_transformers_attribute_map_aliases(hf_raw):
    for alias, name in (("n_group", "num_expert_group"), ("num_local_experts", "num_experts"),
                        ("num_experts_per_tok", "num_experts_per_token"), ("n_shared_experts", "num_shared_experts"),
                        ("norm_topk_prob", "moe_renormalize")):
        hf_raw[alias] = hf_raw.pop(name)
    hf_raw.update(n_group=2, topk_group=1)
    cfg = K3Config.from_dict(hf_raw)
    assert (cfg.num_expert_group, cfg.topk_group, cfg.num_experts, cfg.num_experts_per_token) == (2, 1, 8, 2)
    assert cfg.num_shared_experts == 1 and cfg.moe_renormalize
    assert "n_group" not in cfg.to_dict() and cfg.to_dict()["num_expert_group"] == 2
    with pytest.raises(ConfigError, match=r"'topk_group': 3 exceeds n_group = 2"):
        K3Config.from_dict({**hf_raw, "topk_group": 3})
    with pytest.raises(ConfigError, match=r"'num_experts_per_tok': 9 exceeds num_experts = 8"):
        K3Config.from_dict({**hf_raw, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match=r"'n_group': 2 contradicts num_expert_group = 4"):
        K3Config.from_dict({**hf_raw, "num_expert_group": 4})


def test_mlp_layer_types_set_the_dense_layers(hf_raw):
    del hf_raw["first_k_dense_replace"]
    hf_raw["mlp_layer_types"] = ["dense", "dense"] + ["sparse"] * 4
    assert K3Config.from_dict(hf_raw).first_k_dense_replace == 2
    hf_raw["mlp_layer_types"] = ["sparse"] * 6
    assert K3Config.from_dict(hf_raw).first_k_dense_replace == 0


HF_BAD = [
    ("mlp_layer_types", lambda r: r["mlp_layer_types"].__setitem__(3, "dense"), "layer 3 is 'dense'"),
    ("mlp_layer_types", lambda r: r.update(num_experts=None), "num_experts is not set"),
    ("mlp_layer_types", lambda r: r["mlp_layer_types"].pop(), "has 5 entries, expected num_hidden_layers = 6"),
    ("layer_types", lambda r: r["layer_types"].__setitem__(0, "mamba"), "expected a list of 'linear_attention'"),
    ("layer_types", lambda r: r.pop("layer_types"), "neither layer_types nor linear_attn_config"),
    ("linear_head_dim", lambda r: r.pop("linear_head_dim"), "required: layer_types names linear_attention"),
    ("linear_num_heads", lambda r: r.update(linear_num_heads=0), "an integer >= 1"),
    ("attention_bias", lambda r: r.update(attention_bias=True), "no biases"),
]


@pytest.mark.parametrize("field,mutate,problem", HF_BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(HF_BAD)])
def test_bad_transformers_configs_name_the_key(hf_raw, field, mutate, problem):
    mutate(hf_raw)
    with pytest.raises(ConfigError, match=problem) as err:
        K3Config.from_dict(hf_raw)
    assert err.value.field == field, str(err.value)


def test_layer_types_without_kda_layers_mean_no_kda(hf_raw):
    hf_raw["layer_types"] = ["full_attention"] * 6
    cfg = K3Config.from_dict(hf_raw)
    assert cfg.linear_attn is None and cfg.layer_types == ("mla",) * 6
