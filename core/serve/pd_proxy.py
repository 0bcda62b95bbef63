"""The prefill/decode proxy (`k3-pd-proxy`): an OpenAI-compatible front for disaggregated
instances (docs/disaggregation.md).

Each POST /v1/completions or /v1/chat/completions goes first to a prefill instance (a
`k3 serve --kv-transfer-config` producer), unstreamed, with kv_transfer_params
{"do_remote_decode": true}: it prefills, samples the first token and answers with a transfer
handle in its kv_transfer_params. Then the client's body goes to a decode instance with that
handle as its kv_transfer_params, and the decode instance's answer (streamed or not) is
passed back as it arrives. Instances are picked round-robin. A 4xx from the prefill instance
is the client's error and is returned as it is; a prefill instance that is down or fails
(5xx) costs only the transfer: the decode instance gets the body without a handle and
prefills itself. Upstream HTTP is a small asyncio HTTP/1.1 client (no dependency beyond the
server's FastAPI and uvicorn).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3.log import get_logger

logger = get_logger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status)


class Upstream:
    """One instance's base URL ("http://host:port")."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"an instance URL must be http://HOST:PORT, got {url!r}")
        self.url, self.host, self.port = url.rstrip("/"), parts.hostname, parts.port or 80

    async def open(self, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout_s: float):
        """(status, headers, body chunks) of one request; OSError / TimeoutError when unreachable."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), timeout_s)
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout_s)
        if not status_line:
            writer.close()
            raise ConnectionError(f"{self.url} closed the connection before answering")
        status = int(status_line.split()[1])
        head: dict[str, str] = {}
        while True:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            head[k.strip().lower()] = v.strip()
        return status, head, _body(reader, writer, head)


async def _body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: dict) -> AsyncIterator[bytes]:
    """A response body as it arrives (chunked, sized, or until the connection closes)."""
    try:
        if head.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readline()
                    return
                chunk = await reader.readexactly(size)
                await reader.readexactly(2)
                yield chunk
        elif "content-length" in head:
            n = int(head["content-length"])
            if n:
                yield await reader.readexactly(n)
        else:
            while chunk := await reader.read(65536):
                yield chunk
    finally:
        writer.close()


async def _read_all(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in chunks])


def build_proxy(prefill: list[str], decode: list[str], *, timeout_s: float = 600.0) -> FastAPI:
    """The proxy app over prefill and decode instance URLs (each list non-empty)."""
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode instance")
    prefills, decodes = [Upstream(u) for u in prefill], [Upstream(u) for u in decode]
    next_prefill, next_decode = itertools.cycle(prefills), itertools.cycle(decodes)
    app = FastAPI(title="k3-pd-proxy", description="prefill/decode proxy of k3 (docs/disaggregation.md)")
    app.state.stats = {"requests": 0, "handles": 0, "prefill_failures": 0}

    def forwarded(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def handle(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return _error(400, f"the request body is not JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        app.state.stats["requests"] += 1
        headers = forwarded(request)
        kv = None
        prefill_body = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        prefill_body.pop("stream_options", None)
        upstream = next(next_prefill)
        try:
            status, _, chunks = await upstream.open("POST", path, json.dumps(prefill_body).encode(), headers,
                                                    timeout_s)
            data = await _read_all(chunks)
            if 400 <= status < 500:            # the client's error: the decode instance would refuse it too
                return Response(data, status_code=status, media_type="application/json")
            if status == 200:
                kv = json.loads(data).get("kv_transfer_params")
            else:
                raise ConnectionError(f"HTTP {status}: {data[:200]!r}")
        except (OSError, asyncio.TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError) as e:
            app.state.stats["prefill_failures"] += 1
            logger.warning(f"pd proxy: prefill on {upstream.url} failed ({type(e).__name__}: {e}); the decode "
                           "instance prefills")
        decode_body = dict(body)
        decode_body.pop("kv_transfer_params", None)
        if kv:
            decode_body["kv_transfer_params"] = kv
            app.state.stats["handles"] += 1
        upstream = next(next_decode)
        try:
            status, head, chunks = await upstream.open("POST", path, json.dumps(decode_body).encode(), headers,
                                                       timeout_s)
        except (OSError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            return _error(502, f"the decode instance {upstream.url} cannot be reached: {type(e).__name__}: {e}")
        return StreamingResponse(chunks, status_code=status,
                                 media_type=head.get("content-type", "application/json"))

    def route(path: str):
        async def endpoint(request: Request):
            return await handle(request, path)
        return endpoint

    for path in ROUTES:
        app.add_api_route(path, route(path), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        upstream = decodes[0]
        try:
            status, head, chunks = await upstream.open("GET", "/v1/models", None, forwarded(request), timeout_s)
            return Response(await _read_all(chunks), status_code=status,
                            media_type=head.get("content-type", "application/json"))
        except (OSError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            return _error(502, f"the decode instance {upstream.url} cannot be reached: {e}")

    @app.get("/health")
    async def health():
        down = []
        for upstream in prefills + decodes:
            try:
                status, _, chunks = await upstream.open("GET", "/health", None, {}, 5.0)
                await _read_all(chunks)
                if status != 200:
                    down.append(upstream.url)
            except (OSError, asyncio.TimeoutError, ConnectionError, ValueError):
                down.append(upstream.url)
        return JSONResponse({"down": down}, status_code=503 if down else 200)

    return app
