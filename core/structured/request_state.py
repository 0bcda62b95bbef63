"""RequestGrammar: one request's structured-output state between steps.

The output is split into phases: free text until the output ends with `spec.trigger` (when
there is one), then the `spec.prefix` tokens one by one, then the grammar, then the
`spec.suffix` tokens, then only a stop token. Where the grammar may end, the bitmask allows
the stop ids; with a suffix, those bits move to the suffix's first token instead, so the
grammar ends by entering the suffix. Forced tokens go through the same bitmask (one bit set),
so the sampler needs nothing else.
"""

from __future__ import annotations

import torch

from .backend import GrammarMatcher
from .spec import StructuredOutputsParams


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
    """stop_token_ids: the ids that end the request (EOS, end-of-message)."""

    def __init__(self, matcher: GrammarMatcher, spec: StructuredOutputsParams, stop_token_ids):
        self.matcher, self.spec = matcher, spec
        self.stop_ids = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        self.forced: list[int] = []
        self.history: list[int] = []
        self.rejected = 0                   # tokens the grammar refused (a bug if ever non-zero)
        if spec.trigger:
            self.phase = "trigger"
        else:
            self._start()

    def _start(self) -> None:
        self.forced = list(self.spec.prefix)
        self.phase = "prefix" if self.forced else "grammar"

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not before the trigger)."""
        return self.phase != "trigger"

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into row `row` of the int32 CPU bitmask."""
        if self.phase in ("prefix", "suffix"):
            set_only(bitmask, row, self.forced[:1])
        elif self.phase == "end":
            set_only(bitmask, row, self.stop_ids)
        elif self.phase == "grammar":
            self.matcher.fill_bitmask(bitmask, row)
            if self.spec.suffix and has_any(bitmask, row, self.stop_ids):
                clear_ids(bitmask, row, self.stop_ids)
                add_ids(bitmask, row, self.spec.suffix[:1])
        else:
            bitmask[row].fill_(-1)

    def accept(self, token: int) -> None:
        """Follow one sampled token."""
        token = int(token)
        if self.phase == "trigger":
            self.history.append(token)
            n = len(self.spec.trigger)
            if len(self.history) >= n and tuple(self.history[-n:]) == self.spec.trigger:
                self._start()
            return
        if self.phase in ("prefix", "suffix"):
            if self.forced and token == self.forced[0]:
                self.forced.pop(0)
            else:
                self.rejected += 1
            if not self.forced:
                self.phase = "grammar" if self.phase == "prefix" else "end"
            return
        if self.phase == "grammar":
            if self.spec.suffix and token == self.spec.suffix[0]:
                self.forced = list(self.spec.suffix[1:])
                self.phase = "suffix" if self.forced else "end"
                return
            if not self.matcher.accept_token(token):
                self.rejected += 1
            elif self.matcher.is_terminated():
                self.phase = "done"
            return
        if self.phase == "end" and token not in self.stop_ids:
            self.rejected += 1
