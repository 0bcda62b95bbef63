"""The API documentation pages (/docs, /openapi.json) behind the server's API key.

When the server has an API key, these pages describe every route and field of a private
deployment, so they need `Authorization: Bearer KEY` like the /v1 routes (401 with an
OpenAI-style error body otherwise), unless `k3 serve --public-docs` opens them. Without a key
they are open, as the whole server is. Swagger UI's own files (/docs/static/*) are open: they
say nothing about the API.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from .state import api_key_error

DOC_PATHS = ("/docs", "/openapi.json")


def protect_docs(app: FastAPI) -> None:
    """Put the documentation pages of `app` behind its API key (see the module docstring)."""

    @app.middleware("http")
    async def require_key_for_docs(request: Request, call_next):
        if request.url.path in DOC_PATHS:
            denied = api_key_error(request)
            if denied is not None:
                return denied.response()
        return await call_next(request)
