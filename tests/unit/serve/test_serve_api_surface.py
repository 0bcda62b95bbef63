"""vLLM's extra routes and fields: /tokenize, /detokenize, /ping; `reasoning` beside
`reasoning_content`; `thinking: {"type": "disabled"}`; `echo` on /v1/completions; /docs served
without a CDN. Each answer is checked against an independent computation (the tokenizer, the
renderer, a request without the feature)."""

from __future__ import annotations

import json
import re

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest

from k3.chat.template import chat_prompt_ids
from k3.serve import build_app, docs_page

from serve_support import MAX_MODEL_LEN, MODEL, LiveServer

USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_tokenize_and_detokenize(http, engine):
    tok = engine.tokenizer
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello <|open|> there", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = tok.encode("Hello <|open|> there", allow_special=False)        # special names stay text
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == [tok.id_to_token(t) for t in expected]
    back = http.post("/detokenize", json={"model": MODEL, "tokens": expected})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello <|open|> there"}

    chat = http.post("/tokenize", json={"messages": USER}).json()
    assert chat["tokens"] == chat_prompt_ids(tok, USER) and "token_strs" not in chat or chat["token_strs"] is None
    bare = http.post("/tokenize", json={"messages": USER, "add_generation_prompt": False}).json()["tokens"]
    assert bare == chat_prompt_ids(tok, USER, add_generation_prompt=False) and chat["tokens"][:len(bare)] == bare
    assert len(bare) < chat["count"]
    served = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 1}).json()
    assert served["usage"]["prompt_tokens"] == chat["count"]

    size = tok.vocab_size
    bad = http.post("/detokenize", json={"tokens": [1, size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]" and str(size - 1) in bad.text
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    refused = http.post("/tokenize", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("messages")


def test_ping_and_keyed_tokenize(http, engine):
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    app = build_app(engine, served_model_name=MODEL, api_key="sekret")
    with LiveServer(app) as live, httpx.Client(base_url=live.url) as c:
        assert c.get("/ping").status_code == 200
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": "not ids"})):
            denied = c.post(path, json=body)
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key", path
        ok = c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["count"] >= 1


def test_thinking_disabled_renders_instruct_mode(http, engine):
    tok = engine.tokenizer
    thinking = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    off = http.post("/tokenize", json={"messages": USER, "thinking": {"type": "disabled"}}).json()["tokens"]
    kwargs = http.post("/tokenize", json={"messages": USER, "chat_template_kwargs": {"thinking": False}}).json()
    assert off == kwargs["tokens"] == chat_prompt_ids(tok, USER, thinking=False) != thinking
    assert tok.decode(off).endswith("<|open|>response<|sep|>") and tok.decode(thinking).endswith("<|open|>think<|sep|>")
    assert "thinking-effort" in tok.decode(thinking) and "thinking-effort" not in tok.decode(off)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 1,
                                                "thinking": {"type": "disabled"}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(off)
    clash = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "thinking": {"type": "enabled"},
                                                    "chat_template_kwargs": {"thinking": False}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "thinking"
    assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                   "thinking": {"type": "off"}}).status_code == 400


def test_reasoning_beside_reasoning_content(http):
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] and message["reasoning"]   # thinking: all reasoning
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in s.iter_lines()
                  if line.startswith("data: {")]
    reasoning = [d for d in deltas if "reasoning_content" in d]
    assert reasoning and all(d["reasoning"] == d["reasoning_content"] for d in reasoning)
    assert "".join(d["reasoning"] for d in reasoning) == message["reasoning"]


def test_echo(client, engine):
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    ids = engine.tokenizer.encode("Hello there", allow_special=False)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert by_ids.choices[0].text == engine.tokenizer.decode(ids) + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text

    scored = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0,
                                       extra_body={"prompt_logprobs": 1}, logprobs=1)
    lp = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True,
                                   logprobs=1).choices[0].logprobs
    reference = scored.choices[0].model_extra["prompt_logprobs"]      # the engine's prompt scores, asked directly
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for k in range(1, len(ids)):
        assert lp.token_logprobs[k] == pytest.approx(reference[k][str(ids[k])]["logprob"])
    assert lp.token_logprobs[len(ids):] == pytest.approx(scored.choices[0].logprobs.token_logprobs)
    assert lp.text_offset[len(ids)] == len("Hello there") and lp.text_offset == sorted(lp.text_offset)
    both = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=1, echo=True, logprobs=3,
                                     extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    assert [e and len(e) for e in both] == [e and len(e) for e in reference]     # as asked, not echo's 3
    with pytest.raises(Exception, match="echo"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True, logprobs=1, stream=True)


_REFERENCE = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


def test_docs_page_is_served_without_a_cdn(http, engine, monkeypatch):
    page = http.get("/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    refs = _REFERENCE.findall(page.text)
    assert refs and not re.search(r"https?:|//", page.text.replace("<!DOCTYPE html>", "")), refs
    for ref in refs:
        asset = http.get(ref)
        assert asset.status_code == 200 and len(asset.content) > 100, ref
    assert http.get("/redoc").status_code == 404
    assert http.get("/docs/static/index.html").status_code == 404          # only the listed files
    monkeypatch.setattr(docs_page, "swagger_assets", lambda: None)
    app = build_app(engine, served_model_name=MODEL)
    with LiveServer(app) as live, httpx.Client(base_url=live.url) as c:
        note = c.get("/docs")
        assert note.status_code == 200 and "k3[docs]" in note.text and 'href="/openapi.json"' in note.text
        assert "://" not in note.text and c.get("/docs/static/swagger-ui.css").status_code == 404
