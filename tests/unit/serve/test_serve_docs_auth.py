"""With an API key, /docs and /openapi.json need the key (401, OpenAI error body), unless
`public_docs` (`k3 serve --public-docs`) opens them; without a key they are open."""

from __future__ import annotations

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest

from k3.serve import build_app
from serve_support import MODEL, LiveServer

DOCS = ("/docs", "/openapi.json")      # no /redoc: its page needs a CDN (k3.serve.docs_page)


@pytest.mark.parametrize("public_docs", [False, True])
def test_docs_behind_the_api_key_unless_public(engine, public_docs):
    app = build_app(engine, served_model_name=MODEL, api_key="sekret", public_docs=public_docs)
    with LiveServer(app) as live, httpx.Client(base_url=live.url) as c:
        for path in DOCS:
            bare = c.get(path)
            if public_docs:
                assert bare.status_code == 200, (path, bare.text[:200])
            else:
                assert bare.status_code == 401, path
                assert bare.json()["error"]["code"] == "invalid_api_key"
                assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            keyed = c.get(path, headers={"Authorization": "Bearer sekret"})
            assert keyed.status_code == 200, path
        assert c.get("/health").status_code == 200


def test_docs_open_without_a_key(engine):
    with LiveServer(build_app(engine, served_model_name=MODEL)) as live, httpx.Client(base_url=live.url) as c:
        assert all(c.get(p).status_code == 200 for p in DOCS)
