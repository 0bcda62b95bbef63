"""The FastAPI application of `k3 serve`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from . import chat, completions, lora, metrics, models, responses_api, tokenize
from .docs_auth import protect_docs
from .docs_page import install_docs_page
from .errors import install_error_handlers
from .limits import DEFAULT_MAX_PROMPTS
from .media import MediaOptions
from .sampling import DEFAULT_KEYS
from .state import ServerState
from .token_bound import TokenBound, publish_token_bound

TOOL_CALL_PARSERS = ("kimi_k3",)
REASONING_PARSERS = ("kimi_k3",)


def generation_defaults(model_dir: str | Path | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Request defaults (temperature, top_p, top_k, min_p, repetition_penalty) from
    `model_dir`/generation_config.json (None: none), with `overrides` over them, as vLLM's
    `--generation-config auto|DIR|vllm` and `--override-generation-config` apply them. Other
    keys of the file are ignored; an override key k3 does not apply, or a value that is not a
    number, is a ValueError."""
    config: dict[str, Any] = {}
    if model_dir is not None:
        try:
            config = json.loads((Path(model_dir) / "generation_config.json").read_text())
        except (OSError, ValueError):
            config = {}
    out = {k: config[k] for k in DEFAULT_KEYS if _number(config.get(k))}
    for key, value in (overrides or {}).items():
        if key not in DEFAULT_KEYS:
            raise ValueError(f"generation config override {key!r}: k3 applies {', '.join(DEFAULT_KEYS)}")
        if not _number(value):
            raise ValueError(f"generation config override {key!r}: expected a number, got {value!r}")
        out[key] = value
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def build_app(engine, *, served_model_name: str | list[str], api_key: str | list[str] | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, sampling_defaults: dict[str, Any] | None = None,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS,
              max_prompt_tokens_per_request: int | None = None, public_docs: bool = False,
              chat_template=None, log_requests: bool = False, max_log_len: int = 0,
              media: MediaOptions | None = None) -> FastAPI:
    """The OpenAI-compatible app over a running `AsyncEngine`.

    served_model_name: the name(s) clients pass as `model` (the first is reported back).
    api_key: a key or a list of keys; when set, /v1 routes need `Authorization: Bearer KEY` with
    one of them (/health, /metrics do not),
    and so do /docs and /openapi.json unless public_docs (`k3.serve.docs_auth`; /docs is served from
    the installed Swagger UI package, `k3.serve.docs_page`).
    enable_auto_tool_choice + tool_call_parser="kimi_k3": tool calls in K3 output become
    `tool_calls` (else they stay in the content). reasoning_parser="kimi_k3": the think
    channel becomes `reasoning_content`. Both parsers read K3 XTML: ValueError for a model
    with another chat format. sampling_defaults: request defaults (see generation_defaults).
    max_prompts_per_request / max_prompt_tokens_per_request: the prompts, and their tokens in
    all (None: max_model_len), one request may bring (400 above; `k3.serve.limits`).
    media: the policy for chat image_url parts (`k3.serve.media`; default: data URLs only).
    chat_template: a `k3.chat.jinja_template.JinjaChatTemplate` that renders chat prompts instead
    of the model's own chat format (vLLM's --chat-template; also for a tokenizer without one).
    log_requests: log one line per request (id, prompt tokens, params; `k3.serve.request_log`),
    with the first max_log_len characters of the prompt when max_log_len > 0.
    The caller owns the engine (shut it down after the server stops). The body-size limit and
    the shutdown drain are ASGI middlewares `k3 serve` puts in front (`BodyLimit`, `DrainGate`).
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("served_model_name must be a non-empty name or list of names")
    if tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise ValueError(f"unknown tool call parser {tool_call_parser!r} (known: {', '.join(TOOL_CALL_PARSERS)})")
    if reasoning_parser not in (None, *REASONING_PARSERS):
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: {', '.join(REASONING_PARSERS)})")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool call parser (kimi_k3)")
    flavor = engine.tokenizer.flavor
    if (tool_call_parser or reasoning_parser) and flavor != "k3":
        used = (f"uses the {flavor.upper()} chat format (its parsers are not implemented yet)" if flavor
                else "has no chat format (its tokenizer has no K3 or K2 chat markers)")
        raise ValueError(f"the kimi_k3 parsers read K3 XTML output, but this model {used}: leave the parser "
                         "options out")
    keys = None if api_key is None else ((api_key,) if isinstance(api_key, str) else tuple(api_key))
    if keys is not None and (not keys or not all(isinstance(k, str) and k for k in keys)):
        raise ValueError("api_key must be a non-empty key or list of keys")
    if max_prompts_per_request < 1 or (max_prompt_tokens_per_request is not None and max_prompt_tokens_per_request < 1):
        raise ValueError("max_prompts_per_request and max_prompt_tokens_per_request must be at least 1")
    state = ServerState(engine=engine, model_names=names, api_keys=keys,
                        max_prompts_per_request=max_prompts_per_request,
                        max_prompt_tokens_per_request=max_prompt_tokens_per_request,
                        parse_tool_calls=bool(enable_auto_tool_choice and tool_call_parser),
                        parse_reasoning=reasoning_parser is not None, sampling_defaults=dict(sampling_defaults or {}),
                        chat_template=chat_template, log_requests=log_requests, max_log_len=max_log_len,
                        media=media or MediaOptions())
    from k3 import __version__

    app = FastAPI(title="k3", version=__version__, docs_url=None, redoc_url=None,
                  swagger_ui_oauth2_redirect_url=None,
                  description="OpenAI-compatible API of k3 (Kimi K3-architecture models). See docs/serving.md.")
    install_docs_page(app)                               # /docs from the installed package, no CDN
    app.state.k3 = state
    install_error_handlers(app)
    if api_key is not None and not public_docs:
        protect_docs(app)
    for router in (chat.router, completions.router, responses_api.router, tokenize.router, models.v1, models.router, metrics.router):
        app.include_router(router)
    if getattr(getattr(engine, "engine", None), "lora", None) is not None:   # as vLLM: LoRA routes only with LoRA on
        app.include_router(lora.v1)
    _bound_token_ids(app, state)
    return app


def _bound_token_ids(app: FastAPI, state: ServerState) -> None:
    """Token-id fields are validated against, and /openapi.json publishes, one bound: the
    served model's (`ServerState.token_id_limit`, `k3.serve.token_bound`)."""
    app.add_middleware(TokenBound, limit=lambda: state.token_id_limit)
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = publish_token_bound(generate(), state.token_id_limit)
        return app.openapi_schema

    app.openapi = openapi
