"""transformers' spellings of a Kimi-Linear config.json, read onto K3Config's fields.

`KimiLinearConfig.save_pretrained` (transformers 5) writes the KDA layers as flat fields and
per-layer lists instead of the checkpoint's `linear_attn_config`:

    linear_num_heads, linear_head_dim, linear_conv_kernel_dim   (linear_attn_config's num_heads,
                                                                 head_dim, short_conv_kernel_size)
    layer_types:     "linear_attention" | "full_attention" per 0-based layer (the 1-based lists)
    mlp_layer_types: "dense" | "sparse" per 0-based layer (first_k_dense_replace, moe_layer_freq)

and its `attribute_map` lets a config name some fields by other keys (`n_group` for
`num_expert_group`, ...). Every spelling is accepted; where a config carries two spellings of
one value they must agree, and errors name the key as the file spells it. K3Config writes
the canonical spelling back (`linear_attn_config`, `first_k_dense_replace`), which transformers
reads as well.
"""

from __future__ import annotations

from typing import Any

from ._config_fields import ConfigError, FieldReader

# transformers' KimiLinearConfig.attribute_map: alias -> the field K3Config reads
ALIASES = {
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
}
# flat KDA fields -> their key in linear_attn_config
FLAT_LINEAR = {"linear_num_heads": "num_heads", "linear_head_dim": "head_dim",
               "linear_conv_kernel_dim": "short_conv_kernel_size"}
LAYER_TYPES = {"linear_attention": "kda", "full_attention": "mla"}
MLP_TYPES = ("dense", "sparse")
# keys this module consumes (K3Config writes their content back in canonical form)
CONSUMED = frozenset({*ALIASES, *FLAT_LINEAR, "layer_types", "mlp_layer_types"})


def resolve_aliases(text: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A copy of `text` with every alias key renamed to its field, and {field: alias} for the
    aliases used (so errors can name the key the file has). Both spellings present: they must
    agree."""
    out, spelled = dict(text), {}
    for alias, name in ALIASES.items():
        if alias not in text:
            continue
        value = out.pop(alias)
        if name in text and text[name] != value:
            raise ConfigError(prefix + alias, f"{value!r} contradicts {name} = {text[name]!r} (the same field)")
        if name not in text:
            out[name], spelled[name] = value, alias
    return out, spelled


def _typed_list(text: dict[str, Any], prefix: str, key: str, options, num_layers: int) -> list[str] | None:
    value = text.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or any(v not in options for v in value):
        raise ConfigError(prefix + key, f"expected a list of {', '.join(map(repr, options))}, got {value!r}")
    if len(value) != num_layers:
        raise ConfigError(prefix + key, f"has {len(value)} entries, expected num_hidden_layers = {num_layers}")
    return value


def linear_attn_raw(text: dict[str, Any], prefix: str, num_layers: int) -> tuple[Any, dict[str, str]]:
    """The `linear_attn_config` object K3Config parses: the config's own (keys it lacks taken
    from the flat fields), or one built from transformers' flat fields and `layer_types` (None
    when no layer is KDA); and the {linear_attn_config.key: flat key} spellings used. Both
    forms present: they must agree."""
    nested = text.get("linear_attn_config")
    if nested is not None and not isinstance(nested, dict):
        return nested, {}                       # parse_linear_attn_config names the error
    types = _typed_list(text, prefix, "layer_types", tuple(LAYER_TYPES), num_layers)
    r = FieldReader(text, prefix)
    flat = {inner: r.int(key, 0, minimum=1) for key, inner in FLAT_LINEAR.items() if key in text}
    if nested is None and types is None:
        if flat:
            raise ConfigError(prefix + "layer_types", f"{', '.join(k for k in FLAT_LINEAR if k in text)} set, "
                                                      "but neither layer_types nor linear_attn_config says which "
                                                      "layers are KDA")
        return None, {}
    raw, spelled = dict(nested or {}), {}
    for key, inner in FLAT_LINEAR.items():
        if inner not in flat:
            continue
        if inner in raw and raw[inner] != flat[inner]:
            raise ConfigError(prefix + key, f"{flat[inner]} contradicts linear_attn_config.{inner} = {raw[inner]!r}")
        if inner not in raw:
            raw[inner], spelled[f"linear_attn_config.{inner}"] = flat[inner], key
    if types is not None:
        kda = [i + 1 for i, t in enumerate(types) if LAYER_TYPES[t] == "kda"]
        lists = {"kda_layers": kda, "full_attn_layers": [i for i in range(1, num_layers + 1) if i not in kda]}
        for name, expected in lists.items():
            given = raw.get(name)
            if isinstance(given, list) and sorted(given) != expected:
                raise ConfigError(prefix + "layer_types", f"makes {name} {expected} (1-based), but "
                                                          f"linear_attn_config.{name} is {given}")
        if nested is None and not kda:
            return None, {}                     # every layer full attention: no KDA section
        if "kda_layers" not in raw and "full_attn_layers" not in raw:
            raw.update(lists)
            spelled.update({f"linear_attn_config.{name}": "layer_types" for name in lists})
    if nested is None:
        raw.setdefault("short_conv_kernel_size", 4)      # transformers' default
        for key, inner in FLAT_LINEAR.items():
            if inner not in raw:
                raise ConfigError(prefix + key, "required: layer_types names linear_attention (KDA) layers")
    return raw, spelled


def first_k_dense(text: dict[str, Any], prefix: str, num_layers: int, *, moe_layer_freq: int,
                  has_experts: bool) -> int | None:
    """`first_k_dense_replace` as `mlp_layer_types` implies it (None without that list). The
    list must be what first_k_dense_replace and moe_layer_freq build, the only schedule k3 has."""
    types = _typed_list(text, prefix, "mlp_layer_types", MLP_TYPES, num_layers)
    if types is None:
        return None
    if "sparse" in types and not has_experts:
        raise ConfigError(prefix + "mlp_layer_types", "lists sparse (MoE) layers, but num_experts is not set")
    if not has_experts:
        return num_layers
    given = text.get("first_k_dense_replace")
    first = given if isinstance(given, int) and not isinstance(given, bool) else next(
        (i for i, t in enumerate(types) if t == "sparse"), num_layers)
    for i, t in enumerate(types):
        expected = "sparse" if i >= first and i % moe_layer_freq == 0 else "dense"
        if t != expected:
            raise ConfigError(prefix + "mlp_layer_types",
                              f"layer {i} is {t!r}, but first_k_dense_replace = {first} and moe_layer_freq = "
                              f"{moe_layer_freq} make it {expected!r} (k3 places MoE layers by those two fields)")
    return first


def check_supported(text: dict[str, Any], prefix: str) -> None:
    """transformers options whose weights k3's graph does not have."""
    if text.get("attention_bias", False) is not False:
        raise ConfigError(prefix + "attention_bias", "true is not supported: k3's MLA projections have no biases")
