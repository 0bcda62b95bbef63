"""GET /docs: the Swagger UI page, served from the installed package, never from a CDN.

FastAPI's own /docs and /redoc pages load their scripts from jsDelivr, so on a machine without
internet access (most accelerator hosts) they stay blank. k3 serves Swagger UI's files itself,
from the `fastapi-swagger` package (Swagger UI 5, which renders FastAPI's OpenAPI 3.1 schema:
`pip install 'k3[docs]'`, which the `test` extra pulls in), under /docs/static/. Without
that package /docs is a short page that says so and links /openapi.json. /redoc is not served
(ReDoc has no offline package). The page references no other host.
"""

from __future__ import annotations

import html
from importlib import resources

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, Response

ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}
STATIC = "/docs/static/"
_PACKAGE = "fastapi_swagger.resources"
_INSTALL = "pip install 'k3[docs]'"


def swagger_assets():
    """The folder of Swagger UI's files (an importlib Traversable), or None when not installed."""
    try:
        folder = resources.files(_PACKAGE)
    except ModuleNotFoundError:
        return None
    return folder if all(folder.joinpath(name).is_file() for name in ASSETS) else None


def _page(title: str, openapi_url: str) -> str:
    t, url = html.escape(title), html.escape(openapi_url)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{t}</title>
<link rel="stylesheet" href="{STATIC}swagger-ui.css">
<link rel="icon" type="image/png" href="{STATIC}favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{STATIC}swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{url: "{url}", dom_id: "#swagger-ui", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis], layout: "BaseLayout"}});
</script>
</body>
</html>
"""


def _fallback(title: str, openapi_url: str) -> str:
    t, url = html.escape(title), html.escape(openapi_url)
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>{t}</title></head>
<body>
<h1>{t}</h1>
<p>The Swagger UI files are not installed on this server, and k3 loads nothing from a CDN.
Install them with <code>{html.escape(_INSTALL)}</code> and restart. The OpenAPI schema is at
<a href="{url}">{url}</a>.</p>
</body>
</html>
"""


def install_docs_page(app: FastAPI) -> None:
    """Serve /docs and its files on `app` (built with docs_url=None, redoc_url=None)."""
    folder = swagger_assets()
    title = f"{app.title} - Swagger UI"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(_page(title, app.openapi_url) if folder is not None else _fallback(title, app.openapi_url))

    @app.get(STATIC + "{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if folder is None or name not in ASSETS:
            raise HTTPException(404, f"no such documentation file: {name}"
                                     + ("" if folder is not None else f" (Swagger UI is not installed: {_INSTALL})"))
        return Response(folder.joinpath(name).read_bytes(), media_type=ASSETS[name],
                        headers={"Cache-Control": "public, max-age=86400"})
