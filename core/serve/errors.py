"""OpenAI-style errors: every failure answers `{"error": {"message", "type", "param", "code"}}`.

FastAPI's 422 validation answers become 400 with that body; unknown routes 404; anything
unexpected 500 (logged with its traceback; the server keeps running).
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("k3.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}
# Union branch names in pydantic error locations: builtin types, generics, validators, model classes.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|literal|tuple)\[.*|(function|constrained)-.*|[A-Z]\w*)$")


class APIError(Exception):
    """A request the server refuses; raised anywhere in a handler, answered as JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never read by anyone


def as_api_error(exc: Exception) -> APIError:
    """An error met while generating: a refusal by the engine is the client's (400), a dead
    engine is 503, anything else 500."""
    from k3.engine.async_engine import EngineDeadError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine has failed: {exc}", code="engine_dead")
    from k3.lora import LoRANotFound

    if isinstance(exc, LoRANotFound):   # the adapter was unloaded after the route checked the name
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    logger.error("unexpected error while generating: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def sse_error(err: APIError) -> str:
    """The error as one server-sent event (after a stream's headers were sent)."""
    return f"data: {json.dumps(err.body())}\n\n"


# custom pydantic errors raised on a whole object that are about one of its fields
_FIELD_OF = {"unknown_role": "role"}


def _param(loc) -> str | None:
    """pydantic location ("body", "messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif _UNION_TAG.match(str(part)):
            continue  # which branch of a union failed, not a field
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _relevant(errors: list[dict]) -> list[dict]:
    """Drop the "wrong type" errors of union branches a value was not meant for: when a field
    also has an error that is not about a type (too short, out of range), that one says what
    is wrong; "should be a valid string" for the other branches is noise."""
    def field(e: dict) -> str:
        return re.split(r"[.\[]", _param(e.get("loc", ())) or "")[0]

    def is_type(e: dict) -> bool:
        return str(e.get("type", "")).endswith("_type")

    explained = {field(e) for e in errors if not is_type(e)}
    return [e for e in errors if not (is_type(e) and field(e) in explained)]


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    for e in errors:
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "")
            detail = f" ({reason})" if reason else ""
            return bad_request(f"The request body is not valid JSON{detail}.", code="invalid_json")
    errors = [{**e, "loc": (*e.get("loc", ()), _FIELD_OF[e["type"]])} if e.get("type") in _FIELD_OF else e
              for e in errors]
    errors = _relevant(errors) or [{"loc": (), "msg": "invalid request"}]
    param = _param(errors[0].get("loc", ()))
    parts = []
    for e in errors[:3]:
        where = _param(e.get("loc", ())) or "request body"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return bad_request("; ".join(dict.fromkeys(parts)) + more, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # FastAPI reads the body before the route's dependencies run: check the key first, so
        # a client without it learns nothing about the API from the validation message
        from .state import api_key_error, needs_key

        denied = api_key_error(request) if needs_key(request.url.path) else None
        return (denied or validation_error(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else (
            f"{phrase}: {request.method} {request.url.path}")
        response = APIError(exc.status_code, message).response()
        for name, value in (exc.headers or {}).items():     # 405's Allow, among others
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return as_api_error(exc).response()
