"""tool_choice "auto" with strict tools on K3 chat (issue 29): the answer is free until the model
opens the tools channel, then one call of a declared tool whose arguments follow its schema.
The grammar is driven token by token here (random picks among the tokens its bitmask allows),
since random weights almost never open the tools channel themselves; the server's K3 parser
must read the result as one valid call. The server side (strict tools compiled, others not) is
in test_serve_structured.py."""

import json
import random

import jsonschema
import pytest
import torch

import k3
from k3.chat.parse_k3 import parse_k3_output
from k3.chat.xtml import RESPONSE_CLOSE, TOOLS_OPEN
from k3.serve.tool_grammar import auto_call_spec
from k3.structured.bitmask import bitmask_width, unpack_bitmask

pytest.importorskip("xgrammar")

TOOLS = [
    {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}},
    {"name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number", "minimum": 0,
                                                                          "maximum": 9}, "maxItems": 3}},
        "required": ["xs"]}},
]


@pytest.fixture(scope="module")
def llm(tokenized_checkpoint):
    engine = k3.LLM(str(tokenized_checkpoint("k3-tiny")), dtype="float32", load_progress=False)
    yield engine
    engine.shutdown()


def _allowed(grammar, vocab_size) -> list[int]:
    host = torch.full((1, bitmask_width(vocab_size)), -1, dtype=torch.int32)
    grammar.fill(host, 0)
    return unpack_bitmask(host, vocab_size)[0].nonzero().flatten().tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_free_until_the_tools_channel_then_one_valid_call(llm, seed):
    tok, so = llm.get_tokenizer(), llm.engine.structured
    grammar = so.request_grammar(auto_call_spec(tok, TOOLS))
    enc = lambda text: tok.encode(text, allow_special=True)  # noqa: E731
    answer = enc("Let me check that.") + enc(RESPONSE_CLOSE) + enc(TOOLS_OPEN)
    for t in answer:                                   # free text: nothing is masked yet
        assert not grammar.active
        grammar.accept(t)
    assert grammar.active                              # the tools channel opened: the call is constrained
    rng, call = random.Random(seed), []
    for _ in range(400):
        allowed = _allowed(grammar, so.vocab_size)
        if set(allowed) <= set(so.stop_token_ids):
            break
        call.append(rng.choice(allowed))
        grammar.accept(call[-1])
    else:
        raise AssertionError("the call did not end within 400 tokens")
    assert grammar.rejected == 0
    parsed = parse_k3_output(tok.decode(answer + call, skip_special_tokens=False), thinking=False, tools=True)
    assert len(parsed.tool_calls) == 1, parsed
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), schemas[parsed.tool_calls[0].name])

