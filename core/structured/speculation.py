"""Structured outputs under speculative decoding (as vLLM does it, `k3.engine.spec.driver`).

Before a verify step, a constrained request's drafts are checked against its grammar and cut
at the first one it refuses (`grammar_valid_drafts`). While the verify forward runs, the
host fills one bitmask row per verified position (`fill_draft_rows`): position j's row is
what the grammar allows after the first j drafts, found by following the drafts and then
rolling the matcher back. The verify pass masks each position's logits with its row, so
acceptance and the token drawn after it see exactly the distribution the non-speculative
sampler would; after acceptance the grammar follows the kept tokens only (the engine
appends them one by one, `RequestGrammar.accept`).
"""

from __future__ import annotations

import torch

from .request_state import RequestGrammar, fill_rows, has_any


def grammar_valid_drafts(grammar: RequestGrammar, drafts: list[int]) -> int:
    """How many leading `drafts` the grammar allows in order (its state is unchanged after)."""
    saved = grammar.checkpoint()
    n = 0
    try:
        for token in drafts:
            if not grammar.accept_draft(token):
                break
            n += 1
    finally:
        grammar.restore(saved)
    return n


def fill_draft_rows(grammars: list[RequestGrammar], drafts: list[list[int]], bitmask: torch.Tensor,
                    first_rows: list[int]) -> None:
    """Rows first_rows[i] + j, j = 0..len(drafts[i]), of the int32 CPU bitmask: the tokens
    grammars[i] allows after drafts[i][:j] (the masks of a verify pass's 1 + k positions).

    Position-major: the j-th rows of every request are filled in one backend call, then each
    grammar follows its j-th draft. The rows after a draft that its own row refuses are left
    as they were (the caller's all-allowed -1: that draft is rejected with certainty, so
    nothing after it is read). The grammars' states are unchanged afterwards."""
    saved = [g.checkpoint() for g in grammars]
    try:
        live = list(range(len(grammars)))
        j = 0
        while live:
            fill_rows([grammars[i] for i in live], bitmask, [first_rows[i] + j for i in live])
            live = [i for i in live if j < len(drafts[i]) and has_any(bitmask, first_rows[i] + j, [drafts[i][j]])
                    and grammars[i].accept_draft(drafts[i][j])]
            j += 1
    finally:
        for g, s in zip(grammars, saved):
            g.restore(s)
