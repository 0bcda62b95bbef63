"""The published /openapi.json and the server's validation are one source (issue 32 item 5):
every token-id field of every request model carries the served vocabulary's bound, a tool
message needs content, and for these fields a body the published schema accepts is answered
200 while one it refuses is a 400 (checked with jsonschema against the schema the server
publishes, on generated values around the bounds)."""

from __future__ import annotations

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_support import MODEL, request_validator

MARK, KEY_MARK = "x-k3-token-id", "x-k3-token-id-keys"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
BASE = {CHAT: {"model": MODEL, "messages": USER, "max_tokens": 1},
        COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 1},
        "/tokenize": {"model": MODEL, "messages": USER}, "/detokenize": {"model": MODEL, "tokens": [1]}}
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def openapi(http):
    return http.get("/openapi.json").json()


@pytest.fixture(scope="module")
def vocab(engine):
    return min(engine.engine.model_config.vocab_size, engine.tokenizer.vocab_size)


def _marked(node, doc, seen=()) -> list[dict]:
    """Every schema node under `node` (refs followed) marked as a token id or token-id keys."""
    if isinstance(node, list):
        return [m for n in node for m in _marked(n, doc, seen)]
    if not isinstance(node, dict):
        return []
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        return [] if name in seen else _marked(doc["components"]["schemas"][name], doc, (*seen, name))
    own = [node] if node.get(MARK) or node.get(KEY_MARK) else []
    return own + [m for v in node.values() for m in _marked(v, doc, seen)]


def _token_fields(openapi) -> dict[str, set[str]]:
    """Request path -> the top-level body fields that hold token ids, read off the schema."""
    out = {}
    for path, ops in openapi["paths"].items():
        body = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body is None:
            continue
        name = body["schema"]["$ref"].rsplit("/", 1)[1]
        model = openapi["components"]["schemas"][name]
        branches = [openapi["components"]["schemas"][b["$ref"].rsplit("/", 1)[1]]
                    for b in model.get("oneOf", model.get("anyOf", []))] or [model]
        fields = {f for m in branches for f, s in m.get("properties", {}).items() if _marked(s, openapi)}
        if fields:
            out[path] = fields
    return out


def test_every_token_id_field_publishes_the_vocabulary_bound(openapi, vocab):
    assert _token_fields(openapi) == {CHAT: {"stop_token_ids", "logit_bias"},
                                      COMPLETIONS: {"prompt", "stop_token_ids", "logit_bias"},
                                      "/detokenize": {"tokens"}}
    marks = _marked(openapi["components"], openapi)
    ids = [m for m in marks if m.get(MARK)]
    assert ids and all(m["maximum"] == vocab - 1 and m["minimum"] == 0 for m in ids), ids
    keys = [m for m in marks if m.get(KEY_MARK)]
    assert keys and all("patternProperties" not in m and "propertyNames" in m for m in keys), keys


def _bodies(path: str, field: str, token: int) -> list[dict]:
    """Bodies of `path` with `token` in `field` (each shape of the field)."""
    base = BASE[path]
    if field == "prompt":
        return [{**base, "prompt": [1, token]}, {**base, "prompt": [[2], [token]]}]
    if field == "logit_bias":
        return [{**base, "logit_bias": {str(token): 1.0}}]
    return [{**base, field: [token]}]


def _agree(http, openapi, path: str, body: dict) -> bool:
    """Schema verdict == server verdict for `body`; returns the verdict."""
    validators = openapi.setdefault("x-test-validators", {})     # this module's copy of the document
    if path not in validators:
        validators[path] = request_validator(openapi, path)
    valid = validators[path].is_valid(body)
    r = http.post(path, json=body)
    assert r.status_code == (200 if valid else 400), (path, body, valid, r.text)
    if not valid:
        assert "outside the vocabulary" in r.json()["error"]["message"] or "content" in r.json()["error"]["param"]
    return valid


@settings(SETTINGS, max_examples=5)     # each example: 14 requests
@given(offset=st.integers(-2, 2), far=st.integers(0, 2 ** 40))
def test_token_ids_schema_and_server_agree(http, openapi, vocab, engine, offset, far):
    for path, fields in sorted(_token_fields(openapi).items()):
        for field in sorted(fields):
            for token in (vocab + offset, far):
                for body in _bodies(path, field, token):
                    assert _agree(http, openapi, path, body) == (token < vocab), (path, body)


@SETTINGS
@given(key=st.one_of(st.from_regex(r"\A[0-9]{1,13}\Z"),
                     st.integers(0, 2 ** 10).map(str), st.integers(0, 2 ** 10).map(lambda i: f"{i:0>11}")))
def test_logit_bias_keys_schema_and_server_agree(http, openapi, vocab, engine, key):
    body = {**BASE[COMPLETIONS], "logit_bias": {key: 0.5}}
    assert _agree(http, openapi, COMPLETIONS, body) == (len(key) <= 12 and int(key) < vocab), key


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
@pytest.mark.parametrize("content", [..., None, "sunny", [{"type": "text", "text": "sunny"}]],
                         ids=["absent", "null", "text", "parts"])
def test_tool_message_content_schema_and_server_agree(http, openapi, engine, path, content):
    tool = {"role": "tool", "tool_call_id": "c1"} | ({} if content is ... else {"content": content})
    body = {**BASE[path], "messages": USER + [CALL, tool]}
    assert _agree(http, openapi, path, body) == (content not in (..., None))
    if content in (..., None):
        assert http.post(path, json=body).json()["error"]["param"] == "messages[2].content"


def test_roles_are_published_one_model_each(openapi):
    schemas = openapi["components"]["schemas"]
    roles = {name: schemas[name]["properties"]["role"] for name in
             ("SystemMessage", "UserMessage", "AssistantInputMessage", "ToolMessage")}
    assert "content" in schemas["ToolMessage"]["required"]
    assert all("content" not in schemas[n].get("required", []) for n in roles if n != "ToolMessage")
    assert "tool_calls" in schemas["AssistantInputMessage"]["properties"]
    assert "tool_call_id" in schemas["ToolMessage"]["properties"] and "tools" in schemas["SystemMessage"]["properties"]


@pytest.mark.parametrize("tools", [[{"type": "function", "function": {"name": "more"}}], "more", [{"name": "more"}]],
                         ids=["spec", "not-a-list", "bare"])
def test_tools_on_a_system_message_schema_and_server_agree(http, openapi, engine, tools):
    body = {**BASE["/tokenize"], "messages": [{"role": "system", "content": "s", "tools": tools}, *USER]}
    valid = request_validator(openapi, "/tokenize").is_valid(body)
    r = http.post("/tokenize", json=body)
    assert r.status_code == (200 if valid else 400) and valid == (tools != "more" and "function" in tools[0]), r.text
    if not valid:
        assert r.json()["error"]["param"].startswith("messages[0].tools"), r.text
