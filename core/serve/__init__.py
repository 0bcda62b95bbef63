"""k3.serve: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine.

    app = build_app(AsyncEngine(LLMEngine(config)), served_model_name="k3-tiny")

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models,
GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /health, GET|POST /ping, GET /metrics,
GET /version, GET /docs (Swagger UI from the installed package). `k3 serve` (k3.cli.serve) builds the engine, the app
and the uvicorn server from vLLM-style flags; docs/serving.md documents both.

Modules, one concern each: protocol (request bodies), responses (response bodies), errors
(OpenAI error bodies), sampling (request -> SamplingParams, usage, logprobs), streaming (SSE,
several prompts, disconnects), chat, completions, responses_api + responses_input (/v1/responses),
tokenize, models (+ health, ping), metrics, docs_page, docs_auth, state, app.
"""

from .app import build_app, generation_defaults

__all__ = ["build_app", "generation_defaults"]
