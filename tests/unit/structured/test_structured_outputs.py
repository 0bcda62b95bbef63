"""Structured outputs (issue 29): the bitmask, the per-request phases, the compile cache and
its time limit, and k3.LLM on random k3-tiny weights, whose every constrained output must
validate (jsonschema, re) and finish with finish_reason "stop"."""

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

import k3
from k3.structured import StructuredOutputError, StructuredOutputs, StructuredOutputsParams, unpack_bitmask
from k3.structured.backend import register_backend

pytest.importorskip("xgrammar")

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": S, "ok": {"type": "boolean"}}, "required": ["name", "ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": -5,
                                                                       "maximum": 5}, "maxItems": 4}},
     "required": ["xs"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"b": S, "c": {"type": "null"}},
                                                "required": ["b", "c"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, S]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}, "required": ["x"],
     "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b", 1, None]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 2},
                                      "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000}},
     "required": ["tags", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"const": {"const": "k3"}, "i": {"type": "integer", "minimum": 10,
                                                                     "maximum": 20}},
     "required": ["const", "i"], "additionalProperties": False},
    {"type": "object", "properties": {"pt": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0,
                                                                                "maximum": 9}, {"type": "boolean"}],
                                             "items": False}},
     "required": ["pt"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 30}},
     "required": ["kind", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"o": {"anyOf": [
        {"type": "object", "properties": {"t": {"const": "a"}}, "required": ["t"], "additionalProperties": False},
        {"type": "object", "properties": {"t": {"const": "b"}, "w": {"type": "boolean"}}, "required": ["t", "w"],
         "additionalProperties": False}]}}, "required": ["o"], "additionalProperties": False},
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{2,4}$"}},
     "required": ["word"], "additionalProperties": False},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"},
                                                                       "maxItems": 2}, "maxItems": 2}},
     "required": ["m"], "additionalProperties": False},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "note": S,
                                      "flag": {"type": "boolean"}},
     "required": ["id", "note", "flag"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1},
                                      "q": {"enum": [1, 2, 3]}},
     "required": ["p", "q"], "additionalProperties": False},
]
PER_SCHEMA = 2         # 40 requests here; bench/structured_output.py --validate runs 10 a schema (200)


@pytest.fixture(scope="module")
def llm(tokenized_checkpoint):
    return k3.LLM(str(tokenized_checkpoint("k3-tiny")), dtype="float32", kv_cache_memory_gib=0.05,
                  load_progress=False, max_num_seqs=64)


def test_unpack_bitmask_reads_bit_v_mod_32_of_word_v_div_32():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2 ** 31, 2 ** 31, (3, 5), dtype=torch.int64, generator=g).to(torch.int32)
    vocab = 150
    expected = torch.tensor([[(int(words[r, v // 32]) >> (v % 32)) & 1 for v in range(vocab)] for r in range(3)],
                            dtype=torch.bool)
    assert torch.equal(unpack_bitmask(words, vocab), expected)


def _allowed(mask_row: torch.Tensor, vocab: int) -> list[int]:
    return unpack_bitmask(mask_row[None], vocab)[0].nonzero().flatten().tolist()


def test_phases_trigger_prefix_grammar_suffix(llm):
    tok = llm.get_tokenizer()
    so: StructuredOutputs = llm.engine.structured
    stop = so.stop_token_ids
    spec = StructuredOutputsParams(choice=["ab"], trigger=(7, 8), prefix=(1, 2), suffix=(3, 4))
    g = so.request_grammar(spec)
    V = so.vocab_size
    mask = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for free in (9, 7, 8):                     # free text until the output ends with the trigger
        assert not g.active
        g.accept(free)
    produced = []
    for _ in range(12):
        g.fill(mask, 0)
        allowed = _allowed(mask[0], V)
        assert allowed, "no token allowed"
        token = allowed[0] if len(allowed) == 1 else min(allowed)
        produced.append(token)
        g.accept(token)
        if token in stop:
            break
    assert produced[:2] == [1, 2] and produced[-3:-1] == [3, 4] and produced[-1] in stop
    assert tok.decode(produced[2:-3]) == "ab" and g.rejected == 0
    assert all(tok.is_special(t) is False for t in produced[2:-3])   # special ids are never grammar text


def test_compile_cache_errors_and_time_limit(llm):
    so: StructuredOutputs = llm.engine.structured
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"z": {"type": "boolean"}}})
    so.compile(spec)
    hits = so.stats["cache_hits"]
    so.compile(StructuredOutputsParams(json=json.dumps(spec.json)))          # same schema as text: a hit
    assert so.stats["cache_hits"] == hits + 1
    with pytest.raises(StructuredOutputError, match="cannot be compiled"):
        so.compile(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(StructuredOutputError, match="cannot be compiled"):
        so.compile(StructuredOutputsParams(grammar="root ::= undefined_rule"))
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])

    release = threading.Event()

    class Slow:
        name = "slow"

        def __init__(self, vocab):
            pass

        def compile(self, spec):
            release.wait(5)
            return object()

        def matcher(self, compiled):
            raise AssertionError

    register_backend("slow-test", Slow)
    slow = StructuredOutputs(llm.get_tokenizer(), so.vocab_size, so.stop_token_ids, backend="slow-test",
                             compile_timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(StructuredOutputError, match="longer than 0.2 s"):
        slow.compile(StructuredOutputsParams(regex="a+"))
    assert time.monotonic() - start < 2
    release.set()
    slow.close()


def test_schema_requests_validate_and_stop(llm):
    params, schemas = [], []
    for i, schema in enumerate(SCHEMAS):
        for j in range(PER_SCHEMA):
            params.append(k3.SamplingParams(max_tokens=64, temperature=1.0, seed=100 * i + j,
                                            structured_outputs=k3.StructuredOutputsParams(json=schema)))
            schemas.append(schema)
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)        # strict JSON: no raw control characters
    assert len({o.outputs[0].text for o in outs}) > 10          # the draws differ: the mask is not a script


def test_regex_and_choice(llm):
    ps = [k3.SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured_outputs={"regex": r"[a-c]{2,4}-\d{2}"})
          for s in range(4)]
    ps += [k3.SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured_outputs={"choice": ["yes", "no", "maybe"]})
           for s in range(4)]
    outs = llm.generate(["Q:"] * len(ps), ps, use_tqdm=False)
    for o in outs[:4]:
        assert re.fullmatch(r"[a-c]{2,4}-\d{2}", o.outputs[0].text) and o.outputs[0].finish_reason == "stop"
    for o in outs[4:]:
        assert o.outputs[0].text in ("yes", "no", "maybe") and o.outputs[0].finish_reason == "stop"


def test_free_requests_keep_their_greedy_tokens_beside_constrained_ones(llm):
    prompts = ["Hello there", "One two three", "k3"]
    free = k3.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    constrained = k3.SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": SCHEMAS[1]})
    mixed = llm.generate([prompts[0], "x", prompts[1], "y", prompts[2]],
                         [free, constrained, free, constrained, free], use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3):
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMAS[1])


def test_a_steps_rows_filled_in_one_batch_equal_rows_filled_one_by_one(llm):
    """The runner fills every in-grammar row of a step in one backend call (xgrammar's batch
    filler, then the JSON keep mask and the exit-token swap per row): the step's bitmask equals
    each request's own fill, for grammars walked to random points (rows before the trigger, in
    forced prefixes and suffixes, mid-JSON, at a grammar's end) and rows without a grammar."""
    so: StructuredOutputs = llm.engine.structured
    V, stop = so.vocab_size, so.stop_token_ids
    rng = torch.Generator().manual_seed(5)
    specs = ([StructuredOutputsParams(json=s) for s in SCHEMAS[:8]]
             + [StructuredOutputsParams(regex="[a-c]{2,5}x", prefix=(1, 2), suffix=(3,)),
                StructuredOutputsParams(choice=["ab", "abc"], trigger=(7, 8)),
                StructuredOutputsParams(json=SCHEMAS[0], prefix=(5,), suffix=(6, 4))])
    grammars = []
    one = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for i, spec in enumerate(specs * 2):
        g = so.request_grammar(spec)
        for free in (7, 8) if spec.trigger and i % 2 else ():
            g.accept(free)
        for _ in range(int(torch.randint(0, 9, (1,), generator=rng))):
            if not g.active:
                break
            g.fill(one, 0)
            allowed = _allowed(one[0], V)
            token = allowed[int(torch.randint(len(allowed), (1,), generator=rng))]
            if token in stop:
                break
            g.accept(token)
        grammars.append(g)
    tok = llm.get_tokenizer()
    for spec, text in ((StructuredOutputsParams(json={"type": "string", "maxLength": 20}), '"a'),   # in a string:
                       (StructuredOutputsParams(choice=["ab"], suffix=(3, 4)), "ab")):      # control bytes cleared;
        g = so.request_grammar(spec)                                                        # at the end: exit swap
        for token in tok.encode(text):
            g.accept(token)
        assert g.rejected == 0 and g.grammar_matcher is not None
        grammars += [g, g]
    grammars[3:3] = [None, None]                               # unconstrained rows keep everything
    states = {type(g.grammar_matcher).__name__ if g and g.grammar_matcher else "outside" for g in grammars}
    assert states == {"XGrammarMatcher", "outside"}, states
    batched = llm.engine.runner._grammar_bitmask(grammars)
    for row, g in enumerate(grammars):
        if g is None or not g.active:
            assert (batched[row] == -1).all()
            continue
        one.fill_(0)
        g.fill(one, 0)
        assert torch.equal(batched[row], one[0]), row


def test_asynchronous_scheduling_runs_constrained_requests_with_the_same_outputs(tokenized_checkpoint, llm):
    """With asynchronous scheduling a constrained request's next step is launched before its
    tokens are read; only that step's sampling waits for the grammar (it accepts the running
    token first, then fills the bitmask). Outputs equal synchronous scheduling's exactly (greedy
    and seeded draws, constrained and free requests in one batch), every constrained output
    validates, and the lookahead ran."""
    async_llm = k3.LLM(str(tokenized_checkpoint("k3-tiny")), dtype="float32", kv_cache_memory_gib=0.05,
                       load_progress=False, max_num_seqs=64, async_scheduling=True)
    try:
        prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(6 + i)] for i in range(8)]
        params = [k3.SamplingParams(max_tokens=48, temperature=0 if i % 2 else 1.0, seed=i,
                                    structured_outputs={"json": SCHEMAS[i % 4]}) for i in range(6)]
        params += [k3.SamplingParams(max_tokens=12, temperature=0), k3.SamplingParams(max_tokens=12, seed=3)]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        sync = llm.generate(inputs, params, use_tqdm=False)
        before = async_llm.engine.num_lookahead_steps
        asyn = async_llm.generate(inputs, params, use_tqdm=False)
        assert async_llm.engine.num_lookahead_steps > before
    finally:
        async_llm.shutdown()
    for i, (a, b) in enumerate(zip(sync, asyn)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, i
        if i < 6:
            assert b.outputs[0].finish_reason == "stop", b.outputs[0]
            jsonschema.validate(json.loads(b.outputs[0].text), SCHEMAS[i % 4])
