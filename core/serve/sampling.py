"""From request fields to engine SamplingParams, and from engine outputs to the OpenAI
`usage` and `logprobs` shapes. Shared by chat and text completions."""

from __future__ import annotations

import codecs
import math
from typing import Any

from k3.engine.params import SamplingParams, SamplingParamsError
from k3.engine.request import CompletionOutput, RequestOutput

from .errors import APIError, bad_request
from .protocol import _Sampling

# The generation_config.json keys that set request defaults (vLLM's `--generation-config auto`).
DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
LOGPROB_FLOOR = -9999.0   # -inf is not JSON; vLLM clamps the same way


def build_params(req: _Sampling, *, max_tokens: int | None, logprobs: int | None, skip_special_tokens: bool,
                 defaults: dict[str, Any], renamed: dict[str, str] | None = None,
                 prompt_logprobs: int | None = None, structured_outputs=None) -> SamplingParams:
    """SamplingParams for `req`; an out-of-range value is a 400 naming the request field
    (`renamed` maps engine field names to the names this request used; `structured_outputs`: the
    compiled constraint, `k3.serve.structured`). Token ids (stop_token_ids, logit_bias keys) were
    bounded by the vocabulary when the request was validated (`k3.serve.token_bound`)."""
    bias = logit_bias(req.logit_bias)

    def pick(name: str, fallback):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    try:
        return SamplingParams(
            n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=req.presence_penalty if req.presence_penalty is not None else 0.0,
            frequency_penalty=req.frequency_penalty if req.frequency_penalty is not None else 0.0,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=skip_special_tokens,
            kv_transfer_params=req.kv_transfer_params, structured_outputs=structured_outputs, logit_bias=bias)
    except SamplingParamsError as e:
        name = (renamed or {}).get(e.field, e.field)
        raise bad_request(f"{name}: {str(e).split(': ', 1)[1]}", param=name) from None


def logit_bias(field: dict[str, float] | None) -> dict[int, float] | None:
    """The request's logit_bias ({"token id": bias}, validation checked the spelling, the range
    and the vocabulary) as the engine's {id: bias}. None when empty."""
    if not field:
        return None
    return {int(t): float(b) for t, b in field.items()}


def prompt_logprobs_json(entries: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as vLLM's completions answer them: None for the first
    prompt token, then {token id: {logprob, rank, decoded_token}} (logprobs floored, -inf is
    not JSON)."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": max(lp.logprob, LOGPROB_FLOOR), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, *, prompt_param: str,
                  max_tokens_param: str) -> None:
    """400 (code context_length_exceeded) when the prompt, or prompt + max_tokens, does not fit."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{prompt_len} tokens (at least one token must be left for the output).",
                       param=prompt_param, code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                            f"completion). Reduce the prompt or {max_tokens_param}.",
                       param=max_tokens_param, code="context_length_exceeded")


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI usage of one or more requests (one per prompt); every choice's tokens count."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finite(lp: float) -> float:
    return LOGPROB_FLOOR if math.isnan(lp) or lp < LOGPROB_FLOOR else float(lp)


def _ranked(entry: dict[int, float], top: int) -> list[tuple[int, float]]:
    """The `top` most likely tokens of one engine logprob entry (sampled token + top-k)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:top]


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as text and bytes; a token that is not valid UTF-8 on its own (part of a
    character) is spelt `bytes:\\xNN...` as OpenAI does, so distinct tokens stay distinct."""
    raw = tokenizer.token_bytes(token_id)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, list(raw)


def chat_logprobs(tokenizer, ids: list[int], entries: list[dict[int, float]], top: int) -> list[dict]:
    """`logprobs.content` items of the chat API for generated `ids`."""
    items = []
    for token_id, entry in zip(ids, entries):
        text, raw = _token(tokenizer, token_id)
        tops = []
        for t, lp in _ranked(entry, top):
            t_text, t_raw = _token(tokenizer, t)
            tops.append({"token": t_text, "logprob": _finite(lp), "bytes": t_raw})
        items.append({"token": text, "logprob": _finite(entry.get(token_id, LOGPROB_FLOOR)), "bytes": raw,
                      "top_logprobs": tops})
    return items


def completion_logprobs(tokenizer, ids: list[int], entries: list[dict[int, float]], top: int, offset: int,
                        skip_special_tokens: bool) -> dict:
    """The completions API's logprobs object for `ids`; `offset` is the text offset of the first
    (offsets count characters of the output text, as the detokenizer builds it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    for token_id, entry in zip(ids, entries):
        text, raw = _token(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(entry.get(token_id, LOGPROB_FLOOR)))
        out["top_logprobs"].append({_token(tokenizer, t)[0]: _finite(lp) for t, lp in _ranked(entry, top)})
        out["text_offset"].append(offset)
        if not (skip_special_tokens and tokenizer.is_special(token_id)):
            offset += len(utf8.decode(bytes(raw)))
    return out


def echo_logprobs(tokenizer, prompt_ids: list[int], entries: list | None, top: int,
                  skip_special_tokens: bool) -> dict:
    """The completions logprobs object of an echoed prompt: the first token's logprob and top
    logprobs are null (nothing predicts it), the others come from the engine's prompt logprobs
    (`RequestOutput.prompt_logprobs`, {id: Logprob}); offsets count the prompt's characters."""
    floats = [{t: lp.logprob for t, lp in e.items()} for e in (entries or [None])[1:]]
    out = completion_logprobs(tokenizer, prompt_ids, [{}] + floats, top, 0, skip_special_tokens)
    out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def join_logprobs(a: dict, b: dict, shift: int) -> dict:
    """Completions logprobs `a` then `b`, b's text offsets moved on by `shift` characters."""
    b = dict(b, text_offset=[o + shift for o in b["text_offset"]])
    return {k: a[k] + b[k] for k in a}


def new_tokens(c: CompletionOutput, start: int) -> tuple[list[int], list[dict[int, float]] | None]:
    """The ids (and logprob entries, when requested) of choice `c` from token `start` on."""
    return c.token_ids[start:], (c.logprobs[start:] if c.logprobs is not None else None)
