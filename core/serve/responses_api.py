"""POST /v1/responses (OpenAI's Responses API) for text and function tools.

The request is answered on the chat path (`k3.serve.responses_input` maps it to a chat request,
`k3.serve.chat.plan_chat` renders and checks it). The K3 output parser's events become output
items in the order the model wrote them: `reasoning` (the think channel, with
--reasoning-parser), `message` (an `output_text` part), `function_call` (one per complete call,
with --enable-auto-tool-choice --tool-call-parser). `status` is "incomplete" with
`incomplete_details.reason: "max_output_tokens"` when the length limit ended it.

With `stream: true` the answer is server-sent events, each `event: TYPE` and `data:` a JSON
object with that `type` and a `sequence_number`: response.created, response.in_progress, per
item response.output_item.added, its deltas (response.reasoning_text.delta,
response.content_part.added + response.output_text.delta, response.function_call_arguments.delta),
their .done events and response.output_item.done, then response.completed with the whole
response. An error after the stream began is an `error` event. Nothing is stored.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from k3.chat import ContentDelta, ReasoningDelta, ToolCall

from .chat import plan_chat
from .errors import CLIENT_CLOSED, as_api_error
from .limits import check_prompt_work
from .metrics import RequestTimer
from .protocol import ResponsesRequest
from .responses import STREAMING_RESPONSES, ResponseObject
from .responses_input import chat_request
from .state import get_state, require_api_key
from .streaming import EventStream, collect, merge

router = APIRouter(dependencies=[Depends(require_api_key)])


class OutputItems:
    """Output items built from parser events; `feed` returns the stream events they make."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None          # the reasoning or message item still growing
        self.seq = 0

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = "completed"
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text),
                    self._event("response.output_item.done", output_index=index, item=item)]
        part = item["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _start(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        added = self._event("response.output_item.added", output_index=index,
                            item={**item, "content": []} if kind == "message" else item)
        if kind == "reasoning":
            return [added]
        return [added, self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def feed(self, events) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, ToolCall):
                out += self._close()
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": ev.id, "name": ev.name,
                        "arguments": ev.arguments, "status": "completed"}
                self.items.append(item)
                index = len(self.items) - 1
                out += [self._event("response.output_item.added", output_index=index,
                                    item={**item, "arguments": "", "status": "in_progress"}),
                        self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                    delta=ev.arguments),
                        self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                    name=ev.name, arguments=ev.arguments),
                        self._event("response.output_item.done", output_index=index, item=item)]
                continue
            if not ev.text:
                continue
            kind = "reasoning" if isinstance(ev, ReasoningDelta) else "message"
            if self.open is None or self.open["type"] != kind:
                out += self._close() + self._start(kind)
            part = self.open["content"][0]
            part["text"] += ev.text
            index = len(self.items) - 1
            delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            out.append(self._event(delta, item_id=self.open["id"], output_index=index, content_index=0,
                                   delta=ev.text, **extra))
        return out

    def finish(self) -> list[dict]:
        return self._close()


def _events(text: str, final: bool, parser) -> list:
    """Parser events of more output `text` (all of it at once without a parser)."""
    if parser is None:
        return [ContentDelta(text)] if text else []
    return parser.feed(text) + (parser.finish() if final else [])


def _body(req: ResponsesRequest, request_id: str, model: str, created: int, items: list[dict], out,
          finish_reason: str | None, status: str | None = None) -> dict:
    status = status or ("incomplete" if finish_reason in ("length", "abort") else "completed")
    details = None
    if status == "incomplete":
        details = {"reason": "max_output_tokens" if finish_reason == "length" else "aborted"}
    usage = None
    if out is not None:
        prompt, output = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}
    choice = req.tool_choice if req.tool_choice is None or isinstance(req.tool_choice, str) \
        else req.tool_choice.model_dump()
    return {"id": request_id, "object": "response", "created_at": created, "model": model, "status": status,
            "incomplete_details": details, "error": None, "instructions": req.instructions, "output": items,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "tool_choice": choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "usage": usage}


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, allow_nan=False)}\n\n"


async def _stream(req, plan, request_id, model, stream, timer):
    created, items, parser = int(time.time()), OutputItems(), plan.parser()
    text_len, reason, last = 0, None, None
    try:
        shell = _body(req, request_id, model, created, [], None, None, status="in_progress")
        yield _sse(items._event("response.created", response=shell))
        yield _sse(items._event("response.in_progress", response=shell))
        async for _, out in merge([stream]):
            last, c = out, out.outputs[0]
            timer.saw(out)
            delta, text_len = c.text[text_len:], len(c.text)
            for event in items.feed(_events(delta, c.finish_reason is not None, parser)):
                yield _sse(event)
            if c.finish_reason is not None:
                reason = c.finish_reason
        for event in items.finish():
            yield _sse(event)
        done = _body(req, request_id, model, created, items.items, last, reason)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield _sse(items._event(kind, response=done))
    except Exception as e:  # noqa: BLE001 - the stream is already open: report in-band
        err = as_api_error(e)
        yield _sse(items._event("error", code=err.code, message=err.message, param=err.param))
    finally:
        timer.finish([reason])


@router.post("/v1/responses", response_model=ResponseObject, responses=STREAMING_RESPONSES)
async def create_response(req: ResponsesRequest, request: Request):
    """OpenAI Responses: text and function tools (streaming with `stream=true`)."""
    state = get_state(request)
    model = state.check_model(req.model)
    plan = await run_in_threadpool(lambda: plan_chat(state, chat_request(req)))
    plan.params = state.with_adapter(plan.params, req.model)
    check_prompt_work([len(plan.prompt_ids)], max_prompts=1, max_prompt_tokens=state.prompt_token_limit)
    request_id = f"resp_{uuid.uuid4().hex}"
    timer = RequestTimer(state.metrics, plan.params)
    stream = state.engine.generate(request_id, plan.prompt_ids, plan.params)
    if req.stream:
        return EventStream(_stream(req, plan, request_id, model, stream, timer))
    try:
        finals = await collect(request, [stream], on_output=lambda _, o: timer.saw(o))
    except Exception as e:
        timer.finish([None])
        raise as_api_error(e) from None
    if finals is None:
        timer.finish([None])
        return Response(status_code=CLIENT_CLOSED)
    out = finals[0]
    c = out.outputs[0]
    items = OutputItems()
    items.feed(_events(c.text, True, plan.parser()))
    items.finish()
    timer.finish(["tool_calls" if any(i["type"] == "function_call" for i in items.items) else c.finish_reason])
    return _body(req, request_id, model, int(time.time()), items.items, out, c.finish_reason)
