"""Schemathesis against the server's published /openapi.json (loopback only): 150 generated
requests, valid and invalid, deterministic. No 5xx, responses match the published schema,
the server survives, no cache row leaks, and a body the published schema accepts is never
refused for a field the schema bounds itself (token ids against the vocabulary, a tool
message's content: `k3.serve.token_bound`, issue 32 item 5)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from k3.serve import build_app

from serve_support import MODEL, LiveServer, request_validator, wait_rows_free

EXAMPLES = 150
TOKEN_CAP = 3  # generated requests ask for up to the context limit; the fuzz tier caps each at 3 tokens


class Capped:
    """The engine with every request's max_tokens capped (bounds the fuzz tier's time; the
    HTTP layer under test sees the requests as sent)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, request_id, prompt, params):
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens or TOKEN_CAP, TOKEN_CAP),
                                     min_tokens=min(params.min_tokens, TOKEN_CAP))
        return self._engine.generate(request_id, prompt, params)


def _served_model(case_and_dice):
    """Most cases name the served model, so they reach the engine rather than stop at a 404;
    some also get a plain conversation (a schema cannot say that a tool result must answer an
    earlier call, so generated conversations rarely render) while every other field stays fuzzed."""
    case, dice = case_and_dice
    body = case.body if isinstance(case.body, dict) else {}
    if dice and "model" in body:
        body["model"] = MODEL
    if dice and case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = MODEL
    if dice >= 2 and isinstance(body.get("messages"), list):
        first = body["messages"][0] if body["messages"] else {}
        text = first.get("content") if isinstance(first, dict) else None
        body["messages"] = [{"role": "user", "content": text if isinstance(text, str) else "hi"}]
        if body.get("tool_choice") == "required" and not body.get("tools"):
            body.pop("tool_choice")
    return case


def _check_bounded_fields(openapi: dict, validators: dict, path: str, body: dict, error: dict) -> None:
    """A schema-valid body refused for a token id or a tool message's content: the schema and
    the validation disagree."""
    if path not in validators:
        validators[path] = request_validator(openapi, path)
    if not validators[path].is_valid(body):
        return
    about_bounds = "outside the vocabulary" in error["message"] or (error["param"] or "").endswith(".content")
    assert not about_bounds, (path, body, error)


def test_schemathesis_finds_no_server_error(engine):
    app = build_app(Capped(engine), served_model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser="kimi_k3",
                    reasoning_parser="kimi_k3")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    with LiveServer(app) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        valid = schema.as_strategy(schemathesis.GenerationMode.POSITIVE)
        cases = st.tuples(st.one_of(valid, valid, schema.as_strategy(schemathesis.GenerationMode.NEGATIVE)),
                          st.integers(0, 4)).map(_served_model)
        openapi = app.openapi()     # what /openapi.json serves
        validators: dict = {}
        statuses: list[int] = []

        @settings(max_examples=EXAMPLES, deadline=timedelta(seconds=15), derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def fuzz(case):
            response = case.call_and_validate(base_url=server.url, checks=checks, timeout=30)
            statuses.append(response.status_code)
            if response.status_code == 400 and case.method.upper() == "POST" and isinstance(case.body, dict):
                _check_bounded_fields(openapi, validators, case.path, case.body, response.json()["error"])

        fuzz()
        assert len(statuses) >= EXAMPLES * 0.9
        # Most generated requests reach the engine or are refused with a 4xx; both paths are exercised.
        assert statuses.count(200) >= EXAMPLES // 5 and any(400 <= s < 500 for s in statuses), statuses
        stats = wait_rows_free(engine)
        assert stats["cache_rows_free"] == stats["cache_rows"] and stats["running"] == 0, stats
        assert not engine.dead
