"""Speculative decoding with structured outputs (issue 29): constrained requests are drafted
for, their drafts cut where the grammar refuses them, and the verify pass masks each position
with the grammar after the drafts before it. Greedy outputs equal non-speculative constrained
decoding token for token (float64, random k3-tiny weights), with n-gram and draft-model
drafts, in batches mixing JSON, regex, tool-call and free requests, with prefix caching on;
sampled constrained outputs validate and stop. A run with the verify mask removed differs:
the equality checks would catch it."""

import json

import jsonschema
import pytest

import k3

pytest.importorskip("xgrammar")

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "ok": {"type": "boolean"}}, "required": ["name", "ok"],
     "additionalProperties": False},
    {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": -5,
                                                                       "maximum": 5}, "maxItems": 4}},
     "required": ["xs"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 30}},
     "required": ["kind", "age"], "additionalProperties": False},
]
TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": S},
                                                "required": ["city"], "additionalProperties": False}},
         {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
                                        "required": ["a"], "additionalProperties": False}}]
# prompts that repeat the shapes the constraints produce, so n-gram lookups find drafts
PROMPT = '["alpha","beta","alpha"] {"name":"ab","ok":true} {"xs":[1,2]} {"kind":"cat","age":3} {"name":"ab","ok":true}'
GREEDY = dict(max_tokens=40, temperature=0)


@pytest.fixture(scope="module")
def path(tokenized_checkpoint):
    return str(tokenized_checkpoint("k3-tiny"))


def _llm(path, spec=None, backend="xgrammar", **kw):
    return k3.LLM(path, dtype="float64", kv_cache_memory_gib=0.03, load_progress=False, max_num_seqs=8,
                  speculative_config=spec, structured_outputs_backend=backend, **kw)


def _workload(tokenizer):
    """(prompts, params): four JSON schemas, a broad regex, a tool call under tool_choice
    required, a free greedy request and a penalised one (never drafted for)."""
    from k3.serve.tool_grammar import tool_call_spec

    tool = tool_call_spec(tokenizer, TOOLS, "required", thinking=False)
    params = [k3.SamplingParams(**GREEDY, structured_outputs={"json": s}) for s in SCHEMAS]
    params += [k3.SamplingParams(**GREEDY, structured_outputs={"regex": r"[\s\S]{1,12}"}),
               k3.SamplingParams(**GREEDY, structured_outputs=tool),
               k3.SamplingParams(max_tokens=16, temperature=0),
               k3.SamplingParams(max_tokens=16, temperature=0, presence_penalty=0.5)]
    prompts = [PROMPT + f" {i}" for i in range(len(params))]
    return prompts, params


def _tokens(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        if p.structured_outputs is not None and p.structured_outputs.json is not None:
            c = out.outputs[0]
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    return [o.outputs[0].token_ids for o in outs]


def _baseline(path, backend):
    llm = _llm(path, backend=backend)
    prompts, params = _workload(llm.get_tokenizer())
    return _tokens(llm, prompts, params)


@pytest.fixture(scope="module")
def baseline(path):
    return _baseline(path, "xgrammar")


@pytest.mark.parametrize("rollback,backend", [("states", "xgrammar"), ("recover", "xgrammar"), ("states", "guidance")])
def test_ngram_drafts_keep_constrained_greedy_outputs(path, baseline, rollback, backend):
    """Both rollbacks; llguidance as the grammar backend too (its own plain baseline: the two
    backends' grammars need not allow the same token paths)."""
    if backend != "xgrammar":
        pytest.importorskip("llguidance")
        baseline = _baseline(path, backend)
    llm = _llm(path, {"method": "ngram", "num_speculative_tokens": 3, "kda_rollback": rollback}, backend)
    prompts, params = _workload(llm.get_tokenizer())
    assert _tokens(llm, prompts, params) == baseline
    stats = llm.engine.spec_stats()
    assert stats["spec_accepted_tokens_total"] > 0 and stats["spec_grammar_refused_drafts_total"] > 0, stats


def test_draft_model_drafts_keep_constrained_greedy_outputs_and_need_the_verify_mask(path, baseline, monkeypatch):
    """The target as its own draft: its drafts are the unmasked argmax, accepted wherever the
    grammar allows them and cut where it does not; the token after them is the masked argmax.
    Without the verify mask (acceptance on raw logits) the outputs change."""
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    llm = _llm(path, spec)
    prompts, params = _workload(llm.get_tokenizer())
    some = [0, 3, 4, 5, 6]                 # JSON, the regex, the tool call, a free request
    prompts, params, expected = [prompts[i] for i in some], [params[i] for i in some], [baseline[i] for i in some]
    assert _tokens(llm, prompts, params) == expected
    stats = llm.engine.spec_stats()
    assert stats["spec_accepted_tokens_total"] > 0 and stats["spec_grammar_refused_drafts_total"] > 0, stats

    from k3.engine.spec.driver import SpeculativeStep

    monkeypatch.setattr(SpeculativeStep, "grammar_masks", lambda self, out: {})
    unmasked = _llm(path, spec)
    outs = unmasked.generate(prompts[:3], params[:3], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != expected[:3]


def test_sampled_constrained_outputs_with_probabilistic_drafts_validate(path):
    """Sampled drafts from a draft model: a refused draft is verified as the last one (rejected
    for certain, the residual drawn), so verify steps happen even where every draft is refused;
    every output validates and stops; free sampled requests share the batch."""
    llm = _llm(path, {"method": "draft_model", "model": path, "num_speculative_tokens": 2,
                      "draft_sample_method": "probabilistic"})
    params = [k3.SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs={"json": SCHEMAS[i % 4]})
              for i in range(4)]
    params += [k3.SamplingParams(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True)]
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for out, p in zip(outs[:4], params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    assert len(outs[4].outputs[0].token_ids) == 8
    stats = llm.engine.spec_stats()
    assert stats["spec_verify_steps_total"] > 0 and stats["spec_grammar_refused_drafts_total"] > 0, stats


def test_ngram_drafts_with_prefix_caching(path, baseline):
    """Prefix caching on: a second round of the same requests hits the first round's cached
    prefix and still decodes the same tokens under speculation."""
    llm = _llm(path, {"method": "ngram", "num_speculative_tokens": 3}, enable_prefix_caching=True, block_size=64,
               prefix_match_unit=16, kda_checkpoint_interval=16)
    prompts, params = _workload(llm.get_tokenizer())
    assert _tokens(llm, prompts, params) == baseline
    assert _tokens(llm, prompts, params) == baseline
    assert llm.stats()["prefix_cache_reused_tokens_total"] > 0
    assert llm.engine.spec_stats()["spec_accepted_tokens_total"] > 0
