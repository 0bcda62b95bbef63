"""Which grammar backend an engine uses, from vLLM's flags: `--structured-outputs-config`
(a JSON object; vLLM's current spelling) or the older `--guided-decoding-backend NAME`.

Backends: "auto" and "xgrammar" (the default), "guidance" (vLLM's name for llguidance) and
"llguidance". Of the config's other keys, k3 accepts what it already does ("disable_any_whitespace":
true, JSON is always compact; "disable_fallback": k3 never falls back to another backend) and
refuses the rest with the reason, as `--speculative-config` does.
"""

from __future__ import annotations

BACKENDS = {"auto": "xgrammar", "xgrammar": "xgrammar", "guidance": "guidance", "llguidance": "llguidance"}
_NOT_IMPLEMENTED = ("outlines", "lm-format-enforcer")


class StructuredOutputsConfigError(ValueError):
    """A bad --structured-outputs-config or --guided-decoding-backend: the message names the key."""


def backend_name(name: object, flag: str = "--guided-decoding-backend") -> str:
    """The registered backend (`k3.structured.backend`) that vLLM's backend `name` means."""
    if name in _NOT_IMPLEMENTED:
        raise StructuredOutputsConfigError(f"{flag}: the {name} backend is not implemented by k3 (known: "
                                           f"{', '.join(BACKENDS)})")
    if name not in BACKENDS:
        raise StructuredOutputsConfigError(f"{flag}: unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    return BACKENDS[name]


def parse_structured_outputs_config(value: dict | None, guided_decoding_backend: str | None = None) -> str:
    """The backend name from the flags' values (the config as a dict: the CLI reads the JSON
    with `k3.cli.values.json_object`; None, None: the default, xgrammar)."""
    if value is not None and guided_decoding_backend is not None:
        raise StructuredOutputsConfigError("give --structured-outputs-config or --guided-decoding-backend, not both")
    if guided_decoding_backend is not None:
        return backend_name(guided_decoding_backend)
    if value is None:
        return BACKENDS["auto"]
    flag = "--structured-outputs-config"
    if not isinstance(value, dict):
        raise StructuredOutputsConfigError(f"{flag} must be a JSON object")
    for key, setting in value.items():
        if key == "disable_any_whitespace" and setting is not True:
            raise StructuredOutputsConfigError(f"{flag} key 'disable_any_whitespace': k3 always generates compact "
                                               "JSON (no free whitespace); only true is accepted")
        if key == "reasoning_parser":
            raise StructuredOutputsConfigError(f"{flag} key 'reasoning_parser': use --reasoning-parser")
        if key not in ("backend", "disable_any_whitespace", "disable_fallback"):
            raise StructuredOutputsConfigError(f"{flag} key {key!r} is not implemented by k3 (known: backend, "
                                               "disable_any_whitespace, disable_fallback)")
    return backend_name(value.get("backend", "auto"), f"{flag} key 'backend'")
