"""K3Config: the text-model configuration of Kimi K3, Kimi K3.1 Pro and Kimi-Linear checkpoints.

Reads a Hugging Face `config.json` in either shape:
- nested, as the published Kimi K3 checkpoint: `model_type: kimi_k3` with the text model in
  `text_config` (`model_type: kimi_linear`) beside `vision_config` and other sections;
- flat, as Kimi-Linear checkpoints: `model_type: kimi_linear` at the top level.

Every field the K3 text model reads is parsed (k3-architecture.md section 1.2). An absent field
takes the default of the official `KimiLinearConfig`; a present field with a bad value, or an
inconsistent combination of fields, raises `ConfigError` naming the field. Unknown fields and
sections are kept (and written back by `to_dict`), never rejected.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _config_hf as hf
from .dtype_names import DTYPE_NAMES as DTYPES
from ._config_fields import (
    ConfigError,
    FieldReader,
    parse_linear_attn_config,
    parse_quantization_config,
)

__all__ = ["ConfigError", "K3Config", "LinearAttnConfig", "QuantizationConfig"]

# Re-exported for callers that only import k3.config.
from ._config_fields import LinearAttnConfig, QuantizationConfig  # noqa: E402

# Top-level (non-text) fields K3Config models itself; everything else at the top is kept as is.
_TOP_FIELDS = ("model_type", "text_config", "bos_token_id", "eos_token_id", "pad_token_id",
               "media_placeholder_token_id", "quantization_config", "dtype", "torch_dtype")


@dataclass(frozen=True)
class K3Config:
    """The text model of a K3-architecture checkpoint (all layer indices 0-based unless named)."""

    # --- shape of the checkpoint ---
    model_type: str                      # "kimi_k3" (nested) or "kimi_linear" (flat)
    dtype: str                           # checkpoint dtype: bfloat16 | float16 | float32 | float64
    # --- embedding and width ---
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    rms_norm_eps: float
    logit_scale: float
    # --- FFN activation ---
    hidden_act: str                      # "situ" | "silu"
    activation_situ_beta: float | None   # as written; see `situ_beta` for the value used
    activation_situ_linear_beta: float | None
    intermediate_size: int               # dense FFN width (layers < first_k_dense_replace)
    # --- MLA ---
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None                 # informational only
    q_lora_rank: int | None              # None: plain q_proj (Kimi-Linear)
    kv_lora_rank: int | None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int | None
    v_head_dim: int | None
    mla_use_output_gate: bool
    # --- DSA indexer (K3.1 Pro); all None without DSA ---
    index_n_heads: int | None
    index_head_dim: int | None
    index_topk: int | None
    # --- MoE ---
    num_experts: int | None              # None: dense model
    num_experts_per_token: int | None
    num_shared_experts: int
    moe_intermediate_size: int | None
    routed_expert_hidden_size: int | None  # LatentMoE latent width; None: experts in hidden_size
    latent_moe_use_norm: bool
    moe_router_activation_func: str      # "sigmoid" | "softmax"
    moe_renormalize: bool
    routed_scaling_factor: float
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    topk_method: str
    first_k_dense_replace: int
    moe_layer_freq: int
    min_moe_intermediate_per_partition: int
    # --- depth ---
    attn_res_block_size: int | None      # Block AttnRes; None: plain residual stream
    num_nextn_predict_layers: int
    # --- KDA ---
    linear_attn: LinearAttnConfig | None  # None: every layer is MLA
    # --- quantization ---
    quantization: QuantizationConfig | None
    # --- special tokens (ids belong to the tokenizer; these are the config's copies) ---
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    media_placeholder_token_id: int | None
    # --- kept as read, written back by to_dict ---
    extra_text: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    extra_top: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    notes: tuple[str, ...] = field(default=(), compare=False)
    # {field path: the key the source config.json spells it with}, where that is another key
    # (transformers' flat `linear_head_dim` for linear_attn_config.head_dim, an alias, ...)
    spellings: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "K3Config":
        """Parse a config.json dict (nested `kimi_k3` or flat `kimi_linear`)."""
        if not isinstance(raw, dict):
            raise ConfigError("config", f"expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if "text_config" in raw or model_type == "kimi_k3":
            if model_type not in ("kimi_k3", None):
                raise ConfigError("model_type", f"a nested config must be 'kimi_k3', got {model_type!r}")
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("text_config", "model_type 'kimi_k3' needs a text_config object")
            text_type = text.get("model_type", "kimi_linear")
            if text_type != "kimi_linear":
                raise ConfigError("text_config.model_type", f"expected 'kimi_linear', got {text_type!r}")
            return _parse(text, top=raw, prefix="text_config.", model_type="kimi_k3")
        if model_type != "kimi_linear":
            raise ConfigError(
                "model_type",
                f"expected 'kimi_k3' (nested text_config) or 'kimi_linear' (flat), got {model_type!r}",
            )
        return _parse(raw, top=raw, prefix="", model_type="kimi_linear")

    @classmethod
    def from_json_file(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "K3Config":
        """Read a config.json file, `overrides` merged in first (see `with_overrides`)."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(str(path), f"not valid JSON: {e}") from None
        return cls.from_dict(with_overrides(raw, overrides) if overrides else raw)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, overrides: dict[str, Any] | None = None) -> "K3Config":
        """Read `config.json` from a checkpoint directory (with vLLM's --hf-overrides merged in
        first, when given)."""
        return cls.from_json_file(Path(model_dir) / "config.json", overrides)

    @classmethod
    def preset(cls, name: str) -> "K3Config":
        """A named preset (see `k3.presets.PRESETS`)."""
        from .presets import preset_dict

        return cls.from_dict(preset_dict(name))

    def replace(self, **changes: Any) -> "K3Config":
        """A copy with fields changed, validated again through `from_dict(to_dict())`."""
        return K3Config.from_dict(dataclasses.replace(self, **changes).to_dict())

    def field_name(self, path: str) -> str:
        """The key of field `path` ("hidden_size", "linear_attn_config.head_dim") as this
        config's source file names it (nested configs: under "text_config.")."""
        prefix = "text_config." if self.model_type == "kimi_k3" else ""
        return prefix + self.spellings.get(path, path)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """The HF config.json this config was read from (same shape: nested or flat)."""
        text: dict[str, Any] = {"model_type": "kimi_linear"}
        for f in dataclasses.fields(self):
            if f.name in _NOT_TEXT_FIELDS:
                continue
            text[f.name] = getattr(self, f.name)
        text["mla_use_nope"] = True
        if self.linear_attn is not None:
            text["linear_attn_config"] = self.linear_attn.to_dict()
        if self.quantization is not None:
            text["quantization_config"] = copy.deepcopy(self.quantization.raw)
        for key in ("index_n_heads", "index_head_dim", "index_topk"):
            if text[key] is None:
                del text[key]
        tokens = {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
        }
        text.update(copy.deepcopy(self.extra_text))
        if self.model_type == "kimi_linear":
            out = {**text, **tokens, "dtype": self.dtype}
            if self.media_placeholder_token_id is not None:
                out["media_placeholder_token_id"] = self.media_placeholder_token_id
            out.update(copy.deepcopy(self.extra_top))
            return out
        text.update(tokens)
        text["dtype"] = self.dtype
        out = {"model_type": "kimi_k3", **copy.deepcopy(self.extra_top), **tokens,
               "media_placeholder_token_id": self.media_placeholder_token_id,
               "dtype": self.dtype, "text_config": text}
        if self.quantization is not None:
            out["quantization_config"] = copy.deepcopy(self.quantization.raw)
        return out

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ------------------------------------------------------------------ layer schedule
    def is_kda_layer(self, layer: int) -> bool:
        """True when 0-based `layer` is a KDA layer (the config's lists are 1-based)."""
        return self.linear_attn is not None and (layer + 1) in self.linear_attn.kda_layers

    @property
    def layer_types(self) -> tuple[str, ...]:
        """"kda" or "mla" per 0-based layer."""
        return tuple("kda" if self.is_kda_layer(i) else "mla" for i in range(self.num_hidden_layers))

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    def is_moe_layer(self, layer: int) -> bool:
        """True when 0-based `layer` has a (Latent)MoE FFN, False for a dense FFN."""
        return (self.num_experts is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    # ------------------------------------------------------------------ derived sizes
    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def num_attn_res_blocks(self) -> int:
        """Completed AttnRes blocks a forward can hold (block 0 is the embedding)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size) if self.uses_attn_res else 0

    @property
    def uses_dsa(self) -> bool:
        return self.index_topk is not None

    @property
    def uses_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_hidden_size(self) -> int:
        """Width the routed experts read and write: the LatentMoE latent, else hidden_size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The shared experts run as one MLP of this width (0: no shared expert)."""
        return self.num_shared_experts * (self.moe_intermediate_size or 0)

    @property
    def experts_mxfp4(self) -> bool:
        """Routed experts are stored as compressed-tensors MXFP4 (only they are quantised)."""
        return self.quantization is not None and self.quantization.format == "mxfp4-pack-quantized"

    @property
    def experts_int4(self) -> bool:
        """Routed experts are stored as compressed-tensors W4A16 (`pack-quantized` int4); the
        model dequantises them to its dtype at load and holds them dense."""
        return self.quantization is not None and self.quantization.format == "pack-quantized"

    @property
    def situ_beta(self) -> float:
        """beta_1 used by SiTU: the config's value, else 1.0 as the official code does."""
        return 1.0 if self.activation_situ_beta is None else self.activation_situ_beta

    @property
    def mla_qk_head_dim(self) -> int:
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)

    @property
    def mla_softmax_scale(self) -> float:
        """1/sqrt(qk_nope + qk_rope): NoPE keeps the full width in the scale."""
        return self.mla_qk_head_dim ** -0.5

    @property
    def mla_latent_size(self) -> int:
        """Elements cached per token per MLA layer: latent c plus the un-rotated k_pe."""
        return (self.kv_lora_rank or 0) + (self.qk_rope_head_dim or 0)

    @property
    def kda_projection_size(self) -> int:
        return self.linear_attn.num_heads * self.linear_attn.head_dim if self.linear_attn else 0

    @property
    def family(self) -> str:
        """Human label: which published model this config is shaped like."""
        if self.model_type == "kimi_linear" and not self.uses_attn_res:
            return "Kimi-Linear"
        return "Kimi K3.1 Pro" if self.uses_dsa else "Kimi K3"


# Dataclass fields that are not written as plain text_config keys.
_NOT_TEXT_FIELDS = frozenset({
    "model_type", "dtype", "linear_attn", "quantization", "bos_token_id", "eos_token_ids",
    "pad_token_id", "media_placeholder_token_id", "extra_text", "extra_top", "notes", "spellings",
})


def _parse(text: dict[str, Any], *, top: dict[str, Any], prefix: str, model_type: str) -> K3Config:
    source = text
    text, spellings = hf.resolve_aliases(text, prefix)
    hf.check_supported(text, prefix)
    r = FieldReader(text, prefix)
    notes: list[str] = []

    num_layers = r.int("num_hidden_layers", 32, minimum=1)
    heads = r.int("num_attention_heads", 32, minimum=1)
    hidden = r.int("hidden_size", 4096, minimum=1)

    max_pos = r.optional_int("max_position_embeddings", None, minimum=1)
    if max_pos is None:
        max_pos = r.optional_int("model_max_length", None, minimum=1)
    if max_pos is None:
        max_pos = 4096

    if "mla_use_nope" in text and r.bool("mla_use_nope", False) is False:
        raise ConfigError(prefix + "mla_use_nope",
                          "false (rotary MLA) is not supported: K3 and Kimi-Linear MLA are NoPE")

    hidden_act = r.choice("hidden_act", "silu", ("silu", "situ"))
    situ_beta = r.optional_float("activation_situ_beta", None, positive=True)
    situ_linear_beta = r.optional_float("activation_situ_linear_beta", None, positive=True)
    if hidden_act == "situ" and situ_beta is None:
        notes.append("hidden_act is situ but activation_situ_beta is absent: beta_1 = 1.0 "
                     "(the official default; K3 itself uses 4.0)")

    linear_raw, linear_spellings = hf.linear_attn_raw(text, prefix, num_layers)
    spellings.update(linear_spellings)
    linear_attn = parse_linear_attn_config(linear_raw, prefix, num_layers)
    moe_layer_freq = r.int("moe_layer_freq", 1, minimum=1)
    first_dense = hf.first_k_dense(text, prefix, num_layers, moe_layer_freq=moe_layer_freq,
                                   has_experts=text.get("num_experts") is not None)
    quant_raw = text.get("quantization_config", top.get("quantization_config"))
    qprefix = prefix if "quantization_config" in text else ""
    quantization = parse_quantization_config(quant_raw, qprefix)

    dtype_value = text.get("dtype", text.get("torch_dtype", top.get("dtype", top.get("torch_dtype", "bfloat16"))))
    if dtype_value not in DTYPES:
        raise ConfigError(prefix + "dtype", f"expected one of {', '.join(DTYPES)}, got {dtype_value!r}")

    def token(name: str) -> Any:
        return top.get(name, text.get(name))

    eos = token("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    for name, value in (("bos_token_id", token("bos_token_id")), ("pad_token_id", token("pad_token_id")),
                        ("media_placeholder_token_id", token("media_placeholder_token_id"))):
        _check_token_id(name, value)
    for value in eos_ids:
        _check_token_id("eos_token_id", value)

    cfg = K3Config(
        model_type=model_type,
        dtype=dtype_value,
        vocab_size=r.int("vocab_size", 163840, minimum=1),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        max_position_embeddings=max_pos,
        rms_norm_eps=r.float("rms_norm_eps", 1e-6, positive=True),
        logit_scale=r.float("logit_scale", 1.0, positive=True),
        hidden_act=hidden_act,
        activation_situ_beta=situ_beta,
        activation_situ_linear_beta=situ_linear_beta,
        intermediate_size=r.int("intermediate_size", 11008, minimum=1),
        num_attention_heads=heads,
        num_key_value_heads=r.int("num_key_value_heads", heads, minimum=1),
        head_dim=r.optional_int("head_dim", None, minimum=1),
        q_lora_rank=r.optional_int("q_lora_rank", None, minimum=1),
        kv_lora_rank=r.optional_int("kv_lora_rank", None, minimum=1),
        qk_nope_head_dim=r.optional_int("qk_nope_head_dim", None, minimum=1),
        qk_rope_head_dim=r.optional_int("qk_rope_head_dim", None, minimum=0),
        v_head_dim=r.optional_int("v_head_dim", None, minimum=1),
        mla_use_output_gate=r.bool("mla_use_output_gate", False),
        index_n_heads=r.optional_int("index_n_heads", None, minimum=1),
        index_head_dim=r.optional_int("index_head_dim", None, minimum=1),
        index_topk=r.optional_int("index_topk", None, minimum=1),
        num_experts=r.optional_int("num_experts", None, minimum=1),
        num_experts_per_token=r.optional_int("num_experts_per_token", None, minimum=1),
        num_shared_experts=r.int("num_shared_experts", 0, minimum=0),
        moe_intermediate_size=r.optional_int("moe_intermediate_size", None, minimum=1),
        routed_expert_hidden_size=r.optional_int("routed_expert_hidden_size", None, minimum=1),
        latent_moe_use_norm=r.bool("latent_moe_use_norm", False),
        moe_router_activation_func=r.choice("moe_router_activation_func", "sigmoid", ("sigmoid", "softmax")),
        moe_renormalize=r.bool("moe_renormalize", True),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0, positive=True),
        use_grouped_topk=r.bool("use_grouped_topk", True),
        num_expert_group=r.int("num_expert_group", 1, minimum=1),
        topk_group=r.int("topk_group", 1, minimum=1),
        topk_method=r.str("topk_method", "noaux_tc"),
        first_k_dense_replace=r.int("first_k_dense_replace", 0 if first_dense is None else first_dense, minimum=0),
        moe_layer_freq=moe_layer_freq,
        min_moe_intermediate_per_partition=r.int("min_moe_intermediate_per_partition", 256, minimum=1),
        attn_res_block_size=r.optional_int("attn_res_block_size", None, minimum=1),
        num_nextn_predict_layers=r.int("num_nextn_predict_layers", 0, minimum=0),
        linear_attn=linear_attn,
        quantization=quantization,
        bos_token_id=token("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=token("pad_token_id"),
        media_placeholder_token_id=token("media_placeholder_token_id"),
        extra_text={k: copy.deepcopy(v) for k, v in text.items()
                    if k not in r.read and k not in _HANDLED_TEXT_KEYS and k not in hf.CONSUMED},
        extra_top={} if top is source else {k: copy.deepcopy(v) for k, v in top.items() if k not in _TOP_FIELDS},
        notes=tuple(notes),
        spellings=spellings,
    )
    _check_consistency(cfg)
    return cfg


# Text keys consumed outside FieldReader (or rewritten by to_dict).
_HANDLED_TEXT_KEYS = frozenset({
    "model_type", "linear_attn_config", "quantization_config", "mla_use_nope", "model_max_length",
    "dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id",
})


def _check_token_id(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(name, f"expected a non-negative integer token id, got {value!r}")


def _check_consistency(cfg: K3Config) -> None:
    """Cross-field rules: each failure names the field to fix (as the config file spells it)."""
    f = cfg.field_name
    if cfg.mla_layer_ids:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(cfg, name) is None:
                raise ConfigError(f(name), f"required: layers {_short(cfg.mla_layer_ids)} are MLA layers")
    dsa = {n: getattr(cfg, n) for n in ("index_n_heads", "index_head_dim", "index_topk")}
    if any(v is not None for v in dsa.values()):
        missing = [n for n, v in dsa.items() if v is None]
        if missing:
            raise ConfigError(f(missing[0]), "the DSA indexer needs index_n_heads, index_head_dim and index_topk together")
        if not cfg.mla_layer_ids:
            raise ConfigError(f("index_topk"), "a DSA indexer needs full-attention (MLA) layers")
        if cfg.q_lora_rank is None:
            raise ConfigError(f("q_lora_rank"), "the DSA indexer reads the MLA query latent: set q_lora_rank")
        d = cfg.index_head_dim
        if d & (d - 1) or d % 32:
            raise ConfigError(f("index_head_dim"), f"must be a power of two and a multiple of 32 (Hadamard, MXFP4 keys), got {d}")
    if cfg.num_experts is not None:
        for name in ("num_experts_per_token", "moe_intermediate_size"):
            if getattr(cfg, name) is None:
                raise ConfigError(f(name), "required when num_experts is set")
        e, k = cfg.num_experts, cfg.num_experts_per_token
        if k > e:
            raise ConfigError(f("num_experts_per_token"), f"{k} exceeds num_experts = {e}")
        if e % cfg.num_expert_group:
            raise ConfigError(f("num_expert_group"), f"{cfg.num_expert_group} does not divide num_experts = {e}")
        if cfg.topk_group > cfg.num_expert_group:
            raise ConfigError(f("topk_group"), f"{cfg.topk_group} exceeds "
                              f"{f('num_expert_group')} = {cfg.num_expert_group}")
        if k > cfg.topk_group * (e // cfg.num_expert_group):
            raise ConfigError(f("num_experts_per_token"), f"{k} experts cannot be chosen from {cfg.topk_group} group(s)")
    elif cfg.quantization is not None:
        raise ConfigError(f("quantization_config"), "k3 quantises routed experts only (MXFP4 or W4A16), but "
                                                    "num_experts is not set")
    if cfg.latent_moe_use_norm and cfg.routed_expert_hidden_size is None:
        raise ConfigError(f("latent_moe_use_norm"), "true needs routed_expert_hidden_size (the LatentMoE latent)")
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        raise ConfigError(f("first_k_dense_replace"), f"{cfg.first_k_dense_replace} exceeds num_hidden_layers")
    if cfg.quantization is not None and cfg.num_experts is not None:
        group = cfg.quantization.group_size
        what = f"MXFP4 group size {group}" if cfg.experts_mxfp4 else \
            f"W4A16 group size {group} and of 8 (int4 values a word)"
        for name, width in (("moe_intermediate_size", cfg.moe_intermediate_size),
                            ("routed_expert_hidden_size" if cfg.uses_latent_moe else "hidden_size", cfg.expert_hidden_size)):
            if width % group or (cfg.experts_int4 and width % 8):
                raise ConfigError(f(name), f"{width} is not a multiple of the {what}")
    for name, value in (("bos_token_id", cfg.bos_token_id), ("pad_token_id", cfg.pad_token_id),
                        ("media_placeholder_token_id", cfg.media_placeholder_token_id)):
        if value is not None and value >= cfg.vocab_size:
            raise ConfigError(name, f"{value} is outside the vocabulary (vocab_size = {cfg.vocab_size})")
    for value in cfg.eos_token_ids:
        if value >= cfg.vocab_size:
            raise ConfigError("eos_token_id", f"{value} is outside the vocabulary (vocab_size = {cfg.vocab_size})")


def _short(ids: tuple[int, ...]) -> str:
    return ", ".join(map(str, ids[:6])) + (", ..." if len(ids) > 6 else "")


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json `raw` with `overrides` merged in (vLLM's --hf-overrides): objects merge key by
    key, anything else replaces. In a nested (kimi_k3) config, a key that config.json does not
    have at the top level applies to its text_config."""
    out = copy.deepcopy(raw)
    nested = isinstance(out.get("text_config"), dict)
    for key, value in overrides.items():
        target = out["text_config"] if nested and key not in out else out
        _merge(target, key, value)
    return out


def _merge(target: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, dict) and isinstance(target.get(key), dict):
        for k, v in value.items():
            _merge(target[key], k, v)
    else:
        target[key] = copy.deepcopy(value)
