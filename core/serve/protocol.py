"""Request bodies of the OpenAI-compatible API (pydantic models; FastAPI publishes them in
/openapi.json, so the published schema states every type and range).

Types are strict: a string where a number belongs, a number where a boolean belongs, NaN or
Infinity are refused (HTTP 400), never coerced. The ranges mirror k3.engine.SamplingParams,
which checks them again. The schema is the validation: chat messages are one model per role
(a tool message needs content), and token-id fields are bounded by the served vocabulary in
validation and in each server's /openapi.json alike (k3.serve.token_bound). What a schema cannot
say (a tool result must answer a call, a prompt must fit the context) is checked by the
handlers. Unknown top-level fields are ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, RootModel, Tag,
                      field_validator)

from .token_bound import KEY_MARK, KEY_PATTERN, MARK, check_token_id, check_token_key

INT64 = 2 ** 63
MAX_PROMPTS = 64  # prompts in one /v1/completions request


def _integral(value):
    """JSON Schema's integers include 2.0: take a float with no fraction as an int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**limits):
    """A strict int with JSON Schema limits (ge, le, lt) that also takes 2.0 for 2."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


# A token id: >= 0 and below the serving model's vocabulary (k3.serve.token_bound: the same
# bound for validation and for the published schema's `maximum`).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={MARK: True}), BeforeValidator(_integral),
                    AfterValidator(check_token_id)]
TokenKey = Annotated[str, Field(pattern=KEY_PATTERN), AfterValidator(check_token_key)]
NonEmpty = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_path(value, path: str = "") -> str | None:
    """Where in `value` (JSON as Python objects) a string holds a lone UTF-16 surrogate, or None.

    json.loads turns an escaped pair into one code point, so any surrogate left in a str is
    unpaired: such text has no UTF-8 form, and the tokenizer would have to guess."""
    if isinstance(value, str):
        return path or "value" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = lone_surrogate_path(k, f"{path}.<key>") or lone_surrogate_path(v, f"{path}.{k}")
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if not isinstance(v, (int, float)) and (found := lone_surrogate_path(v, f"{path}[{i}]")):
                return found
    return None


def _token_keys(schema: dict) -> None:
    """logit_bias's schema: every key a token id (`propertyNames`; pydantic's own
    `patternProperties` would let other keys through)."""
    (_, value), = schema.pop("patternProperties").items()
    schema.update({"propertyNames": {"pattern": KEY_PATTERN}, "additionalProperties": value, KEY_MARK: True})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class _Request(_Strict):
    """A top-level request body (chat, completions, /tokenize, /v1/responses)."""

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value, info):
        """One rule for every text field of a request: a lone surrogate is refused (400 naming the
        top-level field). It walks each field's raw value once, nested messages and tools included,
        so the nested models need no check of their own."""
        found = lone_surrogate_path(value, info.field_name)
        if found:
            raise ValueError(f"{found} holds a lone UTF-16 surrogate; text must be valid Unicode "
                             "(surrogates come in escaped pairs)")
        return value


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="send a last chunk with `usage` (and `choices: []`)")


class FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$", description="1-64 characters from A-Z a-z 0-9 _ . : -")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema object")
    strict: bool | None = Field(None, description="on K3 chat under tool_choice auto: a call the model makes follows "
                                                "the declared tools' schemas (required / named calls always do)")

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict | None) -> dict | None:
        if value is None:
            return value
        if "type" in value and value["type"] != "object":
            raise ValueError("must be a JSON Schema of type 'object'")
        if "properties" in value and not isinstance(value["properties"], dict):
            raise ValueError("'properties' must be an object")
        required = value.get("required", [])
        if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise ValueError("'required' must be a list of property names")
        return value


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: NonEmpty
    arguments: str | dict[str, Any] | None = Field(None, description="a JSON object (as a string)")


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Strict):
    type: Literal["text", "input_text", "output_text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(description="a data:image/...;base64 URL; a local file under --allowed-local-media-path; "
                                 "http(s) with --allow-remote-media")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted and ignored")


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str


def _part_kind(part: Any) -> str:
    """Which part model a content part is validated as (the tags are class names: error locations
    skip them, `k3.serve.errors`)."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "ImageURLPart" if kind == "image_url" else "TextPart"


ContentPart = Annotated[Annotated[TextPart, Tag("TextPart")] | Annotated[ImageURLPart, Tag("ImageURLPart")],
                        Discriminator(_part_kind)]
Content = str | list[TextPart]
UserContent = str | list[ContentPart]        # user messages may also carry images (a model with a tower)


class _Message(_Strict):
    """Fields every input message may carry; unknown fields are kept (a custom chat template
    may read them)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    name: str | None = None


class SystemMessage(_Message):
    """A system or developer message."""

    role: Literal["system", "developer"]
    content: Content | None = None
    tools: list[Tool] | None = Field(None, description="K3 format: more tools, declared at this point of the "
                                                       "conversation (the K2 format ignores them)")


class UserMessage(_Message):
    role: Literal["user"]
    content: UserContent | None = Field(None, description="text, or text and image_url parts")


class AssistantInputMessage(_Message):
    """An earlier assistant turn: its text, its reasoning, and the tool calls it made (the answer's
    message is `k3.serve.responses.AssistantMessage`)."""

    role: Literal["assistant"]
    content: Content | None = Field(None, description="null when the turn only made tool calls")
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: str | None = Field(None, description="earlier reasoning of an assistant turn")
    reasoning: str | None = Field(None, description="the same as reasoning_content (vLLM's newer name)")


class ToolMessage(_Message):
    """The result of a tool call of the preceding assistant message, matched by `tool_call_id`,
    else by `name`, else by position (an unmatched result is a 400: no schema can say that)."""

    role: Literal["tool"]
    content: Content = Field(description="the tool's result (required, as in OpenAI's API)")
    tool_call_id: str | None = None


ROLES = {"system": "SystemMessage", "developer": "SystemMessage", "user": "UserMessage",
         "assistant": "AssistantInputMessage", "tool": "ToolMessage"}


def _role(message) -> str | None:
    # tags are the class names, which error locations leave out (k3.serve.errors)
    return ROLES.get(message.get("role")) if isinstance(message, dict) else None


ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("SystemMessage")] | Annotated[UserMessage, Tag("UserMessage")]
    | Annotated[AssistantInputMessage, Tag("AssistantInputMessage")] | Annotated[ToolMessage, Tag("ToolMessage")],
    Discriminator(_role, custom_error_type="unknown_role",
                  custom_error_message="a message needs a role: system, developer, user, assistant or tool")]
"""One input message, by its `role`. `content`: a string, null, or a list of text parts (user
messages: also image_url parts, for a model with a vision tower; a tool message's content is
required)."""


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatTemplateKwargs(_Strict):
    """Options of the K3 chat template (other keys are refused)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    thinking: bool | None = Field(None, description="thinking mode (default true); false: instruct mode")
    enable_thinking: bool | None = Field(None, description="alias of thinking")
    thinking_effort: Literal["low", "medium", "high", "max"] | None = Field(None, description="default max")


class ThinkingConfig(_Strict):
    """Kimi's / Anthropic's `thinking` switch: `{"type": "disabled"}` renders the prompt in
    instruct mode (as chat_template_kwargs `thinking: false`)."""

    type: Literal["enabled", "disabled"]


class _Sampling(_Request):
    """Fields shared by chat and text completions. Defaults of temperature, top_p, top_k,
    min_p and repetition_penalty: the checkpoint's generation_config.json, else vLLM's."""

    model: str
    n: integer(ge=1, le=16) = Field(1, description="choices per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=16)] | None = Field(
        None, description="up to 16 strings; may span tokens")
    seed: integer(ge=-INT64, lt=INT64 - 16) | None = None
    temperature: float | None = Field(None, ge=0, le=100, description="0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1, lt=INT64) | None = Field(None, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_tokens: integer(ge=0) = 0
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: Annotated[dict[TokenKey, Annotated[float, Field(ge=-100, le=100)]],
                          Field(json_schema_extra=_token_keys)] | None \
        = Field(None, description="token id (a decimal string) -> bias in [-100, 100], added to that token's logit "
                                  "before sampling (ids outside the vocabulary: 400)")
    user: str | None = None
    response_format: ResponseFormat | None = Field(
        None, description="json_object / json_schema: the output is constrained by a grammar (k3.structured)")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM extra: one of json (a JSON schema), regex, choice (strings), grammar (EBNF), "
                          "json_object: the output must match it")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extra: structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM extra: structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="vLLM extra: structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM extra: structured_outputs.grammar")
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="vLLM extra, prefill/decode disaggregation (docs/disaggregation.md): "
                          "{\"do_remote_decode\": true} on a prefill instance, its answer's kv_transfer_params on a "
                          "decode instance")


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=1) | None = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: integer(ge=1) | None = Field(None, description="default: up to the context limit")
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=20) | None = Field(None, description="needs logprobs=true")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="accepted; the model decides how many calls it makes")
    reasoning_effort: Literal["low", "medium", "high", "max"] | None = Field(
        None, description="K3 thinking_effort (chat_template_kwargs.thinking_effort wins)")
    chat_template_kwargs: ChatTemplateKwargs | None = None
    thinking: ThinkingConfig | None = Field(
        None, description="{\"type\": \"disabled\"}: instruct mode; must agree with chat_template_kwargs.thinking")
    skip_special_tokens: bool = Field(
        True, description="K2-format models only: K3 output keeps its markers for the parsers")


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, token ids, or a list of either (a batch)."""

    prompt: (NonEmpty | TokenIds | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: integer(ge=1) | None = Field(16, description="null: up to the context limit")
    logprobs: integer(ge=0, le=20) | None = Field(None, description="top logprobs per token")
    echo: bool = Field(False, description="the prompt's text before each choice's text (with logprobs: the prompt "
                                          "tokens' logprobs first, the first token's null; not with stream)")
    suffix: str | None = Field(None, description="not implemented: must be absent")
    best_of: integer(ge=1, le=16) | None = Field(None, description="only best_of == n is accepted")
    prompt_logprobs: integer(ge=0, le=20) | None = Field(
        None, description="vLLM extra: log-probabilities of the prompt tokens, each with the top n (not with stream)")
    skip_special_tokens: bool = True


class _Tokenize(_Request):
    """Fields shared by both shapes of POST /tokenize (vLLM's)."""

    model: str | None = Field(None, description="a served model name (optional)")
    return_token_strs: bool = Field(False, description="also return each token as text (`token_strs`)")


class TokenizeCompletionRequest(_Tokenize):
    """POST /tokenize with `prompt`: its ids exactly as /v1/completions encodes it."""

    prompt: str
    add_special_tokens: bool = Field(True, description="accepted for vLLM clients: the Kimi tokenizers add no "
                                                       "special tokens to a prompt, so it changes nothing")


class TokenizeChatRequest(_Tokenize):
    """POST /tokenize with `messages`: the ids /v1/chat/completions would feed the model."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = Field(True, description="end with the assistant opener (think or response)")
    add_special_tokens: bool = Field(False, description="accepted for vLLM clients; changes nothing (as for prompts)")
    chat_template_kwargs: ChatTemplateKwargs | None = None
    thinking: ThinkingConfig | None = None
    reasoning_effort: Literal["low", "medium", "high", "max"] | None = None


class DetokenizeRequest(_Strict):
    """POST /detokenize: token ids (each below the vocabulary size) to text."""

    model: str | None = None
    tokens: list[TokenId]


def _tokenize_shape(body) -> str:
    # tags are the class names, which error locations leave out (k3.serve.errors)
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeCompletionRequest"


class TokenizeRequest(RootModel[Annotated[
        Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
        | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")], Discriminator(_tokenize_shape)]]):
    """POST /tokenize: a body with `messages` is a chat request, any other a prompt request (a
    root model, so that FastAPI keeps the discriminator and reports one shape's errors)."""


# ---------------------------------------------------------------- POST /v1/responses
class ResponsesTextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponsesMessage(_Strict):
    """An input message item (`type` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponsesTextPart]


class ResponsesFunctionCall(_Strict):
    """An earlier call of the model (from a previous response's output)."""

    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str = Field(description="a JSON object as a string")
    id: str | None = None
    status: str | None = None


class ResponsesFunctionOutput(_Strict):
    """The result of a call, matched by `call_id`."""

    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str
    id: str | None = None
    status: str | None = None


class ResponsesReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ResponsesReasoning(_Strict):
    """Earlier reasoning, kept in the next assistant turn's think channel."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ResponsesReasoningText] = Field(default_factory=list)
    content: list[ResponsesReasoningText] | None = None
    status: str | None = None


_ITEM_TAGS = {"message": "ResponsesMessage", "function_call": "ResponsesFunctionCall",
              "function_call_output": "ResponsesFunctionOutput", "reasoning": "ResponsesReasoning"}


def _item_kind(item) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else "message"
    return _ITEM_TAGS.get(kind)      # None: pydantic names the tags it knows


ResponsesItem = Annotated[
    Annotated[ResponsesMessage, Tag("ResponsesMessage")] | Annotated[ResponsesFunctionCall, Tag("ResponsesFunctionCall")]
    | Annotated[ResponsesFunctionOutput, Tag("ResponsesFunctionOutput")]
    | Annotated[ResponsesReasoning, Tag("ResponsesReasoning")],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message="input items are messages, function_call, function_call_output or reasoning "
                                       "(built-in tool items are not supported)")]


class ResponsesFunctionTool(_Strict):
    """A function tool, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value):
        return FunctionSpec._schema(value)


class ResponsesNamedTool(_Strict):
    type: Literal["function"]
    name: str


class ResponsesFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Strict):
    format: ResponsesFormat | None = None


class ResponsesReasoningConfig(_Strict):
    effort: Literal["low", "medium", "high", "max"] | None = Field(None, description="K3 thinking_effort")
    summary: str | None = Field(None, description="accepted; the reasoning item carries the whole think channel")


class ResponsesRequest(_Request):
    """POST /v1/responses: text and function tools (no stored state: `previous_response_id`,
    `store: true` beyond the answer itself, and built-in tools are refused)."""

    model: str
    input: NonEmpty | Annotated[list[ResponsesItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="a system message before the input")
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: integer(ge=1) | None = Field(None, description="default: up to the context limit")
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1, lt=INT64) | None = None
    seed: integer(ge=-INT64, lt=INT64 - 16) | None = None
    stream: bool = False
    reasoning: ResponsesReasoningConfig | None = None
    text: ResponsesText | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    thinking: ThinkingConfig | None = None
    previous_response_id: None = Field(None, description="not supported: k3 stores no responses (send the input)")
    store: bool | None = Field(None, description="accepted; nothing is stored")
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("previous_response_id", mode="before")
    @classmethod
    def _no_stored_state(cls, value):
        if value is not None:
            raise ValueError("k3 stores no responses: send the whole conversation as input instead")
        return value
