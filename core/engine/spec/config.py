"""`--speculative-config`: vLLM's JSON shape, plus k3's `kda_rollback`; unknown keys refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "dspark", "mtp")
SAMPLE_METHODS = ("greedy", "probabilistic")
ROLLBACKS = ("states", "recover")


class SpeculativeConfigError(ValueError):
    """A bad --speculative-config: the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_sample_method: str = "greedy"
    kda_rollback: str = "states"
    rejection_sample_method: str = "standard"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> "SpeculativeConfig | None":
        """From the flag's JSON text (or a dict); None stays None."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative config key {unknown[0]!r} is not implemented by k3 "
                                         f"(known: {', '.join(sorted(known))})")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise SpeculativeConfigError(f"speculative config key {required!r} is required")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        def need(ok: bool, key: str, problem: str) -> None:
            if not ok:
                raise SpeculativeConfigError(f"speculative config {key!r}: {problem}")

        need(self.method in METHODS, "method", f"one of {', '.join(METHODS)}, got {self.method!r}")
        need(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
             "num_speculative_tokens", f"an integer in [1, 16], got {self.num_speculative_tokens!r}")
        need(self.method in ("ngram", "mtp") or bool(self.model), "model",
             f"method {self.method!r} needs a draft model directory")
        need(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1, "prompt_lookup_min",
             f"an integer >= 1, got {self.prompt_lookup_min!r}")
        need(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
             "prompt_lookup_max", f"an integer >= prompt_lookup_min, got {self.prompt_lookup_max!r}")
        need(self.draft_sample_method in SAMPLE_METHODS, "draft_sample_method",
             f"one of {', '.join(SAMPLE_METHODS)}, got {self.draft_sample_method!r}")
        need(self.kda_rollback in ROLLBACKS, "kda_rollback", f"one of {', '.join(ROLLBACKS)}, got {self.kda_rollback!r}")
        need(self.rejection_sample_method == "standard", "rejection_sample_method",
             f"only 'standard' (per-token rule with residual resampling) is implemented, got "
             f"{self.rejection_sample_method!r}")
