"""Segment programs: a structured output made of forced token runs and grammars in order.

`Forced(ids)` emits exactly those tokens; `Constrained(spec)` a text matching a grammar, and
when it has `branches`, the text it produced picks the segments that follow (a tool name
choosing that tool's arguments). A grammar segment is always followed by a forced one or is
the last: where its grammar may end, the next forced token takes the place of the stop ids.
This is how a K3 tool call is constrained: the XTML markers are special tokens that no
grammar text can spell, so they are forced between the grammars of the name and of each
argument value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Forced:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Constrained:
    spec: object                                               # StructuredOutputsParams (without a sequence)
    branches: tuple[tuple[str, tuple["Segment", ...]], ...] = ()


Segment = Union[Forced, Constrained]


def walk_specs(segments) -> list:
    """Every grammar spec of a program, branches included (what the server compiles first)."""
    out = []
    for seg in segments:
        if isinstance(seg, Constrained):
            out.append(seg.spec)
            for _, more in seg.branches:
                out += walk_specs(more)
    return out
