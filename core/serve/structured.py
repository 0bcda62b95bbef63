"""Structured-output request fields -> a compiled StructuredOutputsParams, or a 400.

The fields, as vLLM accepts them: `response_format` ({"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; a schema is enforced
whether strict or not), `structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
"json_object": ...}) and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one may constrain a request.

A K3 chat answer is an XTML message, so the constraint covers the response channel only: in
instruct mode the generation prefix already opened it, in thinking mode the grammar starts
after `<|close|>think<|sep|>` (the reasoning is free) with `<|open|>response<|sep|>` forced;
then `<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>` is forced after it.
The grammar is compiled here, in the request handler's worker thread, under the engine's time
limit, so the engine loop only ever finds it in the compile cache.
"""

from __future__ import annotations

from k3.chat.xtml import END_OF_MSG, MESSAGE_CLOSE, RESPONSE_CLOSE, RESPONSE_OPEN, THINK_CLOSE
from k3.structured import StructuredOutputError, StructuredOutputsParams

from .errors import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def requested_spec(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None: unconstrained)."""
    found = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            js = rf.json_schema or {}
            schema = js.get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs json_schema.schema (an object)",
                                  param="response_format")
            found.append(("response_format", {"json": schema}))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"at most one structured-output constraint per request; got {names}", param=found[1][0])
    field, fields = found[0]
    try:
        return StructuredOutputsParams(**fields), field
    except TypeError as e:
        raise bad_request(f"{field}: unknown field ({e})", param=field) from None
    except StructuredOutputError as e:
        raise bad_request(f"{field}: {e}", param=field) from None


def for_k3_chat(spec: StructuredOutputsParams, tokenizer, *, thinking: bool) -> StructuredOutputsParams:
    """`spec` wrapped into the K3 assistant message (see the module docstring)."""
    import dataclasses

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, allow_special=True))

    return dataclasses.replace(spec, trigger=ids(THINK_CLOSE) if thinking else (),
                               prefix=ids(RESPONSE_OPEN) if thinking else (),
                               suffix=ids(RESPONSE_CLOSE + MESSAGE_CLOSE + END_OF_MSG))


def compile_spec(state, spec: StructuredOutputsParams, field: str) -> None:
    """Compile `spec` into the engine's cache (blocking this worker thread at most the
    engine's compile time limit); a spec that does not compile is a 400 naming `field`."""
    structured = getattr(getattr(state.engine, "engine", None), "structured", None)
    if structured is None:
        raise bad_request("structured outputs are not available on this server", param=field)
    try:
        structured.compile(spec)
    except StructuredOutputError as e:
        raise bad_request(f"{field}: {e}", param=field, code="invalid_structured_output") from None
