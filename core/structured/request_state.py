"""RequestGrammar: one request's structured-output state between steps.

Free text until the output ends with the spec's `trigger` (when there is one), then the
segments in order (`k3.structured.program`): the `prefix` tokens, the grammar (or the
spec's sequence of forced runs and grammars), the `suffix` tokens, then only a stop token.
Where a grammar may end, the bitmask allows the stop ids; when forced tokens follow, those
bits move to the first of them instead, so the grammar ends by entering them. Forced tokens
go through the same bitmask (one bit set), so the sampler needs nothing else.

Speculative decoding follows drafted tokens and undoes them: `checkpoint`, then
`accept_draft` per draft (False where the program refuses one), then `restore`, which rolls
the backend matcher back by the tokens it accepted (`GrammarMatcher.rollback`);
`k3.structured.speculation` builds the verify pass's bitmask rows this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import fill_bitmasks
from .program import Constrained, Forced


def _int32(value: int) -> int:
    return ((value + (1 << 31)) % (1 << 32)) - (1 << 31)


def set_only(bitmask: torch.Tensor, row: int, ids) -> None:
    """Row `row` of an int32 bitmask allows exactly `ids`."""
    bitmask[row].zero_()
    add_ids(bitmask, row, ids)


def add_ids(bitmask: torch.Tensor, row: int, ids) -> None:
    for t in ids:
        w = t // 32
        bitmask[row, w] = _int32(int(bitmask[row, w]) | (1 << (t % 32)))


def has_any(bitmask: torch.Tensor, row: int, ids) -> bool:
    return any((int(bitmask[row, t // 32]) >> (t % 32)) & 1 for t in ids)


def clear_ids(bitmask: torch.Tensor, row: int, ids) -> None:
    for t in ids:
        w = t // 32
        bitmask[row, w] = _int32(int(bitmask[row, w]) & ~(1 << (t % 32)))


class RequestGrammar:
    """One request's walk through its segment program (`k3.structured.program`).

    segments: the program (the spec's prefix, its grammar or sequence, its suffix); trigger:
    token ids the output must end with before the program starts (empty: at once);
    stop_token_ids: the ids that end the request; make_matcher(spec): a fresh matcher of a
    compiled spec; token_bytes[i]: the bytes of id i (a branch reads the text its grammar made).
    """

    def __init__(self, segments, trigger, stop_token_ids, make_matcher, token_bytes):
        self.queue = list(segments)
        self.trigger = tuple(trigger)
        self.stop_ids = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        self.make_matcher, self.token_bytes = make_matcher, token_bytes
        self.history: list[int] = []
        self.rejected = 0                   # tokens the program refused (a bug if ever non-zero)
        self.current = None
        self._pos = 0                       # next index into a Forced segment
        self._text = b""                    # what the current grammar segment produced
        self._matcher = None
        self._log: list | None = None       # matchers that accepted a token since `checkpoint`
        self.phase = "trigger" if self.trigger else "run"
        if not self.trigger:
            self._advance()

    def _advance(self) -> None:
        """Move to the next segment (None at the end)."""
        self.current = self.queue.pop(0) if self.queue else None
        self._pos, self._text, self._matcher = 0, b"", None
        if isinstance(self.current, Constrained):
            self._matcher = self.make_matcher(self.current.spec)
        elif isinstance(self.current, Forced) and not self.current.ids:
            self._advance()

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not before the trigger)."""
        return self.phase != "trigger"

    def _next_after_grammar(self) -> list:
        """The segments that follow the current grammar once it ends with its text so far."""
        seg = self.current
        if not seg.branches:
            return self.queue
        text = self._text.decode("utf-8", "replace")
        for key, more in seg.branches:
            if key == text:
                return list(more) + self.queue
        return self.queue

    def _exit_token(self) -> int | None:
        nxt = self._next_after_grammar()
        return nxt[0].ids[0] if nxt and isinstance(nxt[0], Forced) and nxt[0].ids else None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into row `row` of the int32 CPU bitmask."""
        matcher = self.grammar_matcher
        if matcher is None:
            self.fill_outside_grammar(bitmask, row)
        else:
            matcher.fill_bitmask(bitmask, row)
            self.finish_grammar_fill(bitmask, row)

    @property
    def grammar_matcher(self):
        """The backend matcher that fills this request's next row, or None when the next token
        is not the grammar's (before the trigger, in a forced segment, after the end). A step
        fills all such rows at once (`k3.structured.backend.fill_bitmasks`), then calls
        `finish_grammar_fill` for each; the other rows take `fill_outside_grammar`."""
        if self.phase == "trigger" or not isinstance(self.current, Constrained):
            return None
        return self._matcher

    def fill_outside_grammar(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` when `grammar_matcher` is None: everything before the trigger, the stop ids
        after the last segment, the next forced id inside a forced segment."""
        seg = self.current
        if self.phase == "trigger":
            bitmask[row].fill_(-1)
        elif seg is None:
            set_only(bitmask, row, self.stop_ids)
        else:
            set_only(bitmask, row, seg.ids[self._pos:self._pos + 1])

    def finish_grammar_fill(self, bitmask: torch.Tensor, row: int) -> None:
        """After the matcher filled row `row`: where the grammar may end and a forced segment
        follows, its first id replaces the stop ids."""
        if has_any(bitmask, row, self.stop_ids):
            exit_token = self._exit_token()
            if exit_token is not None:
                clear_ids(bitmask, row, self.stop_ids)
                add_ids(bitmask, row, [exit_token])

    def accept(self, token: int) -> None:
        """Follow one sampled token (the bitmask allowed it; a token the program refuses leaves
        the state as it was and counts in `rejected`)."""
        if not self._consume(int(token), check_end=False):
            self.rejected += 1

    def accept_draft(self, token: int) -> bool:
        """Follow one drafted token if the program allows it here (False: refused, state as it
        was). Unlike `accept`, nothing vouches for the token, so the end of a grammar is checked
        too: its exit token only where the grammar may end (one bitmask row, as the sampler's)."""
        return self._consume(int(token), check_end=True)

    def _consume(self, token: int, *, check_end: bool) -> bool:
        if self.phase == "trigger":
            self.history.append(token)
            n = len(self.trigger)
            if len(self.history) >= n and tuple(self.history[-n:]) == self.trigger:
                self.phase = "run"
                self._advance()
            return True
        seg = self.current
        if seg is None:
            return token in self.stop_ids
        if isinstance(seg, Forced):
            if token != seg.ids[self._pos]:
                return False
            self._pos += 1
            if self._pos >= len(seg.ids):
                self._advance()
            return True
        exit_token = self._exit_token()
        if token not in self.stop_ids and token == exit_token:
            if check_end and not self._may_end():
                return False
            self.queue = self._next_after_grammar()
            self._advance()
            return self._consume(token, check_end=check_end)     # the first forced token of what follows
        if token in self.stop_ids and exit_token is not None:
            return False                    # forced tokens follow: the stop ids are not allowed here
        if not self.token_bytes[token] and token not in self.stop_ids:
            return False                    # a special id: no grammar text (the backend is not asked)
        if not self._matcher.accept_token(token):
            return False
        if self._log is not None:
            self._log.append(self._matcher)
        self._text += self.token_bytes[token]
        if self._matcher.is_terminated():
            self.current = None
        return True

    def _may_end(self) -> bool:
        """Whether the current grammar may end here (its bitmask row allows the stop ids)."""
        row = torch.zeros(1, (len(self.token_bytes) + 31) // 32, dtype=torch.int32)
        self._matcher.fill_bitmask(row, 0)
        return has_any(row, 0, self.stop_ids)

    # ------------------------------------------------------------------ speculation
    def checkpoint(self) -> "_Saved":
        """The state to `restore` after following drafted tokens (speculative decoding): the
        tokens a matcher accepts from now on are logged, so restoring rolls them back."""
        self._log = []
        return _Saved(list(self.queue), self.current, self._pos, self._text, self._matcher, self.phase,
                      len(self.history))

    def restore(self, saved: "_Saved") -> None:
        """Back to `saved`: the matcher of that state rolls back the tokens it accepted since;
        matchers made since (later grammar segments) are dropped."""
        if saved.matcher is not None:
            saved.matcher.rollback(sum(m is saved.matcher for m in self._log))
        self._log = None
        self.queue, self.current, self._pos, self._text = saved.queue, saved.current, saved.pos, saved.text
        self._matcher, self.phase = saved.matcher, saved.phase
        del self.history[saved.history_len:]


@dataclass(frozen=True)
class _Saved:
    queue: list
    current: object
    pos: int
    text: bytes
    matcher: object
    phase: str
    history_len: int


def fill_rows(grammars: list, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Row rows[i] of the int32 CPU bitmask from grammars[i] (None or not yet active: left as it
    is); the rows inside a grammar are filled in one backend call (`fill_bitmasks`)."""
    in_grammar = []
    for row, g in zip(rows, grammars):
        if g is not None and g.active:
            if g.grammar_matcher is None:
                g.fill_outside_grammar(bitmask, row)
            else:
                in_grammar.append((row, g))
    if in_grammar:
        fill_bitmasks([g.grammar_matcher for _, g in in_grammar], bitmask, [row for row, _ in in_grammar])
        for row, g in in_grammar:
            g.finish_grammar_fill(bitmask, row)
