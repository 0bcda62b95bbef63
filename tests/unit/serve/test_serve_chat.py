"""/v1/chat/completions end to end on k3-tiny with the official openai client: thinking and
instruct mode, streaming, n, stop, max tokens, logprobs, seed, usage."""

from __future__ import annotations

from serve_support import MODEL

USER = [{"role": "user", "content": "hi"}]


def _chat(client, **kw):
    kw.setdefault("messages", USER)
    return client.chat.completions.create(model=MODEL, **kw)


def _logprob_text(choice) -> str:
    return bytes(b for item in choice.logprobs.content for b in item.bytes).decode("utf-8", "replace")


def test_thinking_mode_puts_the_output_in_reasoning_content(client):
    r = _chat(client, max_tokens=6, temperature=0, logprobs=True)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    # Random weights never close the think channel within 6 tokens: everything is reasoning.
    assert choice.message.reasoning_content == _logprob_text(choice)
    assert choice.message.content == "" and not choice.message.tool_calls
    assert r.usage.completion_tokens == 6 and len(choice.logprobs.content) == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_instruct_mode_has_no_reasoning(client):
    r = _chat(client, max_tokens=5, temperature=0, logprobs=True,
              extra_body={"chat_template_kwargs": {"thinking": False}})
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == _logprob_text(r.choices[0]).replace("<|open|>response<|sep|>", "")
    thinking = _chat(client, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens < thinking.usage.prompt_tokens  # no thinking-effort message


def test_alias_and_reasoning_effort(client):
    low = client.chat.completions.create(model="alias", messages=USER, max_tokens=1, reasoning_effort="low")
    assert low.model == MODEL  # the first served name is reported
    assert low.usage.prompt_tokens == _chat(client, max_tokens=1, extra_body={
        "chat_template_kwargs": {"thinking_effort": "low"}}).usage.prompt_tokens


def test_streaming_matches_non_streaming(client):
    whole = _chat(client, max_tokens=8, temperature=0)
    chunks = list(_chat(client, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == whole.choices[0].message.reasoning_content and content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(_chat(client, max_tokens=3, temperature=0, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_n_choices_and_seed(client):
    r = _chat(client, max_tokens=6, temperature=1.0, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    again = _chat(client, max_tokens=6, temperature=1.0, seed=7, n=3)
    assert [c.message.reasoning_content for c in again.choices] == [c.message.reasoning_content for c in r.choices]
    streamed = list(_chat(client, max_tokens=4, temperature=0, n=2, stream=True))
    per_choice = {0: "", 1: ""}
    for c in streamed:
        for ch in c.choices:
            per_choice[ch.index] += getattr(ch.delta, "reasoning_content", None) or ""
    assert per_choice[0] == per_choice[1] != ""  # greedy: both choices agree


def test_stop_string_spanning_tokens(client):
    full = _chat(client, max_tokens=12, temperature=0, logprobs=True).choices[0]
    text = full.message.reasoning_content
    tokens = [bytes(item.bytes).decode("utf-8", "replace") for item in full.logprobs.content]
    # A stop string that starts inside one token and ends inside the next.
    cut = next(i for i in range(2, len(tokens)) if len(tokens[i - 1]) >= 2 and tokens[i] and "\ufffd" not in
               tokens[i - 1] + tokens[i])
    start = len("".join(tokens[:cut - 1]))
    stop = text[start + len(tokens[cut - 1]) - 1: start + len(tokens[cut - 1]) + 1]
    stopped = _chat(client, max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.reasoning_content == text[:text.index(stop)]


def test_max_completion_tokens_wins(client):
    r = _chat(client, max_tokens=9, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"


def test_top_logprobs(client):
    r = _chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    for item in r.choices[0].logprobs.content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item.logprob == tops[0] and item.token == item.top_logprobs[0].token  # greedy takes the top one
    streamed = list(_chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    items = [i for c in streamed if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [i.token for i in items] == [i.token for i in r.choices[0].logprobs.content]


def test_penalties_and_sampling_knobs_are_accepted(client):
    r = _chat(client, max_tokens=3, temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2})
    assert r.usage.completion_tokens == 3


def test_response_format_is_rendered_not_enforced(client):
    plain = _chat(client, max_tokens=1)
    json_mode = _chat(client, max_tokens=1, response_format={"type": "json_object"})
    assert json_mode.usage.prompt_tokens > plain.usage.prompt_tokens  # the one-shot instruction
