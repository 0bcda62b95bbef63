"""POST /v1/completions: raw prompts (a string, token ids, or a batch of either), no chat
format and no parsing. A batch of P prompts with n choices each answers P * n choices,
indexed prompt-major (choice index = prompt * n + sample)."""

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
from .sampling import build_params, check_context, completion_logprobs, new_tokens, prompt_logprobs_json, usage
from .state import ServerState, get_state, require_api_key
from .structured import compile_spec, requested_spec
from .streaming import DONE, EventStream, collect, merge, sse

router = APIRouter(dependencies=[Depends(require_api_key)])


def _prompts(state: ServerState, prompt) -> list[list[int]]:
    """Token ids of every prompt in the request (the schema has refused empty ones)."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        ids = state.tokenizer.encode(p, allow_special=False) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request(f"{where} is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request(f"{where} has token ids outside the vocabulary (0 to {state.vocab_size - 1}): "
                              f"{bad[:5]}", param="prompt")
        out.append(ids)
    return out


def _check(req: CompletionRequest) -> None:
    if req.echo:
        raise bad_request("echo is not supported by k3 yet", param="echo")
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


class _Choice:
    def __init__(self):
        self.text_len, self.num_tokens, self.finished = 0, 0, False


async def _stream(state: ServerState, req: CompletionRequest, request_id: str, model: str, streams,
                  timer: RequestTimer):
    created, tok = int(time.time()), state.tokenizer
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    choices = [_Choice() for _ in range(len(streams) * req.n)]
    finals: list = [None] * len(streams)
    try:
        async for p, out in merge(streams):
            finals[p] = out
            timer.saw(max(len(c.token_ids) for c in out.outputs))
            for c in out.outputs:
                index = p * req.n + c.index
                st = choices[index]
                if st.finished:
                    continue
                text, offset = c.text[st.text_len:], st.text_len
                ids, entries = new_tokens(c, st.num_tokens)
                st.text_len, st.num_tokens = len(c.text), len(c.token_ids)
                st.finished = c.finish_reason is not None
                if not (text or entries or st.finished):
                    continue
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


def _response(state: ServerState, req: CompletionRequest, request_id: str, model: str, finals) -> dict:
    choices = []
    for p, out in enumerate(finals):
        for c in out.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = completion_logprobs(state.tokenizer, c.token_ids, c.logprobs, req.logprobs or 0, 0,
                                               req.skip_special_tokens)
            choices.append({"index": p * req.n + c.index, "text": c.text, "logprobs": logprobs,
                            "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
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
    params = build_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                          skip_special_tokens=req.skip_special_tokens, defaults=state.sampling_defaults,
                          prompt_logprobs=req.prompt_logprobs, vocab_size=state.vocab_size,
                          structured_outputs=spec)
    params = state.with_adapter(params, req.model)
    for ids in prompts:
        check_context(len(ids), req.max_tokens, state.max_model_len, prompt_param="prompt",
                      max_tokens_param="max_tokens")
    check_prompt_work([len(ids) for ids in prompts], max_prompts=state.max_prompts_per_request,
                      max_prompt_tokens=state.prompt_token_limit)       # after each prompt's own context check
    request_id = f"cmpl-{uuid.uuid4().hex}"
    timer = RequestTimer(state.metrics)
    streams = [state.engine.generate(f"{request_id}-{i}", ids, params) for i, ids in enumerate(prompts)]
    if req.stream:
        return EventStream(_stream(state, req, request_id, model, streams, timer))
    try:
        finals = await collect(request, streams,
                               on_output=lambda _, o: timer.saw(max(len(c.token_ids) for c in o.outputs)))
    except Exception as e:
        timer.finish([None] * len(prompts) * req.n)
        raise as_api_error(e) from None
    if finals is None:  # the client left: its requests were aborted, nobody reads an answer
        timer.finish([None] * len(prompts) * req.n)
        return Response(status_code=CLIENT_CLOSED)
    body = _response(state, req, request_id, model, finals)
    timer.finish([c["finish_reason"] for c in body["choices"]])
    return body
