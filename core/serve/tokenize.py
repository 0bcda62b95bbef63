"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize takes a `prompt` (encoded exactly as /v1/completions encodes it: special-token names
are text) or chat `messages` (rendered exactly as /v1/chat/completions renders them, with
`tools`, `chat_template_kwargs`, `thinking` and `add_generation_prompt`), and answers the ids,
their `count` and the server's `max_model_len`. /detokenize turns ids back into text (special
tokens as their names); an id outside the vocabulary is a 400. Both need the API key when the
server has one (vLLM leaves them open), since they run the server's tokenizer on any input.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from .chat import render_prompt
from .protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from .responses import ERROR_RESPONSES, DetokenizeResponse, TokenizeResponse
from .state import ServerState, get_state, require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])
_ERRORS = {k: ERROR_RESPONSES[k] for k in (400, 401, 404)}


def _ids(state: ServerState, req) -> list[int]:
    if isinstance(req, TokenizeChatRequest):
        return render_prompt(state, req, add_generation_prompt=req.add_generation_prompt)[0]
    return state.tokenizer.encode(req.prompt, allow_special=False)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """The token ids of a prompt or of a rendered chat conversation."""
    state, req = get_state(request), body.root
    if req.model is not None:
        state.check_model(req.model)
    ids = await run_in_threadpool(_ids, state, req)       # rendering and tokenising off the event loop
    strs = [state.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(req: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids."""
    state = get_state(request)
    if req.model is not None:
        state.check_model(req.model)
    return DetokenizeResponse(prompt=await run_in_threadpool(state.tokenizer.decode, req.tokens))
