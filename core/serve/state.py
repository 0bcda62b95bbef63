"""What every route reads: the engine, the served names, the parser switches, the metrics."""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from .errors import APIError
from .media import MediaOptions
from .metrics import Metrics
from .request_log import log_request
from .vllm_metrics import cache_info


@dataclass
class ServerState:
    engine: Any                      # AsyncEngine (or anything with its interface)
    model_names: list[str]           # the first is reported in responses
    api_keys: tuple[str, ...] | None = None   # --api-key: any of these (None: no key needed)
    parse_tool_calls: bool = False   # --enable-auto-tool-choice with --tool-call-parser kimi_k3
    parse_reasoning: bool = False    # --reasoning-parser kimi_k3
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: Any = None        # --chat-template: a k3.chat.jinja_template.JinjaChatTemplate (None: the
                                     # model's own chat format)
    max_prompts_per_request: int = 64              # /v1/completions prompts in one request
    max_prompt_tokens_per_request: int | None = None   # all its prompts' tokens (None: max_model_len)
    log_requests: bool = False       # --enable-log-requests: one line per request (k3.serve.request_log)
    max_log_len: int = 0             # --max-log-len: prompt characters in that line (0: none)
    media: MediaOptions = field(default_factory=MediaOptions)   # image_url policy (k3.serve.media)
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = None          # type: ignore[assignment]

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = Metrics(self.engine, model_name=self.model_names[0], cache_info=cache_info(self.engine))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def prompt_token_limit(self) -> int:
        return self.max_prompt_tokens_per_request or self.max_model_len

    @property
    def media_encoder(self):
        """The engine's MediaEncoder (k3.engine.media), None for a model without a vision tower."""
        engine = self.engine.engine
        engine = getattr(engine, "engine", engine)          # the DP front-end's rank-0 engine
        return getattr(engine, "media", None)

    @property
    def takes_images(self) -> bool:
        """Whether the model has a vision tower."""
        return self.media_encoder is not None

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model_config.vocab_size

    @property
    def token_id_limit(self) -> int:
        """Token ids a request may carry are below this: the model's vocabulary and the
        tokenizer's, whichever is smaller (validated and published by `k3.serve.token_bound`)."""
        return min(self.vocab_size, self.tokenizer.vocab_size)

    @property
    def model_path(self) -> str:
        return str(self.engine.engine.config.model)

    def log_request(self, request_id: str, model: str, prompts: list[list[int]], params) -> None:
        """With --enable-log-requests, log the admitted request (`k3.serve.request_log`)."""
        if self.log_requests:
            log_request(request_id, model, prompts, params, tokenizer=self.tokenizer, max_log_len=self.max_log_len)

    def lora_adapters(self) -> list:
        """The engine's loaded LoRA adapters (k3.lora.LoadedAdapter), [] without LoRA."""
        registry = getattr(getattr(self.engine, "engine", None), "lora", None)
        return [] if registry is None else list(registry.adapters.values())

    def check_model(self, name: str) -> str:
        """The reported model name (a LoRA adapter's own name, as vLLM reports it); 404 for a
        name this server does not serve."""
        if name in self.model_names:
            return self.model_names[0]
        if any(a.name == name for a in self.lora_adapters()):
            return name
        served = [*self.model_names, *(a.name for a in self.lora_adapters())]
        raise APIError(404, f"The model `{name}` does not exist; this server serves "
                            f"{', '.join(repr(n) for n in served)}.", param="model", code="model_not_found")

    def with_adapter(self, params, name: str):
        """params running on the LoRA adapter `name` selects (the `model` field, as vLLM reads
        it); unchanged for a served model name."""
        if name in self.model_names:
            return params
        return dataclasses.replace(params, lora_name=name)


KEYED_ROOT_PATHS = ("/tokenize", "/detokenize")   # need the key like /v1/* (vLLM leaves them open)


def needs_key(path: str) -> bool:
    """Whether a route at `path` is behind the server's API key (the /v1 routes, /tokenize,
    /detokenize; /health, /ping, /metrics, /version are open)."""
    return path.startswith("/v1/") or path in KEYED_ROOT_PATHS


def get_state(request: Request) -> ServerState:
    return request.app.state.k3


def api_key_error(request: Request) -> APIError | None:
    """The 401 for a request without the server's key (None when it has it, or no key is set)."""
    keys = get_state(request).api_keys
    if keys is None:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return APIError(401, "Missing API key: send `Authorization: Bearer KEY`.", code="invalid_api_key")
    given = token.strip().encode()
    # every key compared (no early exit), each in constant time
    if not sum(secrets.compare_digest(given, key.encode()) for key in keys):
        return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return None


async def require_api_key(request: Request) -> None:
    """Dependency of the /v1 routes: `Authorization: Bearer KEY` when the server has a key."""
    error = api_key_error(request)
    if error is not None:
        raise error
