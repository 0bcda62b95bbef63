"""The second grammar backend, llguidance (issue 29: the backend interface holds for more than
xgrammar). Selected with vLLM's spellings (`--structured-outputs-config '{"backend":
"guidance"}'`, the older `--guided-decoding-backend`); on random k3-tiny weights a third of
the schema suite, a regex, a choice and tool_choice "required" all validate and stop. Rollback and
speculation with it are in test_grammar_speculation.py and tests/unit/spec/test_spec_structured.py."""

import json
import re

import jsonschema
import pytest

import k3
from k3.structured import StructuredOutputError, StructuredOutputsParams
from k3.structured.config import StructuredOutputsConfigError, parse_structured_outputs_config
from test_structured_outputs import SCHEMAS

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string", "maxLength": 4}}, "required": ["city"]}},
         {"name": "add", "parameters": {"type": "object", "properties": {"xs": {"type": "array", "items": {
             "type": "number", "minimum": 0, "maximum": 9}, "maxItems": 2}}, "required": ["xs"]}}]


@pytest.fixture(scope="module")
def llm(tokenized_checkpoint):
    pytest.importorskip("llguidance")
    engine = k3.LLM(str(tokenized_checkpoint("k3-tiny")), dtype="float32", kv_cache_memory_gib=0.05,
                    load_progress=False, max_num_seqs=32, structured_outputs_backend="guidance")
    yield engine
    engine.shutdown()


def test_vllm_spellings_pick_the_backend():
    assert parse_structured_outputs_config(None) == "xgrammar"
    assert parse_structured_outputs_config({"backend": "guidance"}) == "guidance"
    assert parse_structured_outputs_config({"backend": "auto", "disable_any_whitespace": True}) == "xgrammar"
    assert parse_structured_outputs_config(None, "llguidance") == "llguidance"
    for value, older, problem in [({"backend": "outlines"}, None, "not implemented"),
                                  ({"backend": "nope"}, None, "unknown backend"),
                                  ({"disable_any_whitespace": False}, None, "compact"),
                                  ({"reasoning_parser": "x"}, None, "--reasoning-parser"),
                                  ({"whitespace": 1}, None, "'whitespace' is not implemented"),
                                  ([1], None, "JSON object"),
                                  ({"backend": "guidance"}, "xgrammar", "not both")]:
        with pytest.raises(StructuredOutputsConfigError, match=re.escape(problem)):
            parse_structured_outputs_config(value, older)


def test_schemas_regex_and_choice_validate_and_stop(llm):
    from k3.structured.llguidance_backend import LLGuidanceBackend

    assert isinstance(llm.engine.structured.backend, LLGuidanceBackend)
    schemas = SCHEMAS[::3]
    params = [k3.SamplingParams(max_tokens=64, temperature=1.0, seed=i, structured_outputs={"json": s})
              for i, s in enumerate(schemas)]
    params += [k3.SamplingParams(max_tokens=20, temperature=1.0, seed=1, structured_outputs={"regex": r"[a-c]{2,4}-\d{2}"}),
               k3.SamplingParams(max_tokens=20, temperature=1.0, seed=2, structured_outputs={"choice": ["yes", "no"]})]
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert re.fullmatch(r"[a-c]{2,4}-\d{2}", outs[-2].outputs[0].text) and outs[-2].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].text in ("yes", "no") and outs[-1].outputs[0].finish_reason == "stop"


def test_tool_choice_required_yields_a_valid_call(llm):
    """The tool-call program (forced XTML markers, the tool-name choice picking that tool's
    argument grammars) on llguidance: the K3 parser reads one call whose arguments validate."""
    from k3.chat.parse_k3 import parse_k3_output
    from k3.serve.tool_grammar import tool_call_spec

    tok = llm.get_tokenizer()
    spec = tool_call_spec(tok, TOOLS, "required", thinking=False)
    params = [k3.SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs=spec,
                                skip_special_tokens=False) for s in range(2)]
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    for out in llm.generate(["Weather or sum?"] * len(params), params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        parsed = parse_k3_output(tok.decode(c.token_ids, skip_special_tokens=False), thinking=False, tools=True)
        assert len(parsed.tool_calls) == 1, c.text
        jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), schemas[parsed.tool_calls[0].name])


def test_constraints_it_cannot_compile_are_errors(llm):
    so = llm.engine.structured
    for spec in (StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(grammar="root ::= undefined_rule"),
                 StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}})):
        with pytest.raises(StructuredOutputError, match="cannot be compiled"):
            so.compile(spec)
