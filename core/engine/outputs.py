"""Requests in, RequestOutputs out: tokenising and checking prompts, the children of an n > 1
request, incremental detokenisation, stop tokens and strings, and the cumulative outputs.

The step strategies append what a forward produced (`append`, `append_samples`,
`append_prompt_logprobs`) and return `collect(touched)`; a request that stops is finished in
the scheduler at once, so its rows are free before the next step.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from k3.tokenizer import IncrementalDetokenizer
from k3.tokenizer.detokenize import NoDetokenizer

from .media import images_of
from .params import SamplingParams
from .prompt_logprobs import append_prompt_logprobs
from .request import CompletionOutput, Request, RequestOutput
from .scheduler import Scheduler, SchedulerOutput
from .stop import StopStringMatcher


class OutputProcessor:
    """The engine's per-request state between arrival and the last output.

    release: called with every request that leaves (finished and reported, or aborted), for
    the parts that keep per-request state of their own (a draft model's rows).
    media: the engine's MediaEncoder (None: the model takes no images).
    structured: the engine's k3.structured.StructuredOutputs (compile cache); a request with
    `structured_outputs` gets its RequestGrammar here, which follows every appended token.
    """

    def __init__(self, scheduler: Scheduler, tokenizer, *, eos_token_ids, vocab_size: int, max_model_len: int,
                 seed: int = 0, release: Callable[[Request], None] | None = None, media=None, structured=None):
        self.scheduler, self.tokenizer, self.release, self.media = scheduler, tokenizer, release, media
        self.structured = structured
        self.stop_token_ids = set(eos_token_ids)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}           # parent id -> child request ids (n > 1)
        self.parent_of: dict[str, str] = {}
        self.prompts: dict[str, str | None] = {}
        self._streams: dict[str, tuple[IncrementalDetokenizer, StopStringMatcher, list[str]]] = {}
        self._rng = random.Random(seed)
        self.stats = {"requests_total": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0}

    # ------------------------------------------------------------------ requests
    def check(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ValueError for a prompt this engine refuses (no tokenizer for
        text, empty, ids outside the vocabulary, too long). Changes nothing."""
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
            raise ValueError("the engine runs without a tokenizer (skip_tokenizer_init): pass the prompt as token ids "
                             "and stop with stop_token_ids, not stop strings")
        ids = self.tokenizer.encode(prompt, allow_special=False) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary (size {self.vocab_size}): {bad[:5]}")
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids outside the vocabulary (size {self.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but the model's context is {self.max_model_len} "
                             "tokens (prompt + output)")
        return ids

    def prepare_media(self, ids: list[int], multi_modal_data) -> tuple[list[int], object]:
        """(the prompt with its image placeholders expanded, its RequestMedia) for vLLM's
        `multi_modal_data` ({"image": ...}); (ids, None) without images. ValueError for images a
        model without a vision tower is given, placeholders that do not pair with the images, or
        an image larger than the encoder budget."""
        images = images_of(multi_modal_data)
        if not images:
            return ids, None
        if self.media is None:
            raise ValueError("this model takes no images (its checkpoint has no vision tower)")
        ids, media = self.media.prepare(ids, images)
        budget = self.scheduler.config.max_num_encoder_tokens
        for i, item in enumerate(media.items):
            if item.num_tokens > budget:
                raise ValueError(f"image {i} takes {item.num_tokens} tokens, more than the encoder budget of "
                                 f"{budget} (max_num_encoder_tokens)")
        return ids, media

    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams, multi_modal_data=None, *,
            lora_slot: int = -1, cache_salt: bytes = b"") -> None:
        """Check and queue a request; `prompt` is text (encoded with special tokens as text) or token ids.

        multi_modal_data: vLLM's {"image": image or list of images} (tensors [3, H, W] or PIL
        images), one per media placeholder token of the prompt, in order; each placeholder is
        expanded to the image's token count.
        lora_slot / cache_salt: the request's LoRA adapter slot and prefix-cache salt (`Request`)."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.check(prompt, params)
        media = None
        if multi_modal_data:
            ids, media = self.prepare_media(ids, multi_modal_data)
            ids = self.check(ids, params)
        grammars = [None] * params.n
        if params.structured_outputs is not None:     # StructuredOutputError (a ValueError) before queueing
            if self.structured is None:
                raise ValueError("this engine has no structured-output support")
            grammars = [self.structured.request_grammar(params.structured_outputs) for _ in range(params.n)]
        if media is not None:
            self.media.stats["mm_images_total"] += len(media.items)
        children = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        for i, child in enumerate(children):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(62)
            request = Request(child, ids, params, seed, lora_slot=lora_slot, cache_salt=cache_salt,
                              grammar=grammars[i])
            if media is not None:
                request.media = media if i == 0 else media.copy()
            if params.prompt_logprobs is not None:
                request.prompt_logprobs.append(None)        # the first prompt token has none
            self.scheduler.add(request)
            self.requests[child] = request
            self.parent_of[child] = request_id
            detok = (NoDetokenizer() if self.tokenizer is None
                     else IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens))
            self._streams[child] = (detok, StopStringMatcher(params.stop), [])
        self.groups[request_id] = children
        self.prompts[request_id] = prompt if isinstance(prompt, str) else None
        self.stats["requests_total"] += 1
        self.stats["prompt_tokens_total"] += len(ids)

    def abort(self, request_id: str) -> None:
        """Cancel a request (or every child of an n > 1 request); its rows are free at once."""
        for child in self.groups.pop(request_id, []):
            self.parent_of.pop(child, None)
            request = self.requests.pop(child, None)
            if request is not None and not request.finished:
                self.scheduler.finish(request, "abort")
            if request is not None and self.release is not None:
                self.release(request)
            self._streams.pop(child, None)
        self.prompts.pop(request_id, None)

    # ------------------------------------------------------------------ appending
    def append(self, request: Request, token: int, logprob: float, top, now: float) -> None:
        """One generated token: detokenise it and finish the request on a stop or a limit."""
        request.output_token_ids.append(token)
        request.output_logprobs.append(logprob)
        if request.grammar is not None:
            request.grammar.accept(token)
        if request.params.logprobs:
            ids, lps = top
            request.output_top_logprobs.append(list(zip(ids, lps))[: request.params.logprobs])
        request.first_token_time = request.first_token_time or now
        self.stats["generation_tokens_total"] += 1
        detok, stops, pieces = self._streams[request.request_id]
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.stop_token_ids):
            request.stop_reason = token
            pieces.append(stops.push(detok.finish()) + stops.flush())
            self.scheduler.finish(request, "stop")
            return
        text = stops.push(detok.step([token]))
        if stops.stopped is not None:
            pieces.append(text + (stops.stopped if params.include_stop_str_in_output else ""))
            request.stop_reason = stops.stopped
            self.scheduler.finish(request, "stop")
            return
        pieces.append(text)
        at_limit = params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens
        if at_limit or request.num_tokens >= self.max_model_len:
            pieces.append(stops.push(detok.finish()) + stops.flush())
            self.scheduler.finish(request, "length")

    def append_samples(self, out: SchedulerOutput, rows: list[int], samples, now: float, touched: set) -> None:
        """Read a step's sampled tokens (waiting for the device) and append them to their
        requests (rows of `out.scheduled`); a request that finished or was aborted since the
        launch (asynchronous scheduling) gets nothing. Adds the ids appended to `touched`."""
        tokens, logprobs = samples.tokens.tolist(), samples.logprobs.tolist()
        tops = None if samples.top_ids is None else list(zip(samples.top_ids.tolist(), samples.top_logprobs.tolist()))
        for j, row in enumerate(rows):
            request = out.scheduled[row].request
            if request.finished:
                continue
            self.append(request, tokens[j], logprobs[j], None if tops is None else tops[j], now)
            touched.add(request.request_id)

    def append_prompt_logprobs(self, out: SchedulerOutput, prompt) -> None:
        """Read a step's scored prompt positions (waiting for the device) into its requests."""
        if prompt is None:
            return
        tok = self.tokenizer
        decode = (lambda t: None) if tok is None else (lambda t: tok.decode([t]))
        append_prompt_logprobs(prompt, [s.request for s in out.scheduled], decode)

    # ------------------------------------------------------------------ outputs
    def collect(self, touched: set) -> list[RequestOutput]:
        """The cumulative output of every request with a child in `touched`; a finished one
        leaves (and is released)."""
        parents = dict.fromkeys(self.parent_of[child] for child in touched)
        return [self._output(p) for p in parents]

    def _output(self, parent: str) -> RequestOutput:
        children = [self.requests[c] for c in self.groups[parent]]
        result = build_output(parent, self.prompts[parent], children, [self._streams[c][2] for c in self.groups[parent]])
        if result.finished:
            for c in self.groups.pop(parent):
                request = self.requests.pop(c, None)
                if request is not None and self.release is not None:
                    self.release(request)
                self._streams.pop(c, None)
                self.parent_of.pop(c, None)
            self.prompts.pop(parent, None)
        return result


def build_output(request_id: str, prompt: str | None, children: list[Request],
                 pieces: list[list[str]]) -> RequestOutput:
    """Cumulative output of a request (one CompletionOutput per sample of n)."""
    outputs = []
    for index, (r, text) in enumerate(zip(children, pieces)):
        logprobs = None
        if r.params.logprobs is not None:
            logprobs = []
            for i, (token, lp) in enumerate(zip(r.output_token_ids, r.output_logprobs)):
                entry = {token: lp}
                if r.params.logprobs:
                    entry.update({t: v for t, v in r.output_top_logprobs[i]})
                logprobs.append(entry)
        outputs.append(CompletionOutput(index=index, text="".join(text), token_ids=list(r.output_token_ids),
                                        cumulative_logprob=sum(r.output_logprobs) if r.output_logprobs else None,
                                        logprobs=logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason))
    first = children[0]
    metrics = {"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
               "first_scheduled_time": min((r.first_scheduled_time for r in children
                                            if r.first_scheduled_time is not None), default=None),
               "num_preemptions": sum(r.num_preemptions for r in children)}
    prompt_logprobs = None if first.params.prompt_logprobs is None else list(first.prompt_logprobs)
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(first.prompt_token_ids),
                         outputs=outputs, finished=all(r.finished for r in children), metrics=metrics,
                         prompt_logprobs=prompt_logprobs, kv_transfer_params=first.kv_transfer_params)
