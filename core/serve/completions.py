"""POST /v1/completions: raw prompts (a string, token ids, or a batch of either), no chat
format and no parsing. A batch of P prompts with n choices each answers P * n choices,
indexed prompt-major (choice index = prompt * n + sample). `echo` puts each prompt's text
before its choices' text (streamed: in each choice's first chunk); with `logprobs` the prompt
tokens' logprobs come first, from the engine's prompt logprobs (not with stream)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from .errors import CLIENT_CLOSED, as_api_error, bad_request, sse_error
from .limits import check_prompt_work
from .metrics import RequestTimer
from .protocol import CompletionRequest
from .responses import STREAMING_RESPONSES, CompletionResponse
from .sampling import (
    build_params, check_context, completion_logprobs, echo_logprobs, join_logprobs, new_tokens, prompt_logprobs_json,
    usage,
)
from .state import ServerState, get_state, require_api_key
from .structured import compile_spec, requested_spec
from .streaming import DONE, EventStream, collect, merge, sse

router = APIRouter(dependencies=[Depends(require_api_key)])


def _prompts(state: ServerState, prompt) -> list[list[int]]:
    """Token ids of every prompt in the request (validation has refused empty ones and ids outside
    the vocabulary)."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        ids = state.tokenizer.encode(p, allow_special=False) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request(f"{where} is empty", param="prompt")
        out.append(ids)
    return out


def _check(req: CompletionRequest) -> None:
    if req.echo and req.logprobs is not None and req.stream:
        raise bad_request("echo with logprobs needs the prompt's logprobs, which are not available with stream=true: "
                          "leave out logprobs or stream", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported (the K3 models have no fill-in-the-middle format)", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported: leave it out or set it equal to n", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request(f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
    batch = not (isinstance(req.prompt, str) or isinstance(req.prompt[0], int)) and len(req.prompt) > 1
    if req.kv_transfer_params is not None and batch:
        raise bad_request("kv_transfer_params (prefill/decode disaggregation) takes one prompt per request",
                          param="kv_transfer_params")


def _prompt_text(state: ServerState, req: CompletionRequest, index: int, ids: list[int]) -> str:
    """The text `echo` puts first: the prompt string as given, or token ids decoded."""
    prompt = req.prompt if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt[index]
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)


class _Choice:
    def __init__(self, echo: str = ""):
        self.text_len, self.num_tokens, self.finished, self.echo = 0, 0, False, echo


async def _stream(state: ServerState, req: CompletionRequest, request_id: str, model: str, streams,
                  timer: RequestTimer, echoes: list[str]):
    created, tok = int(time.time()), state.tokenizer
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    choices = [_Choice(echoes[i // req.n]) for i in range(len(streams) * req.n)]
    finals: list = [None] * len(streams)
    try:
        async for p, out in merge(streams):
            finals[p] = out
            timer.saw(out, p)
            for c in out.outputs:
                index = p * req.n + c.index
                st = choices[index]
                if st.finished:
                    continue
                text, offset = c.text[st.text_len:], st.text_len
                ids, entries = new_tokens(c, st.num_tokens)
                st.text_len, st.num_tokens = len(c.text), len(c.token_ids)
                st.finished = c.finish_reason is not None
                if not (text or entries or st.finished or st.echo):
                    continue
                text, st.echo = st.echo + text, ""
                logprobs = completion_logprobs(tok, ids, entries, req.logprobs or 0, offset,
                                               req.skip_special_tokens) if entries else None
                body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                if include_usage:
                    body["usage"] = None
                yield sse(body)
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(finals)})
    except Exception as e:  # noqa: BLE001 - the stream is already open: report in-band
        yield sse_error(as_api_error(e))
    finally:
        timer.finish([c.finish_reason for o in finals if o is not None for c in o.outputs])
    yield DONE


def _asked_prompt_logprobs(req: CompletionRequest, entries) -> list | None:
    """The prompt logprobs the request asked for: none, or each position's prompt token and
    its top `prompt_logprobs` (echo with more `logprobs` had the engine score more)."""
    if req.prompt_logprobs is None or entries is None:
        return None
    n = req.prompt_logprobs
    trimmed = [None if e is None else {t: lp for k, (t, lp) in enumerate(e.items()) if k == 0 or lp.rank <= n}
               for e in entries]
    return prompt_logprobs_json(trimmed)


def _response(state: ServerState, req: CompletionRequest, request_id: str, model: str, finals,
              echoes: list[str]) -> dict:
    choices, tok = [], state.tokenizer
    for p, out in enumerate(finals):
        echoed = None
        if req.echo and req.logprobs is not None:
            echoed = echo_logprobs(tok, out.prompt_token_ids, out.prompt_logprobs, req.logprobs, req.skip_special_tokens)
        for c in out.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = completion_logprobs(tok, c.token_ids, c.logprobs, req.logprobs or 0, 0,
                                               req.skip_special_tokens)
                if echoed is not None:
                    logprobs = join_logprobs(echoed, logprobs, len(echoes[p]))
            choices.append({"index": p * req.n + c.index, "text": echoes[p] + c.text, "logprobs": logprobs,
                            "prompt_logprobs": _asked_prompt_logprobs(req, out.prompt_logprobs),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(finals), "kv_transfer_params": finals[0].kv_transfer_params}


@router.post("/v1/completions", response_model=CompletionResponse,
             responses=STREAMING_RESPONSES)
async def create_completion(req: CompletionRequest, request: Request):
    """OpenAI text completions (streaming with `stream=true`)."""
    state = get_state(request)
    model = state.check_model(req.model)
    _check(req)
    if not isinstance(req.prompt, str) and not isinstance(req.prompt[0], int) \
            and len(req.prompt) > state.max_prompts_per_request:
        check_prompt_work([0] * len(req.prompt), max_prompts=state.max_prompts_per_request, max_prompt_tokens=0)
    prompts = await run_in_threadpool(_prompts, state, req.prompt)     # tokenising stays off the event loop
    spec, spec_field = requested_spec(req)
    if spec is not None:                                               # compiling too (under a time limit)
        await run_in_threadpool(compile_spec, state, spec, spec_field)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:          # the echoed prompt's logprobs: the engine scores the prompt
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    params = build_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                          skip_special_tokens=req.skip_special_tokens, defaults=state.sampling_defaults,
                          prompt_logprobs=prompt_logprobs,
                          structured_outputs=spec)
    params = state.with_adapter(params, req.model)
    for ids in prompts:
        check_context(len(ids), req.max_tokens, state.max_model_len, prompt_param="prompt",
                      max_tokens_param="max_tokens")
    check_prompt_work([len(ids) for ids in prompts], max_prompts=state.max_prompts_per_request,
                      max_prompt_tokens=state.prompt_token_limit)       # after each prompt's own context check
    echoes = [_prompt_text(state, req, i, ids) if req.echo else "" for i, ids in enumerate(prompts)]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    state.log_request(request_id, req.model, prompts, params)
    timer = RequestTimer(state.metrics, params)
    streams = [state.engine.generate(f"{request_id}-{i}", ids, params) for i, ids in enumerate(prompts)]
    if req.stream:
        return EventStream(_stream(state, req, request_id, model, streams, timer, echoes))
    try:
        finals = await collect(request, streams,
                               on_output=lambda i, o: timer.saw(o, i))
    except Exception as e:
        timer.finish([None] * len(prompts) * req.n)
        raise as_api_error(e) from None
    if finals is None:  # the client left: its requests were aborted, nobody reads an answer
        timer.finish([None] * len(prompts) * req.n)
        return Response(status_code=CLIENT_CLOSED)
    body = _response(state, req, request_id, model, finals, echoes)
    timer.finish([c["finish_reason"] for c in body["choices"]])
    return body
