"""Bad input gets the right 4xx with an OpenAI error body, and never kills the server or
leaks cache rows (the autouse fixture checks the rows after every test)."""

from __future__ import annotations

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import openai
import pytest

from k3.serve import build_app

from serve_support import MAX_MODEL_LEN, MODEL, LiveServer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def _chat(**kw):
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **kw}


def _error(response, status: int, *, param=None, code=None, type_=None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if type_ is not None:
        assert error["type"] == type_, error
    return error


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


CASES = [
    # (id, path, body, param)
    ("negative-max-tokens", CHAT, _chat(max_tokens=-1), "max_tokens"),
    ("zero-max-completion-tokens", CHAT, _chat(max_completion_tokens=0), "max_completion_tokens"),
    ("absurd-max-tokens", CHAT, _chat(max_tokens=10 ** 12), "max_tokens"),
    ("temperature-negative", CHAT, _chat(temperature=-0.5), "temperature"),
    ("temperature-huge", CHAT, _chat(temperature=1e6), "temperature"),
    ("top-p-zero", CHAT, _chat(top_p=0), "top_p"),
    ("n-zero", CHAT, _chat(n=0), "n"),
    ("n-too-many", CHAT, _chat(n=17), "n"),
    ("seed-beyond-int64", CHAT, _chat(seed=2 ** 70), "seed"),
    ("top-k-beyond-int64", CHAT, _chat(top_k=2 ** 64), "top_k"),
    ("penalty", CHAT, _chat(presence_penalty=3), "presence_penalty"),
    ("too-many-stops", CHAT, _chat(stop=[str(i) for i in range(17)]), "stop"),
    ("empty-stop", CHAT, _chat(stop=[""]), "stop[0]"),
    ("top-logprobs-alone", CHAT, _chat(top_logprobs=2), "top_logprobs"),
    ("top-logprobs-too-many", CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("logit-bias-range", CHAT, _chat(logit_bias={"5": 100.5}), "logit_bias.5"),
    ("logit-bias-id", CHAT, _chat(logit_bias={"five": 1.0}), "logit_bias.five.[key]"),
    ("unknown-role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    ("bad-reasoning-effort", CHAT, _chat(reasoning_effort="extreme"), "reasoning_effort"),
    ("no-messages", CHAT, _chat(messages=[]), "messages"),
    ("image-part-without-url", CHAT,
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].image_url.url"),
    ("unknown-part", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "audio_url", "text": "x"}]}]),
     "messages[0].content[0].type"),
    ("orphan-tool-result", CHAT, _chat(messages=MSG + [{"role": "tool", "tool_call_id": "nope", "content": "1"}]),
     "messages"),
    ("bad-tool-arguments", CHAT, _chat(messages=MSG + [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]), "messages"),
    ("tool-without-name", CHAT, _chat(tools=[{"type": "function", "function": {"description": "x"}}]),
     "tools[0].function.name"),
    ("tool-bad-name", CHAT, _chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    ("tool-schema-not-object", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]), "tools[0].function.parameters"),
    ("tool-schema-required", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "city"}}}]), "tools[0].function.parameters"),
    ("tool-type", CHAT, _chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    ("named-unknown-tool", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    ("required-without-tools", CHAT, _chat(tool_choice="required"), "tool_choice"),
    ("unknown-template-kwarg", CHAT, _chat(chat_template_kwargs={"tools": 1}), "chat_template_kwargs.tools"),
    ("thinking-not-bool", CHAT, _chat(chat_template_kwargs={"thinking": "yes"}), "chat_template_kwargs.thinking"),
    ("bad-thinking-effort", CHAT, _chat(chat_template_kwargs={"thinking_effort": "extreme"}),
     "chat_template_kwargs.thinking_effort"),
    ("string-for-number", CHAT, _chat(temperature="0.5"), "temperature"),
    ("number-for-bool", CHAT, _chat(stream=1), "stream"),
    ("float-for-int", CHAT, _chat(max_tokens=2.5), "max_tokens"),
    ("missing-model", CHAT, {"messages": MSG}, "model"),
    ("completion-empty-prompt", COMPLETIONS, {"model": MODEL, "prompt": ""}, "prompt"),
    ("completion-empty-ids", COMPLETIONS, {"model": MODEL, "prompt": [[1], []]}, "prompt[1]"),
    ("completion-too-many-prompts", COMPLETIONS, {"model": MODEL, "prompt": ["a"] * 65}, "prompt"),
    ("completion-bad-token-id", COMPLETIONS, {"model": MODEL, "prompt": [1, 10 ** 9]}, "prompt[1]"),
    ("tool-without-content", CHAT, _chat(messages=MSG + [{"role": "tool", "tool_call_id": "c1"}]), "messages[1].content"),
    ("completion-negative-token-id", COMPLETIONS, {"model": MODEL, "prompt": [-1]}, "prompt[0]"),
    ("completion-echo-logprobs-stream", COMPLETIONS,
     {"model": MODEL, "prompt": "a", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ("completion-suffix", COMPLETIONS, {"model": MODEL, "prompt": "a", "suffix": "b"}, "suffix"),
    ("completion-best-of", COMPLETIONS, {"model": MODEL, "prompt": "a", "best_of": 3}, "best_of"),
    ("completion-logprobs", COMPLETIONS, {"model": MODEL, "prompt": "a", "logprobs": 21}, "logprobs"),
    ("completion-max-tokens", COMPLETIONS, {"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_request_is_400(http, engine, path, body, param):
    _error(http.post(path, json=body), 400, param=param, type_="invalid_request_error")
    if "stream" not in body:  # a streaming request is refused before any event is sent
        _error(http.post(path, json={**body, "stream": True}), 400, param=param)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_prompt_over_the_context_limit(http, engine, path):
    long = "x " * MAX_MODEL_LEN * 2
    body = _chat(messages=[{"role": "user", "content": long}]) if path == CHAT else {"model": MODEL, "prompt": long}
    _error(http.post(path, json=body), 400, code="context_length_exceeded")


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'{"model": "k3-tiny", "messages": NaN}',
                                  b'"just a string"', b"\xff\xfe"], ids=["broken", "empty", "array", "nan",
                                                                          "string", "not-utf8"])
def test_malformed_json_is_400(http, engine, body):
    _error(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 400)


def test_nan_in_a_float_field_is_400(http, engine):
    _error(http.post(CHAT, content=b'{"model": "k3-tiny", "messages": [{"role": "user", "content": "x"}], '
                                   b'"temperature": NaN}', headers={"content-type": "application/json"}), 400,
           param="temperature")


def test_unknown_model_is_404(http, engine, client):
    _error(http.post(CHAT, json=_chat(model="gpt-5")), 404, param="model", code="model_not_found")
    _error(http.post(COMPLETIONS, json={"model": "nope", "prompt": "a"}), 404, code="model_not_found")
    _error(http.get("/v1/models/nope"), 404, code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=MSG)


def test_unknown_route_and_method(http, engine):
    _error(http.get("/v1/nothing"), 404, type_="not_found_error")
    r = http.get(CHAT)
    _error(r, 405)
    assert r.headers["allow"] == "POST"                      # RFC 9110: a 405 names the methods allowed


def test_stop_token_ids_outside_the_vocabulary(http, engine):
    for path, body, at in ((CHAT, _chat(stop_token_ids=[3, 10**6]), "[1]"),
                           (COMPLETIONS, {"model": MODEL, "prompt": "a", "stop_token_ids": [512, 2]}, "[0]")):
        error = _error(http.post(path, json=body), 400, param="stop_token_ids" + at)   # the id at fault
        assert "outside the vocabulary (0 to 511)" in error["message"], error


def test_openai_client_sees_bad_request(client, engine):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=-1)
    assert info.value.body["param"] == "temperature"


@pytest.fixture(scope="module")
def keyed(engine):
    with LiveServer(build_app(engine, served_model_name=MODEL, api_key="sekret")) as live:
        yield live


def test_api_key(keyed, engine):
    with httpx.Client(base_url=keyed.url) as c:
        _error(c.post(CHAT, json=_chat()), 401, code="invalid_api_key")
        _error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
        _error(c.post(COMPLETIONS, json={"model": MODEL, "prompt": "a"}, headers={"Authorization": "Basic sekret"}),
               401)
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        # the key is checked before the body: no validation detail without it
        _error(c.post(CHAT, content=b"{not json", headers={"content-type": "application/json"}), 401,
               code="invalid_api_key")
        _error(c.post(CHAT, json={"model": MODEL}), 401, code="invalid_api_key")
        _error(c.post(CHAT, content=b"{not json", headers={"content-type": "application/json",
                                                           "Authorization": "Bearer sekret"}), 400, code="invalid_json")
        ok = c.post(CHAT, json=_chat(), headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200, ok.text
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sekret", max_retries=0)
    assert good.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_several_api_keys(engine):
    """--api-key a b: either key opens /v1, anything else is a 401."""
    with LiveServer(build_app(engine, served_model_name=MODEL, api_key=["first", "second"])) as live, \
            httpx.Client(base_url=live.url) as c:
        for key in ("first", "second"):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        for key in ("third", "firstsecond", "first second"):
            _error(c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}), 401, code="invalid_api_key")


def test_server_still_serves_after_all_that(client, engine):
    assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).usage.completion_tokens == 2


class _DeadEngine:
    """An engine whose loop has failed (AsyncEngine sets `dead` and refuses new work)."""

    def __init__(self, real):
        self.engine, self.tokenizer, self.stats, self.dead = real.engine, real.tokenizer, real.stats, "boom"

    async def generate(self, request_id, prompt, params):
        from k3.engine.async_engine import EngineDeadError

        raise EngineDeadError(self.dead)
        yield


def test_dead_engine_is_503(engine):
    with LiveServer(build_app(_DeadEngine(engine), served_model_name=MODEL)) as live:
        with httpx.Client(base_url=live.url) as c:
            _error(c.get("/health"), 503, code="engine_dead")
            _error(c.post(CHAT, json=_chat()), 503, code="engine_dead", type_="server_error")
            with c.stream("POST", COMPLETIONS, json={"model": MODEL, "prompt": "a", "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and '"code": "engine_dead"' in lines[0] and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("path,body,param", [
    (CHAT, _chat(messages=[{"role": "user", "content": "a\ud800b"}]), "messages"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]), "messages"),
    (CHAT, _chat(messages=MSG + [{"role": "assistant", "content": "x\udc00"}, {"role": "user", "content": "y"}]),
     "messages"),
    (CHAT, _chat(stop=["x\ud800"]), "stop"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "description": "\udc00"}}]), "tools"),
    (COMPLETIONS, {"model": MODEL, "prompt": "a\ud800", "max_tokens": 2}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "a", "stop": "\ud83d", "max_tokens": 2}, "stop"),
], ids=["content", "text-part", "assistant", "stop", "tool-description", "prompt", "completion-stop"])
def test_a_lone_surrogate_is_refused_wherever_it_is(http, engine, path, body, param):
    """One rule for text: a lone surrogate (valid JSON, invalid Unicode) is a 400 naming the field,
    in chat content as in `stop` (chat content was once accepted and `stop` refused)."""
    import json

    r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    error = _error(r, 400, param=param)
    assert "surrogate" in error["message"], error
    ok = http.post(CHAT, json=_chat(messages=[{"role": "user", "content": "a pair is fine: \U0001F600"}]))
    assert ok.status_code == 200, ok.text
