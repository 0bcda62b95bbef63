"""Grammars under speculative decoding (issue 29): following drafted tokens and rolling them
back leaves a request's grammar exactly where it was, across every kind of segment (the
trigger, forced runs, a tool-name choice whose branch picks the arguments, JSON values, the
end); drafts are cut at the first refused token (a special id, a token outside the grammar,
a grammar's exit before it may end); the verify rows equal fresh grammars' fills after each
draft prefix. Each test runs with xgrammar and with llguidance."""

import pytest
import torch

import k3
from k3.structured import StructuredOutputs, StructuredOutputsParams, unpack_bitmask
from k3.structured.speculation import fill_draft_rows, grammar_valid_drafts

pytest.importorskip("xgrammar")

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string", "maxLength": 5}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"], "additionalProperties": False}},
         {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9,
                                                                               "minimum": 0}},
                                        "required": ["a"], "additionalProperties": False}}]


@pytest.fixture(scope="module")
def engine_so(tokenized_checkpoint) -> StructuredOutputs:
    llm = k3.LLM(str(tokenized_checkpoint("k3-tiny")), dtype="float32", kv_cache_memory_gib=0.02,
                 load_progress=False, max_num_seqs=4)
    return llm.engine.structured


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def so(request, engine_so) -> StructuredOutputs:
    """The engine's grammars with each backend: the matcher contract (accept, refuse without a
    change, roll back, terminate) is what these tests exercise."""
    if request.param == "xgrammar":
        return engine_so
    pytest.importorskip("llguidance")
    return StructuredOutputs(engine_so.tokenizer, engine_so.vocab_size, engine_so.stop_token_ids,
                             backend=request.param)


def _specs(so):
    from k3.chat.xtml import THINK_CLOSE
    from k3.serve.tool_grammar import tool_call_spec

    tok = so.tokenizer
    return {"tool": (tool_call_spec(tok, TOOLS, "required", thinking=True),
                     tok.encode("hmm", allow_special=True) + tok.encode(THINK_CLOSE, allow_special=True)),
            "json": (StructuredOutputsParams(json={"type": "object", "properties": {
                "x": {"type": "array", "items": {"enum": ["ab", "c"]}, "maxItems": 3}}, "required": ["x"],
                "additionalProperties": False}, prefix=(5, 6), suffix=(7,)), []),
            "choice": (StructuredOutputsParams(choice=["abc", "ab"], suffix=(3, 4)), [])}


def _row(g, width) -> torch.Tensor:
    row = torch.zeros(1, width, dtype=torch.int32)
    g.fill(row, 0)
    return row[0]


def _walk(so, spec, head, rng, steps=600) -> list[int]:
    """A token path through `spec`'s program: `head` (free text to the trigger), then random
    allowed tokens up to and including a stop id."""
    g = so.request_grammar(spec)
    width = (so.vocab_size + 31) // 32
    path = list(head)
    for t in head:
        g.accept(t)
    for _ in range(steps):
        allowed = unpack_bitmask(_row(g, width)[None], so.vocab_size)[0].nonzero().flatten().tolist()
        token = allowed[int(torch.randint(len(allowed), (1,), generator=rng))]
        path.append(token)
        g.accept(token)
        if token in so.stop_token_ids:
            break
    assert g.rejected == 0 and path[-1] in so.stop_token_ids
    return path


@pytest.mark.parametrize("name", ["tool", "json", "choice"])
def test_drafts_roll_back_to_the_same_state_across_segments(so, name):
    """At every point of a full path, following up to 5 drafted tokens (the path's own next
    tokens, then a refused one) and restoring gives the bitmask row from before, and the walk
    then goes on as a grammar that never speculated (same rows to the end)."""
    spec, head = _specs(so)[name]
    rng = torch.Generator().manual_seed(3)
    path = _walk(so, spec, head, rng)
    width = (so.vocab_size + 31) // 32
    spec_g, plain_g = so.request_grammar(spec), so.request_grammar(spec)
    for pos, token in enumerate(path):
        before = _row(spec_g, width)
        saved = spec_g.checkpoint()
        for t in path[pos:pos + 5]:
            if not spec_g.accept_draft(t):
                break
        spec_g.accept_draft(so.tokenizer.vocab_size - 1)          # a special id: refused, nothing changes
        spec_g.restore(saved)
        assert torch.equal(_row(spec_g, width), before), pos
        assert torch.equal(before, _row(plain_g, width)), pos
        spec_g.accept(token)
        plain_g.accept(token)
    assert spec_g.rejected == plain_g.rejected == 0 and spec_g.current is None


def test_drafts_are_cut_at_the_first_refused_token(so):
    specs = _specs(so)
    rng = torch.Generator().manual_seed(4)
    for name, (spec, head) in specs.items():
        path = _walk(so, spec, head, rng)
        g = so.request_grammar(spec)
        assert grammar_valid_drafts(g, path) == len(path), name
        special = next(t for t in range(so.tokenizer.vocab_size) if so.tokenizer.is_special(t)
                       and t not in so.stop_token_ids and t not in path)
        cut = len(head) + 3                                       # inside the program (free text before it)
        assert grammar_valid_drafts(g, path[:cut] + [special] + path[cut:]) == cut, name
        assert grammar_valid_drafts(g, path + [path[-2]]) == len(path), name    # after the end: only a stop
    tok = so.tokenizer
    g = so.request_grammar(specs["choice"][0])
    # "ab" then the suffix's first marker: fine ("ab" is a choice); "a" then the marker: the
    # grammar may not end there, so the exit is refused (the sampler's bitmask would refuse it)
    assert grammar_valid_drafts(g, tok.encode("ab") + [3, 4, so.stop_token_ids[0]]) == len(tok.encode("ab")) + 3
    assert grammar_valid_drafts(g, tok.encode("a") + [3]) == len(tok.encode("a"))
    assert grammar_valid_drafts(g, tok.encode("ab") + [so.stop_token_ids[0]]) == len(tok.encode("ab"))
    # a raw control byte inside a JSON string: the bitmask never allows it (JSON forbids it), so
    # neither may a draft
    control = next(i for i in range(tok.vocab_size) if not tok.is_special(i) and tok.token_bytes(i) == b"\x01")
    g = so.request_grammar(StructuredOutputsParams(json={"type": "string", "maxLength": 20}))
    assert grammar_valid_drafts(g, tok.encode('"a') + [control]) == len(tok.encode('"a'))


def test_verify_rows_equal_fresh_fills_after_each_draft_prefix(so):
    """fill_draft_rows: row j of a request is what its grammar allows after its first j
    drafts (checked against a fresh grammar driven there); after a refused draft the rows
    stay all-allowed; the grammars end where they began."""
    specs = _specs(so)
    rng = torch.Generator().manual_seed(5)
    width = (so.vocab_size + 31) // 32
    grammars, drafts, starts = [], [], []
    for i, (name, (spec, head)) in enumerate(list(specs.items()) * 2):
        path = _walk(so, spec, head, rng)
        cut = int(torch.randint(0, len(path) - 2, (1,), generator=rng))
        g = so.request_grammar(spec)
        for t in path[:cut]:
            g.accept(t)
        d = path[cut: cut + 4]
        if i >= 3:                                            # the second copy: a refused draft inside
            d = d[:1] + [so.tokenizer.vocab_size - 1] + d[1:]
        grammars.append(g)
        drafts.append(d)
        starts.append((spec, path[:cut]))
    first = [0]
    for d in drafts:
        first.append(first[-1] + len(d) + 1)
    host = torch.full((first[-1], width), -1, dtype=torch.int32)
    before = [_row(g, width) for g in grammars]
    fill_draft_rows(grammars, drafts, host, first[:-1])
    for i, (g, d) in enumerate(zip(grammars, drafts)):
        assert torch.equal(_row(g, width), before[i])
        spec, prefix = starts[i]
        fresh = so.request_grammar(spec)
        for t in prefix:
            fresh.accept(t)
        refused = False
        for j in range(len(d) + 1):
            row = host[first[i] + j]
            if refused:
                assert (row == -1).all(), (i, j)
                continue
            assert torch.equal(row, _row(fresh, width)), (i, j)
            if j < len(d):
                refused = not fresh.accept_draft(d[j])
        assert refused == (i >= 3), i
