"""SamplingParams in vLLM's shape, validated with errors that name the field."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3.structured.errors import StructuredOutputError
from k3.structured.spec import StructuredOutputsParams

# A logits processor / token bitmask hook: called with the request's output token ids so far,
# returns the token ids allowed next (structured output, forced tool choice), or None for all.
AllowedTokensFn = Callable[[Sequence[int]], "Sequence[int] | None"]
INT64 = 2 ** 63


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `field` names it."""

    def __init__(self, field_name: str, problem: str):
        self.field = field_name
        super().__init__(f"{field_name}: {problem}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16          # None: up to the context limit
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None          # top logprobs per generated token (0: only the sampled one's)
    # log-probabilities of the prompt tokens after the first, each with the top-n tokens at its
    # position (0: only the prompt token's), as vLLM's RequestOutput.prompt_logprobs; a request
    # that asks for them does not start from the prefix cache (every position is computed)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    allowed_tokens: AllowedTokensFn | None = field(default=None, repr=False)
    # structured outputs (vLLM's field): the output must match a JSON schema, a regex, one of
    # several strings or a grammar (k3.structured); a dict is read as StructuredOutputsParams(**it)
    structured_outputs: StructuredOutputsParams | None = None
    # prefill/decode disaggregation (vLLM's field, docs/disaggregation.md): {"do_remote_decode": true}
    # on a producer (prefill here, publish the rows), a producer's handle ({"do_remote_prefill":
    # true, ...}) on a consumer (pull the rows, decode here)
    kv_transfer_params: dict | None = field(default=None, repr=False)
    # the LoRA adapter the request runs on (a name the engine has loaded, docs/lora.md); None: the
    # base model. vLLM passes a LoRARequest beside the params; carried here, it reaches the engine
    # through every path that forwards the params (n > 1 children, the async engine)
    lora_name: str | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except (TypeError, StructuredOutputError) as e:
                raise SamplingParamsError("structured_outputs", str(e)) from None
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, problem: str) -> None:
            if not ok:
                raise SamplingParamsError(name, problem)

        need(isinstance(self.n, int) and 1 <= self.n <= 16, "n", f"must be an integer in [1, 16], got {self.n!r}")
        need(0 <= self.temperature <= 100, "temperature", f"must be in [0, 100], got {self.temperature!r}")
        need(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        need(isinstance(self.top_k, int) and 0 <= self.top_k < INT64, "top_k",
             f"must be -1, 0 or a positive integer below 2**63, got {self.top_k!r}")
        need(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        need(0 < self.repetition_penalty <= 10, "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= self.MAX_LOGPROBS),
             "logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        need(self.prompt_logprobs is None
             or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS),
             "prompt_logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        need(self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict), "kv_transfer_params",
             f"must be an object or None, got {type(self.kv_transfer_params).__name__}")
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields) or None")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        # Seeds go to int64 tensors; sample i of n uses seed + i.
        need(self.seed is None or (isinstance(self.seed, int) and -INT64 <= self.seed < INT64 - self.n), "seed",
             f"must be an integer in [-2**63, 2**63 - n), got {self.seed!r}")

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
