"""The input of a POST /v1/responses request as a chat completion request.

/v1/responses runs on the chat path (`k3.serve.chat`): `instructions` becomes a system message
first, a string `input` one user message, and the input items map onto chat messages:
`message` items keep their role and text, `function_call` items become the `tool_calls` of an
assistant message (the one before them, or a new one), `function_call_output` items become
tool messages (matched by `call_id`), and a `reasoning` item becomes the `reasoning_content`
of the assistant message that follows it. Function tools, `tool_choice`, `text.format`
(response_format), `reasoning.effort` (thinking_effort), `max_output_tokens` and the sampling
fields carry over; chat's schema checks the result once more.
"""

from __future__ import annotations

from pydantic import ValidationError

from .errors import bad_request
from .protocol import (
    ChatCompletionRequest, ResponsesFunctionCall, ResponsesFunctionOutput, ResponsesMessage, ResponsesReasoning,
    ResponsesRequest,
)


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages of `instructions` and `input` (see the module docstring)."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    reasoning: str | None = None

    def assistant() -> dict:
        nonlocal reasoning
        msg = {"role": "assistant", "content": None}
        if reasoning is not None:
            msg["reasoning_content"], reasoning = reasoning, None
        messages.append(msg)
        return msg

    for i, item in enumerate(req.input):
        if isinstance(item, ResponsesMessage):
            if item.role == "assistant":
                msg = assistant()
                msg["content"] = _text(item.content)
            else:
                messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, ResponsesFunctionCall):
            last = messages[-1] if messages else None
            msg = last if last is not None and last["role"] == "assistant" and reasoning is None else assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, ResponsesFunctionOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif isinstance(item, ResponsesReasoning):
            parts = item.content if item.content is not None else item.summary
            reasoning = (reasoning or "") + "".join(p.text for p in parts)
    return messages


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that answers `req`; a 400 for what chat refuses."""
    body: dict = {"model": req.model, "messages": chat_messages(req), "stream": False}
    for name in ("temperature", "top_p", "top_k", "seed", "parallel_tool_calls", "user"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str)
                               else {"type": "function", "function": {"name": req.tool_choice.name}})
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_ or {},
                                                   "strict": bool(fmt.strict)}}
    if req.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = req.chat_template_kwargs.model_dump(exclude_none=True)
    if req.thinking is not None:
        body["thinking"] = req.thinking.model_dump()
    if len(body["messages"]) == 0 or all(m["role"] == "system" for m in body["messages"]):
        raise bad_request("input holds no message to answer (only instructions or reasoning)", param="input")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"input: {where}: {first.get('msg', 'invalid')}", param="input") from None
