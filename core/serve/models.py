"""GET /v1/models, /v1/models/{model}, /health (and vLLM's /ping, GET or POST) and /version."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from .errors import APIError
from .responses import ERROR_RESPONSES, ErrorResponse, ModelCard, ModelList
from .state import ServerState, get_state, require_api_key

router = APIRouter()
v1 = APIRouter(dependencies=[Depends(require_api_key)])


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.created, root=state.model_path, max_model_len=state.max_model_len)


def _adapter_card(state: ServerState, adapter) -> ModelCard:
    """A loaded LoRA adapter, as vLLM lists one: root its folder, parent the base model."""
    return ModelCard(id=adapter.name, created=state.created, root=adapter.path, parent=state.model_names[0],
                     max_model_len=state.max_model_len)


@v1.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
async def list_models(request: Request) -> ModelList:
    """The served model names (every --served-model-name), then the loaded LoRA adapters."""
    state = get_state(request)
    return ModelList(data=[_card(state, name) for name in state.model_names]
                     + [_adapter_card(state, a) for a in state.lora_adapters()])


@v1.get("/v1/models/{model:path}", response_model=ModelCard,
        responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
async def get_model(model: str, request: Request) -> ModelCard:
    """One served model or LoRA adapter, or 404."""
    state = get_state(request)
    state.check_model(model)
    adapter = next((a for a in state.lora_adapters() if a.name == model and model not in state.model_names), None)
    return _card(state, model) if adapter is None else _adapter_card(state, adapter)


@router.get("/health", response_class=Response,
            responses={200: {"description": "the engine is alive"},
                       503: {"model": ErrorResponse, "description": "the engine has failed"}})
async def health(request: Request) -> Response:
    """200 with {"status": "ok"} while the engine loop runs (vLLM answers 200 with no body:
    probes that read only the status work with both), 503 with an error body once it has failed."""
    dead = get_state(request).engine.dead
    if dead:
        raise APIError(503, f"the engine has failed: {dead}", code="engine_dead")
    return Response(content=b'{"status":"ok"}', status_code=200, media_type="application/json")


_PROBE = {200: {"description": "the engine is alive"},
          503: {"model": ErrorResponse, "description": "the engine has failed"}}


@router.get("/ping", response_class=Response, responses=_PROBE)
async def ping(request: Request) -> Response:
    """vLLM's (SageMaker's) liveness probe: the same answer as /health."""
    return await health(request)


@router.post("/ping", response_class=Response, responses=_PROBE)
async def ping_post(request: Request) -> Response:
    """POST /ping, as SageMaker sends it: the same answer as /health."""
    return await health(request)


@router.get("/version")
async def version() -> dict:
    """The k3 version."""
    from k3 import __version__

    return {"version": __version__}
