"""Field readers and sub-configs behind K3Config: typed reads that name the field on error."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A config field is missing, has a bad value, or contradicts another field."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"config field '{field}': {problem}")


class FieldReader:
    """Reads typed fields from one config dict; remembers which keys it read."""

    def __init__(self, data: dict[str, Any], prefix: str):
        self.data, self.prefix, self.read = data, prefix, set()

    def _get(self, name: str, default: Any) -> Any:
        self.read.add(name)
        return self.data.get(name, default)

    def _bad(self, name: str, what: str, value: Any) -> ConfigError:
        return ConfigError(self.prefix + name, f"expected {what}, got {value!r}")

    def optional_int(self, name: str, default: int | None, *, minimum: int | None = None) -> int | None:
        value = self._get(name, default)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, "an integer", value)
        if minimum is not None and value < minimum:
            raise self._bad(name, f"an integer >= {minimum}", value)
        return value

    def int(self, name: str, default: int, *, minimum: int | None = None) -> int:
        value = self.optional_int(name, default, minimum=minimum)
        if value is None:
            raise self._bad(name, "an integer", None)
        return value

    def optional_float(self, name: str, default: float | None, *, positive: bool = False) -> float | None:
        value = self._get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(name, "a number", value)
        if positive and not value > 0:
            raise self._bad(name, "a positive number", value)
        return float(value)

    def float(self, name: str, default: float, *, positive: bool = False) -> float:
        value = self.optional_float(name, default, positive=positive)
        if value is None:
            raise self._bad(name, "a number", None)
        return value

    def bool(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self._bad(name, "true or false", value)
        return value

    def str(self, name: str, default: str) -> str:
        value = self._get(name, default)
        if not isinstance(value, str):
            raise self._bad(name, "a string", value)
        return value

    def choice(self, name: str, default: str, options: tuple[str, ...]) -> str:
        value = self._get(name, default)
        if value not in options:
            raise self._bad(name, "one of " + ", ".join(repr(o) for o in options), value)
        return value


@dataclass(frozen=True)
class LinearAttnConfig:
    """`linear_attn_config`: the KDA layers. Layer lists are 1-based, as in the checkpoint."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float | None     # K3: -5.0 (bounded sigmoid gate); None: softplus gate
    use_full_rank_gate: bool           # K3: full-rank g_proj; False: low-rank g_a/g_b (Kimi-Linear)
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        out = {"num_heads": self.num_heads, "head_dim": self.head_dim,
               "short_conv_kernel_size": self.short_conv_kernel_size,
               "use_full_rank_gate": self.use_full_rank_gate,
               "kda_layers": list(self.kda_layers), "full_attn_layers": list(self.full_attn_layers)}
        if self.gate_lower_bound is not None:
            out["gate_lower_bound"] = self.gate_lower_bound
        return out


def parse_linear_attn_config(raw: Any, prefix: str, num_layers: int) -> LinearAttnConfig | None:
    if raw is None:
        return None
    p = prefix + "linear_attn_config."
    if not isinstance(raw, dict):
        raise ConfigError(p[:-1], f"expected an object, got {raw!r}")
    r = FieldReader(raw, p)
    for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
        if name not in raw:
            raise ConfigError(p + name, "required (no default exists for the KDA layers)")
    lower = r.optional_float("gate_lower_bound", None)
    if lower is not None and not -5.0 <= lower < 0.0:
        raise ConfigError(p + "gate_lower_bound", f"must lie in [-5, 0) (the kernels' fp32 range bound), got {lower}")
    lists = {}
    for name in ("kda_layers", "full_attn_layers"):
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ConfigError(p + name, f"expected a list of 1-based layer numbers, got {value!r}")
        bad = [v for v in value if not 1 <= v <= num_layers]
        if bad:
            raise ConfigError(p + name, f"layer numbers are 1-based in [1, {num_layers}]; out of range: {bad}")
        if len(set(value)) != len(value):
            raise ConfigError(p + name, "lists a layer twice")
        lists[name] = tuple(sorted(value))
    if not lists:
        raise ConfigError(p + "kda_layers", "kda_layers or full_attn_layers is required")
    everything = set(range(1, num_layers + 1))
    kda = lists.get("kda_layers", tuple(sorted(everything - set(lists.get("full_attn_layers", ())))))
    full = lists.get("full_attn_layers", tuple(sorted(everything - set(kda))))
    both = set(kda) & set(full)
    if both:
        raise ConfigError(p + "kda_layers", f"layers {sorted(both)} are also in full_attn_layers")
    neither = everything - set(kda) - set(full)
    if neither:
        raise ConfigError(p + "kda_layers", f"layers {sorted(neither)} (1-based) are in neither kda_layers nor full_attn_layers")
    return LinearAttnConfig(
        num_heads=r.int("num_heads", 0, minimum=1),
        head_dim=r.int("head_dim", 0, minimum=1),
        short_conv_kernel_size=r.int("short_conv_kernel_size", 4, minimum=1),
        gate_lower_bound=lower,
        use_full_rank_gate=r.bool("use_full_rank_gate", False),
        kda_layers=kda,
        full_attn_layers=full,
    )


@dataclass(frozen=True)
class QuantizationConfig:
    """`quantization_config`: compressed-tensors weights of the routed experts (only they are
    quantised; the rest of the model is dense): MXFP4 (`mxfp4-pack-quantized`, E2M1 codes with
    an E8M0 scale per 32) or W4A16 (`pack-quantized`: symmetric int4, one scale per group)."""

    quant_method: str
    format: str
    num_bits: int
    group_size: int
    ignore: tuple[str, ...]
    raw: dict[str, Any]
    type: str = "float"           # the weights' element type: "float" (E2M1) or "int"


SUPPORTED_QUANT_FORMATS = ("mxfp4-pack-quantized", "pack-quantized")
_SUPPORTED = ("mxfp4-pack-quantized (MXFP4: 4-bit float, group_size 32) and pack-quantized (W4A16: 4-bit int, "
              "symmetric, strategy group)")


def parse_quantization_config(raw: Any, prefix: str) -> QuantizationConfig | None:
    """The routed experts' quantisation, or None. ConfigError naming the field (and the
    formats k3 reads) for anything k3 does not support."""
    if raw is None:
        return None
    p = prefix + "quantization_config."
    if not isinstance(raw, dict):
        raise ConfigError(p[:-1], f"expected an object, got {raw!r}")
    method = raw.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(p + "quant_method", f"k3 reads 'compressed-tensors' routed experts ({_SUPPORTED}); "
                                              f"got {method!r}")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise ConfigError(p + "config_groups", f"expected an object, got {groups!r}")
    if len(groups) > 1:
        raise ConfigError(p + "config_groups", f"one quantisation group is supported, got {len(groups)}")
    group_name, group = next(iter(groups.items()), ("group_0", {}))
    if not isinstance(group, dict):
        raise ConfigError(f"{p}config_groups.{group_name}", f"expected an object, got {group!r}")
    gp = f"{p}config_groups.{group_name}."
    fmt = raw.get("format") or group.get("format")
    if fmt not in SUPPORTED_QUANT_FORMATS:
        where = p + "format" if raw.get("format") or not group.get("format") else gp + "format"
        raise ConfigError(where, f"k3 reads {_SUPPORTED}; got {fmt!r}")
    if group.get("format") not in (None, fmt):
        raise ConfigError(gp + "format", f"{group['format']!r} contradicts {p}format {fmt!r}")
    weights = group.get("weights") or {}
    if not isinstance(weights, dict):
        raise ConfigError(gp + "weights", f"expected an object, got {weights!r}")
    wp = gp + "weights."
    num_bits = weights.get("num_bits", 4)
    if num_bits != 4:
        raise ConfigError(wp + "num_bits", f"{fmt}: k3 reads 4-bit weights, got {num_bits!r}")
    kind = weights.get("type", "float" if fmt == "mxfp4-pack-quantized" else "int")
    want = "float" if fmt == "mxfp4-pack-quantized" else "int"
    if kind != want:
        raise ConfigError(wp + "type", f"{fmt} holds {want} weights (k3 reads {_SUPPORTED}), got {kind!r}")
    if fmt == "mxfp4-pack-quantized":
        group_size = weights.get("group_size", 32)   # mxfp4-pack-quantized implies 32
        if group_size != 32:
            raise ConfigError(wp + "group_size", f"{fmt} has one E8M0 scale per 32 weights, got {group_size!r}")
    else:
        _check_int4_weights(weights, wp)
        group_size = weights["group_size"]
    if group.get("input_activations"):
        raise ConfigError(gp + "input_activations", "activation quantisation is not supported (weights only)")
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ConfigError(p + "ignore", f"expected a list of module names or 're:' patterns, got {ignore!r}")
    return QuantizationConfig(quant_method=method, format=fmt, num_bits=4, group_size=group_size,
                              ignore=tuple(ignore), raw=copy.deepcopy(raw), type=want)


def _check_int4_weights(weights: dict[str, Any], wp: str) -> None:
    """pack-quantized weights k3 reads: symmetric int4 in groups along the input (no zero
    points, no activation ordering)."""
    strategy = weights.get("strategy", "group")
    if strategy != "group":
        raise ConfigError(wp + "strategy", f"pack-quantized: k3 reads strategy 'group' (one scale per group_size "
                                           f"input columns), got {strategy!r}")
    group_size = weights.get("group_size")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(wp + "group_size", f"pack-quantized with strategy group needs a positive integer, "
                                             f"got {group_size!r}")
    if weights.get("symmetric", True) is not True:
        raise ConfigError(wp + "symmetric", "pack-quantized: k3 reads symmetric int4 only (no weight_zero_point), "
                                            f"got {weights.get('symmetric')!r}")
    if weights.get("actorder") not in (None, False):
        raise ConfigError(wp + "actorder", f"activation ordering (weight_g_idx) is not supported, "
                                           f"got {weights.get('actorder')!r}")
    if weights.get("dynamic") not in (None, False):
        raise ConfigError(wp + "dynamic", f"weights must be static, got {weights.get('dynamic')!r}")
