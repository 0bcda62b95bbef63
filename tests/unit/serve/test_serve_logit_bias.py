"""`logit_bias` through the sampler, on completions and chat: a +100 bias makes a token the
greedy choice, a -100 bias on the greedy token leaves the runner-up (read from the unbiased
request's top logprobs, which stay those of the raw model); bad ids and values are 400s."""

from __future__ import annotations

import openai
import pytest

from k3.engine.params import SamplingParams, SamplingParamsError
from k3.serve.sampling import _token

from serve_support import MODEL


def test_bias_moves_the_greedy_token(client, engine):
    tok = engine.tokenizer
    ids = {_token(tok, i)[0]: i for i in range(tok.vocab_size)}      # the logprobs' token spellings -> ids
    base = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0, logprobs=2)
    first = base.choices[0].logprobs
    top = sorted(first.top_logprobs[0].items(), key=lambda kv: -kv[1])
    greedy_id, runner_up = ids[first.tokens[0]], top[1][0]
    assert top[0][0] == first.tokens[0]
    banned = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0, logprobs=2,
                                       logit_bias={str(greedy_id): -100})
    assert banned.choices[0].logprobs.tokens[0] == runner_up != first.tokens[0]
    # the reported logprob is the raw model's, not the biased one
    assert banned.choices[0].logprobs.token_logprobs[0] == pytest.approx(top[1][1], abs=1e-5)

    forced = tok.encode(" zebra", allow_special=False)[0]
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0.8, seed=3,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text.startswith(tok.decode([forced]))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          temperature=0, logprobs=True, logit_bias={str(forced): 100})
    assert chat.choices[0].logprobs.content[0].bytes == list(tok.token_bytes(forced))


def test_bad_bias_is_refused(client, engine):
    size = engine.engine.model_config.vocab_size
    for bias, param in (({str(size): 1}, "logit_bias"), ({"5": 101}, "logit_bias"), ({"x": 1}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias=bias)
        assert e.value.body["param"].startswith(param), e.value.body
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={3: 100.5})
    with pytest.raises(ValueError, match="logit_bias"):
        engine.engine.add_request("bias-oov", [1, 2], SamplingParams(logit_bias={size: 1.0}))
