"""/v1/completions with vLLM's extra `prompt_logprobs` field."""

from __future__ import annotations

import math

import openai
import pytest

from serve_support import MODEL


def test_prompt_logprobs_in_each_choice(client, engine):
    ids = [[5, 6, 7, 8, 9], [40, 41, 42]]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 2})
    assert len(r.choices) == 4
    tok = engine.tokenizer
    for choice in r.choices:
        prompt = ids[choice.index // 2]
        got = choice.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for token, entry in zip(prompt[1:], got[1:]):
            assert str(token) in entry and len(entry) in (2, 3)     # the prompt token and the top 2
            mine = entry[str(token)]
            assert mine["logprob"] <= 0 and mine["rank"] >= 1 and mine["decoded_token"] == tok.decode([token])
            top = sorted(entry.values(), key=lambda v: v["rank"])[:2]
            assert [v["rank"] for v in top] == [1, 2] and top[0]["logprob"] >= top[1]["logprob"]
            if mine["rank"] <= 2:                                    # then it is one of the top 2
                assert math.isclose(top[mine["rank"] - 1]["logprob"], mine["logprob"])
            assert sum(math.exp(v["logprob"]) for v in entry.values()) <= 1 + 1e-6
    assert r.choices[0].prompt_logprobs == r.choices[1].prompt_logprobs      # one prompt, two samples


def test_without_the_field_there_are_none(client):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1)
    assert getattr(r.choices[0], "prompt_logprobs", None) is None


@pytest.mark.parametrize("body,problem", [({"prompt_logprobs": 1, "stream": True}, "stream"),
                                          ({"prompt_logprobs": 21}, "prompt_logprobs")])
def test_refused_prompt_logprobs(client, body, problem):
    with pytest.raises(openai.BadRequestError, match=problem):
        client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, extra_body=body)
