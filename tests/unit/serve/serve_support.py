"""Serve-tier helpers: a uvicorn server in a background thread on a free loopback port, the
served model name, and waiting for the engine to give every cache row back."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

MODEL = "k3-tiny"
MAX_MODEL_LEN = 1024  # of the session engine


def wait_rows_free(engine, timeout: float = 10.0) -> dict:
    """Engine stats once every row is free and no request runs (or the last stats at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        idle = s["cache_rows_free"] == s["cache_rows"] and s["running"] == 0 and s["waiting"] == 0
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


class LiveServer:
    """`with LiveServer(app) as server:` serves `app` at `server.url` until the block ends."""

    def __init__(self, app, *, log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def request_validator(openapi: dict, path: str):
    """A jsonschema validator of `path`'s POST body, against the published /openapi.json
    (OpenAPI 3.1 schemas are JSON Schema 2020-12; refs point into the document's components)."""
    from jsonschema import Draft202012Validator

    body = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return Draft202012Validator({**body, "components": openapi["components"]})
