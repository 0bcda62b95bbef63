"""Assemble RequestOutputs from the engine's per-request state."""

from __future__ import annotations

from .request import CompletionOutput, Request, RequestOutput


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
               "num_preemptions": sum(r.num_preemptions for r in children)}
    prompt_logprobs = None if first.params.prompt_logprobs is None else list(first.prompt_logprobs)
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(first.prompt_token_ids),
                         outputs=outputs, finished=all(r.finished for r in children), metrics=metrics,
                         prompt_logprobs=prompt_logprobs)
