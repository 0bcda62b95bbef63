"""A request as the engine tracks it, and the outputs it returns (vLLM's shapes)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """A token's log-probability at a position (vLLM's `Logprob`): rank 1 is the most likely
    token (the number of tokens whose log-probability is at least this one's); decoded_token is
    its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class Request:
    """One sequence being generated. Its cache: `rows` (attention rows in position order) and
    `state_row` (its running KDA state), both from the BlockPool."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # params.prompt_logprobs: entry j for prompt token j (None for token 0), filled as the
    # prefill reaches each position
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    rows: list[int] = field(default_factory=list)
    state_row: int | None = None
    finish_reason: str | None = None        # "stop", "length", "abort"
    stop_reason: str | int | None = None    # the stop string or token id that ended it
    first_scheduled_time: float | None = None   # first admitted to the running batch (queue time ends)
    first_token_time: float | None = None
    num_preemptions: int = 0
    # prefix caching
    prefix_hit_tokens: int = 0              # tokens reused from the cache at admission
    prefix_units: int = 0                   # units of this request registered in the cache
    checkpoint_targets: list[int] = field(default_factory=list)
    # speculative decoding: drafts for the next verify step, and the rows / slot it uses
    spec_tokens: list[int] = field(default_factory=list)
    spec_probs: object = None               # [k, V] draft distributions, or None (one-hot)
    spec_rows: list[int] = field(default_factory=list)
    record_slot: int | None = None
    # structured outputs: the request's k3.structured.RequestGrammar (None: unconstrained)
    grammar: object = None
    # prefill/decode disaggregation: the handle a producer published for this request's rows
    kv_transfer_params: dict | None = None
    # images: k3.engine.media.RequestMedia (placeholder spans, content hashes, encoder outputs)
    media: object = None
    # LoRA: the adapter slot the request runs on (-1: the base model) and its prefix-cache salt
    # (the adapter load's: requests of two adapters never share cached prefixes)
    lora_slot: int = -1
    cache_salt: bytes = b""

    @property
    def media_spans(self) -> list:
        """(offset, tokens, content hash) of each image: what its prefix-cache keys mix in."""
        return self.media.spans if self.media is not None else []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None   # per token: {token id: logprob} (sampled + top)
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # {token id: Logprob} holding that token and the top-n at its position; None when not asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # a producer's transfer handle of a published prefill (vLLM's field; None otherwise)
    kv_transfer_params: dict | None = None
