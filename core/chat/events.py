"""What the output parsers emit: streaming events and the accumulated result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Union


@dataclass(frozen=True)
class ReasoningDelta:
    """More text of the ``think`` channel (``reasoning_content`` in the OpenAI API)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """More user-visible text (the unwrapped ``response`` channel, plus anything that did not
    parse as structure: nothing the model wrote is dropped)."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call, emitted once its ``<|close|>call<|sep|>`` has been seen.

    ``index`` counts calls in this output from 0 (the OpenAI streaming ``tool_calls[].index``);
    ``arguments`` is a JSON object as a string, rebuilt from the typed ``argument`` blocks.
    """

    index: int
    id: str
    name: str
    arguments: str


Event = Union[ReasoningDelta, ContentDelta, ToolCall]


@dataclass
class ParsedOutput:
    """An output split into its parts; empty strings where a part is absent."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: Iterable[Event]) -> "ParsedOutput":
        """Accumulate streamed events (returns self)."""
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                self.reasoning += ev.text
            elif isinstance(ev, ContentDelta):
                self.content += ev.text
            else:
                self.tool_calls.append(ev)
        return self

    def to_message(self) -> dict:
        """The OpenAI assistant message: ``content`` is None when empty, ``reasoning_content``
        and ``tool_calls`` only when present. Feeding it back to the renderer reproduces the turn."""
        msg: dict = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg


def coalesce(events: list[Event]) -> list[Event]:
    """Merge neighbouring deltas of the same kind (fewer, larger stream chunks)."""
    out: list[Event] = []
    for ev in events:
        if out and type(ev) is type(out[-1]) and isinstance(ev, (ReasoningDelta, ContentDelta)):
            out[-1] = type(ev)(out[-1].text + ev.text)
        elif not isinstance(ev, (ReasoningDelta, ContentDelta)) or ev.text:
            out.append(ev)
    return out
