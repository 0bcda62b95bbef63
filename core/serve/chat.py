"""POST /v1/chat/completions.

The conversation is rendered with the model's chat format (K3 XTML; the K2 format for
Kimi-Linear checkpoints). A model whose tokenizer has neither format's marker tokens serves
completions only: chat answers 400 (code `chat_format_unavailable`) naming the formats
looked for and the absent markers. K3 output is generated with its special tokens kept
(skip_special_tokens=False) so the K3 parser sees the markers: with `--reasoning-parser
kimi_k3` the think channel becomes `reasoning` and `reasoning_content` (the same text; the parser starts inside reasoning
when the prompt ended with the think opener, i.e. in thinking mode); with
`--enable-auto-tool-choice --tool-call-parser kimi_k3` and tools in the request, each call
becomes a `tool_calls` entry once its close marker arrives. Otherwise that text stays content.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from k3.chat import ChatFormatUnavailable, ChatTemplateError, ContentDelta, K3OutputParser, ReasoningDelta, ToolCall
from k3.chat.media import image_urls
from k3.chat.template import chat_format, chat_prompt_ids, thinking_from_kwargs
from k3.chat.xtml import THINK_OPEN
from k3.engine.params import SamplingParams

from .errors import CLIENT_CLOSED, as_api_error, bad_request, sse_error
from .limits import check_prompt_work
from .media import load_chat_images
from .metrics import RequestTimer
from .protocol import ChatCompletionRequest, NamedToolChoice
from .responses import STREAMING_RESPONSES, ChatCompletionResponse
from .sampling import build_params, chat_logprobs, check_context, new_tokens, usage
from .structured import compile_spec, for_k3_chat, requested_spec
from .tool_grammar import auto_call_spec, tool_call_spec
from .state import ServerState, get_state, require_api_key
from .streaming import DONE, EventStream, collect, merge, sse

router = APIRouter(dependencies=[Depends(require_api_key)])


@dataclass
class ChatPlan:
    """A validated chat request, ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    k3: bool                     # K3 XTML output: run the K3 parser
    reasoning: bool              # split the think channel into reasoning_content
    tools: bool                  # parse tool calls
    starts_in_reasoning: bool
    top_logprobs: int
    images: list | None = None   # decoded images, one per placeholder of prompt_ids (k3.serve.media)
    num_prompt_tokens: int = 0   # with each image's placeholder expanded (what the engine runs)

    @property
    def multi_modal_data(self) -> dict | None:
        return {"image": self.images} if self.images else None

    def parser(self) -> K3OutputParser | None:
        if not self.k3:
            return None
        return K3OutputParser(thinking=self.reasoning, tools=self.tools,
                              starts_in_reasoning=self.starts_in_reasoning if self.reasoning else False,
                              call_id_prefix=f"call_{uuid.uuid4().hex[:16]}_")


def _template_param(message: str) -> str:
    """The request field a ChatTemplateError is about (its message names it first)."""
    if message.startswith("messages"):
        return "messages"
    for name in ("tool_choice", "response_format", "tools"):
        if message.startswith(name):
            return name
    return "chat_template_kwargs" if "thinking" in message else "messages"


def template_kwargs(req) -> dict:
    """The chat template options of a request: `chat_template_kwargs`, with `reasoning_effort`
    as thinking_effort (the kwargs win) and `thinking: {"type": "disabled"}` as `thinking: false`;
    400 when `thinking` and the kwargs' thinking switch disagree."""
    kwargs = req.chat_template_kwargs.model_dump(exclude_none=True) if req.chat_template_kwargs else {}
    if getattr(req, "reasoning_effort", None) is not None:
        kwargs.setdefault("thinking_effort", req.reasoning_effort)
    thinking = getattr(req, "thinking", None)
    if thinking is not None:
        on = thinking.type == "enabled"
        given = [kwargs[k] for k in ("thinking", "enable_thinking") if k in kwargs]
        if any(g != on for g in given):
            raise bad_request(f"thinking.type {thinking.type!r} contradicts chat_template_kwargs thinking="
                              f"{str(given[0]).lower()}: give one of them", param="thinking")
        if not given:
            kwargs["thinking"] = on
    return kwargs


def render_prompt(state: ServerState, req, *, add_generation_prompt: bool = True
                  ) -> tuple[list[int], bool, bool, list[str]]:
    """(prompt ids, K3 format, thinking mode, the image_url parts' URLs, checked but not loaded) of
    a chat request's messages and tools, rendered with the model's chat format or --chat-template
    (one placeholder per image in the ids); every problem is a 400. Also /tokenize's, which
    needs no image loaded."""
    tok = state.tokenizer
    try:
        k3 = chat_format(tok) == "k3"
    except ChatFormatUnavailable as e:
        if state.chat_template is None:
            raise bad_request(f"{e}. This model serves /v1/completions only.", param="messages",
                              code="chat_format_unavailable") from None
        k3 = False
    render = state.chat_template.prompt_ids if state.chat_template is not None else chat_prompt_ids
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        urls = image_urls(messages)
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None
    if urls and not state.takes_images:
        raise bad_request("this model takes no images (its checkpoint has no vision tower)", param="messages",
                          code="images_not_supported")
    if urls and (not k3 or state.chat_template is not None):
        raise bad_request("images need the K3 chat format (a --chat-template renders text only)",
                          param="messages", code="images_not_supported")
    kwargs = template_kwargs(req)
    tool_choice = getattr(req, "tool_choice", None)
    response_format = getattr(req, "response_format", None)
    choice = tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice) else tool_choice
    try:
        thinking = k3 and thinking_from_kwargs(kwargs)
        ids = render(
            tok, messages,
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None, tool_choice=choice,
            response_format=response_format.model_dump(exclude_none=True) if response_format else None,
            add_generation_prompt=add_generation_prompt, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), param=_template_param(str(e))) from None
    return ids, k3, thinking, urls


def plan_chat(state: ServerState, req: ChatCompletionRequest) -> ChatPlan:
    """Render the prompt and build the sampling parameters; every problem is a 400."""
    tok = state.tokenizer
    ids, k3, thinking, urls = render_prompt(state, req)
    images = load_chat_images(urls, state.media) if urls else None
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    top = req.top_logprobs or 0
    spec, spec_field = requested_spec(req)
    if spec is not None and k3:
        spec = for_k3_chat(spec, tok, thinking=thinking)
    forced_call = req.tools and (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice))
    if forced_call and k3:
        if spec is not None:
            raise bad_request(f"tool_choice {req.tool_choice if isinstance(req.tool_choice, str) else 'function'} "
                              f"and {spec_field} cannot both constrain one answer", param="tool_choice")
        spec, spec_field = tool_call_spec(tok, [t.function.model_dump(exclude_none=True) for t in req.tools], choice,
                                          thinking=thinking), "tool_choice"
    elif (k3 and spec is None and req.tools and req.tool_choice in (None, "auto")
          and any(t.function.strict for t in req.tools)):
        # strict tools under "auto": a call, if the model makes one, follows the declared schemas
        spec, spec_field = auto_call_spec(tok, [t.function.model_dump(exclude_none=True) for t in req.tools]), "tools"
    if spec is not None:
        compile_spec(state, spec, spec_field)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = build_params(req, max_tokens=max_tokens, logprobs=top if req.logprobs else None,
                          skip_special_tokens=False if k3 else req.skip_special_tokens,
                          defaults=state.sampling_defaults,
                          renamed={"max_tokens": max_param, "logprobs": "top_logprobs"},
                          structured_outputs=spec)
    # the context check counts the placeholders each image expands to (one is in ids already)
    expanded = len(ids) + sum(state.media_encoder.num_tokens(image) - 1 for image in images or [])
    check_context(expanded, max_tokens, state.max_model_len, prompt_param="messages", max_tokens_param=max_param)
    return ChatPlan(prompt_ids=ids, params=params, k3=k3, reasoning=state.parse_reasoning and thinking,
                    tools=state.parse_tool_calls and bool(req.tools) and req.tool_choice != "none",
                    starts_in_reasoning=thinking and tok.decode(ids[-8:]).endswith(THINK_OPEN), top_logprobs=top,
                    images=images, num_prompt_tokens=expanded)


def _call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_delta(call: ToolCall) -> dict:
    return {"tool_calls": [{"index": call.index, **_call(call)}]}


def _delta(event) -> dict:
    if isinstance(event, ReasoningDelta):      # vLLM's newer name and the older one, same text
        return {"reasoning": event.text, "reasoning_content": event.text}
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    return _tool_delta(event)


class _Choice:
    """Streaming state of one choice."""

    def __init__(self, parser: K3OutputParser | None):
        self.parser, self.text_len, self.num_tokens, self.calls, self.finished = parser, 0, 0, 0, False


async def _stream(state: ServerState, req: ChatCompletionRequest, plan: ChatPlan, request_id: str, model: str,
                  stream, timer: RequestTimer):
    created, tok = int(time.time()), state.tokenizer
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    choices = [_Choice(plan.parser()) for _ in range(req.n)]
    reasons: list[str | None] = [None] * req.n

    def chunk(index: int, delta: dict, *, logprobs=None, finish_reason=None) -> str:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    last = None
    try:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for _, out in merge([stream]):
            last = out
            timer.saw(out)
            for c in out.outputs:
                st = choices[c.index]
                if st.finished:
                    continue
                delta_text, st.text_len = c.text[st.text_len:], len(c.text)
                ids, entries = new_tokens(c, st.num_tokens)
                st.num_tokens = len(c.token_ids)
                if st.parser is None:
                    events = [ContentDelta(delta_text)] if delta_text else []
                else:
                    events = st.parser.feed(delta_text)
                    if c.finish_reason is not None:
                        events += st.parser.finish()
                logprobs = {"content": chat_logprobs(tok, ids, entries, plan.top_logprobs), "refusal": None} \
                    if entries else None
                for k, event in enumerate(events):
                    st.calls += isinstance(event, ToolCall)
                    yield chunk(c.index, _delta(event), logprobs=logprobs if k == 0 else None)
                if not events and logprobs:
                    yield chunk(c.index, {}, logprobs=logprobs)
                if c.finish_reason is not None:
                    st.finished = True
                    reasons[c.index] = "tool_calls" if st.calls else c.finish_reason
                    yield chunk(c.index, {}, finish_reason=reasons[c.index])
        if include_usage and last is not None:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage([last])})
    except Exception as e:  # noqa: BLE001 - the stream is already open: report in-band
        yield sse_error(as_api_error(e))
    finally:
        timer.finish(reasons)
    yield DONE


def _response(state: ServerState, plan: ChatPlan, request_id: str, model: str, out) -> dict:
    choices = []
    for c in out.outputs:
        parser = plan.parser()
        if parser is None:
            content, reasoning, calls = c.text, None, []
        else:
            parsed = parser.parse(c.text)
            content, reasoning, calls = parsed.content, parsed.reasoning or None, parsed.tool_calls
            content = content or (None if calls else "")
        logprobs = None
        if c.logprobs is not None:
            logprobs = {"content": chat_logprobs(state.tokenizer, c.token_ids, c.logprobs, plan.top_logprobs),
                        "refusal": None}
        message = {"role": "assistant", "content": content, "reasoning": reasoning, "reasoning_content": reasoning,
                   "tool_calls": [_call(call) for call in calls]}
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([out]), "kv_transfer_params": out.kv_transfer_params}


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=STREAMING_RESPONSES)
async def create_chat_completion(req: ChatCompletionRequest, request: Request):
    """OpenAI chat completions (streaming with `stream=true`)."""
    state = get_state(request)
    model = state.check_model(req.model)
    plan = await run_in_threadpool(plan_chat, state, req)     # rendering and tokenising off the event loop
    plan.params = state.with_adapter(plan.params, req.model)
    check_prompt_work([plan.num_prompt_tokens], max_prompts=1, max_prompt_tokens=state.prompt_token_limit)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    state.log_request(request_id, req.model, [plan.prompt_ids], plan.params)
    timer = RequestTimer(state.metrics, plan.params)
    if plan.images:
        stream = state.engine.generate(request_id, plan.prompt_ids, plan.params, plan.multi_modal_data)
    else:
        stream = state.engine.generate(request_id, plan.prompt_ids, plan.params)
    if req.stream:
        return EventStream(_stream(state, req, plan, request_id, model, stream, timer))
    try:
        finals = await collect(request, [stream], on_output=lambda i, o: timer.saw(o, i))
    except Exception as e:
        timer.finish([None] * req.n)
        raise as_api_error(e) from None
    if finals is None:  # the client left: its request was aborted, nobody reads an answer
        timer.finish([None] * req.n)
        return Response(status_code=CLIENT_CLOSED)
    body = _response(state, plan, request_id, model, finals[0])
    timer.finish([c["finish_reason"] for c in body["choices"]])
    return body
