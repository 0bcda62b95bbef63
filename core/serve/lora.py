"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA endpoints.

Bodies as vLLM's: {"lora_name", "lora_path"} to load, {"lora_name"} to unload; a success answers
200 with vLLM's plain-text sentence, a refusal an OpenAI error (400: a bad or duplicate adapter,
LoRA not enabled, no free slot; 404: unloading a name that is not loaded). The registry is
changed on the engine thread, between steps (`AsyncEngine.call`). The routes exist only on a
server whose engine has LoRA enabled (elsewhere they are unknown routes, 404).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError
from .responses import ERROR_RESPONSES
from .state import get_state, require_api_key

v1 = APIRouter(dependencies=[Depends(require_api_key)])
_RESPONSES = {200: {"description": "vLLM's success sentence", "content": {"text/plain": {"schema": {"type": "string"}}}},
              400: ERROR_RESPONSES[400], 401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(min_length=1, description="the name requests select the adapter by (`model`)")
    lora_path: str = Field(min_length=1, description="folder of adapter_config.json + adapter_model.safetensors")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


async def _on_engine(request: Request, fn):
    from k3.lora import LoRAError, LoRANotFound

    state = get_state(request)
    try:
        return await state.engine.call(fn)
    except LoRANotFound as e:
        raise APIError(404, str(e), param="lora_name", code="lora_not_found") from None
    except LoRAError as e:             # LoRAFormatError included: names the tensor and its shape
        raise APIError(400, str(e), param="lora_name" if "already" in str(e) else "lora_path") from None


def _engine_has_lora(request: Request) -> None:
    if getattr(get_state(request).engine.engine, "lora", None) is None:
        raise APIError(400, "LoRA is not enabled on this server: start it with --enable-lora", code="lora_disabled")


@v1.post("/v1/load_lora_adapter", response_class=Response, responses=_RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Load a PEFT adapter under `lora_name`; requests then select it with `model`."""
    _engine_has_lora(request)
    if body.lora_name in get_state(request).model_names:
        raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name")
    await _on_engine(request, lambda engine: engine.load_lora_adapter(body.lora_name, body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@v1.post("/v1/unload_lora_adapter", response_class=Response, responses=_RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Unload adapter `lora_name` (requests running on it finish on it)."""
    _engine_has_lora(request)
    await _on_engine(request, lambda engine: engine.unload_lora_adapter(body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
