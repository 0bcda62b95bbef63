"""Response bodies (pydantic models, published in /openapi.json).

Non-streaming responses are built from these models; streamed chunks are plain dicts of the
same shapes (`chat.completion.chunk`, `text_completion`), written as server-sent events.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, server_error")
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object as a string")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = Field(None, description="the think channel (with --reasoning-parser)")
    reasoning_content: str | None = Field(None, description="the same text as reasoning (the older name)")
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None
    stop_reason: str | int | None = Field(None, description="the stop string or token id that ended the choice")


class ChatCompletionResponse(BaseModel):
    kv_transfer_params: dict | None = Field(
        None, description="vLLM extra: a prefill instance's transfer handle (docs/disaggregation.md)")
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the first prompt token (echo)")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM extra (request prompt_logprobs): None, then one entry per later prompt token")
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    kv_transfer_params: dict | None = Field(
        None, description="vLLM extra: a prefill instance's transfer handle (docs/disaggregation.md)")
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "k3"
    root: str = Field(description="the checkpoint directory")
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(None, description="with return_token_strs: each token as text")


class DetokenizeResponse(BaseModel):
    prompt: str


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(BaseModel):
    """POST /v1/responses: `output` holds `reasoning` (with --reasoning-parser), `message`
    (one `output_text` part) and `function_call` items, in the order the model wrote them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "in_progress"]
    incomplete_details: dict | None = None
    error: dict | None = None
    instructions: str | None = None
    output: list[dict]
    parallel_tool_calls: bool = True
    tool_choice: str | dict = "auto"
    tools: list[dict] = Field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    usage: ResponsesUsage | None = None


# OpenAPI `responses=` entries shared by the generation routes.
ERROR_RESPONSES = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    503: {"model": ErrorResponse, "description": "the engine has failed"},
}
STREAMING_RESPONSES = {**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}},
                                                "description": "a completion, or server-sent events with stream=true"}}
