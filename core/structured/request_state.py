"""RequestGrammar: one request's structured-output state between steps.

Free text until the output ends with the spec's `trigger` (when there is one), then the
segments in order (`k3.structured.program`): the `prefix` tokens, the grammar (or the
spec's sequence of forced runs and grammars), the `suffix` tokens, then only a stop token.
Where a grammar may end, the bitmask allows the stop ids; when forced tokens follow, those
bits move to the first of them instead, so the grammar ends by entering them. Forced tokens
go through the same bitmask (one bit set), so the sampler needs nothing else.
"""

from __future__ import annotations

import torch

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
        """Follow one sampled token."""
        token = int(token)
        if self.phase == "trigger":
            self.history.append(token)
            n = len(self.trigger)
            if len(self.history) >= n and tuple(self.history[-n:]) == self.trigger:
                self.phase = "run"
                self._advance()
            return
        seg = self.current
        if seg is None:
            if token not in self.stop_ids:
                self.rejected += 1
            return
        if isinstance(seg, Forced):
            if token != seg.ids[self._pos]:
                self.rejected += 1
            self._pos += 1
            if self._pos >= len(seg.ids):
                self._advance()
            return
        if token not in self.stop_ids and token == self._exit_token():
            self.queue = self._next_after_grammar()
            self._advance()
            self.accept(token)              # the first forced token of what follows
            return
        if not self._matcher.accept_token(token):
            self.rejected += 1
            return
        self._text += self.token_bytes[token]
        if self._matcher.is_terminated():
            self.current = None
