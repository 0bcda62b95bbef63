"""Streaming parsers for K3 XTML output: reasoning, content and tool calls.

The model's output continues the generation prefix the renderer wrote, so in thinking mode it
starts inside the ``think`` channel and in instruct mode inside ``response``::

    REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>ARGUMENTS<|close|>call<|sep|>...
    <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

Rules (vLLM ``kimi_k3`` behaviour, plus "nothing is lost"):

* Reasoning starts at offset 0 when the generation prefix opened ``think``
  (``starts_in_reasoning``, default = ``thinking``); a ``<|open|>think<|sep|>`` echoed at offset 0
  is dropped. Otherwise it starts at a ``<|open|>think<|sep|>`` at offset 0. It ends at the first
  ``<|close|>think<|sep|>``; a ``<|open|>response<|sep|>`` at offset 0 means the model skipped
  thinking. Output that never closes ``think`` is all reasoning. Later think markers are text.
* Content is everything after reasoning with the ``response`` open/close, ``<|close|>message<|sep|>``
  and ``<|end_of_msg|>`` wrappers removed; it streams up to any complete or partial marker.
* With ``tools=True`` a ``tools`` channel is parsed: each ``call`` is emitted as a
  :class:`ToolCall` once its ``<|close|>call<|sep|>`` is seen. A malformed call (see
  :mod:`k3.chat.calls`), a call cut off by the end of the output or by another structural marker,
  and non-blank text between calls all become content, verbatim; blank gaps between calls are
  dropped. So content + the text of unparsed calls == the input minus well-formed structure.
* Known limitation (as in vLLM): string values and the response are raw text, so a value that
  contains a literal ``<|close|>argument<|sep|>`` or ``<|close|>call<|sep|>`` ends early; the call
  then no longer parses and is passed on as content.

Streaming and non-streaming agree for every split of the text (:meth:`K3OutputParser.parse` is
``feed(text) + finish()`` on a fresh parser, and every decision depends only on the text).
"""

from __future__ import annotations

from typing import Sequence

from k3.chat.calls import decode_call
from k3.chat.events import ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCall, coalesce
from k3.chat.lexer import Marker, XtmlLexer
from k3.chat.xtml import THINK_CLOSE, THINK_OPEN

_REASONING, _CONTENT, _TOOLS, _CALL = "reasoning", "content", "tools", "call"
_WRAPPERS = (("open", "response"), ("close", "response"), ("close", "message"), ("eom", ""))


class K3OutputParser:
    """Per-request parser of one K3 output. ``feed(delta)`` -> events, ``finish()`` -> events.

    ``thinking``: the request's thinking mode (False: no reasoning at all, think markers are text).
    ``tools``: parse the ``tools`` channel (False: it stays in the content as text, as in vLLM
    without tools). ``starts_in_reasoning``: the prompt ended inside ``think`` (default: ``thinking``;
    see :func:`is_reasoning_end` to decide it from a prompt). ``strip_wrappers``: drop the
    response/message wrappers from content (False passes them on, to chain into a K3ToolParser).
    ``call_id_prefix``: tool-call ids are ``f"{prefix}{index}"``; pass a per-request prefix when ids
    must be unique across a conversation.
    """

    def __init__(
        self,
        *,
        thinking: bool = True,
        tools: bool = True,
        starts_in_reasoning: bool | None = None,
        strip_wrappers: bool = True,
        call_id_prefix: str = "call_",
    ) -> None:
        self._options = dict(
            thinking=thinking, tools=tools, starts_in_reasoning=starts_in_reasoning,
            strip_wrappers=strip_wrappers, call_id_prefix=call_id_prefix,
        )
        self.thinking, self.tools, self.strip_wrappers = thinking, tools, strip_wrappers
        self.call_id_prefix = call_id_prefix
        in_think = thinking and starts_in_reasoning is not False
        self._state = _REASONING if in_think else _CONTENT
        self._at_start = True
        self._lexer = XtmlLexer()
        self._gap = ""  # text between structural tokens inside the tools channel
        self._call_head: Marker | None = None
        self._call_body: list[str | Marker] = []
        self._n_calls = 0
        self._done = False

    # -- public API ---------------------------------------------------------------------------
    def feed(self, delta: str) -> list[Event]:
        """Events decidable after ``delta``; text that may still be part of a marker is held."""
        if self._done:
            raise RuntimeError("feed() after finish()")
        return coalesce(self._run(self._lexer.feed(delta)))

    def finish(self) -> list[Event]:
        """End of output: flush held text; an unfinished call or non-blank gap becomes content."""
        if self._done:
            return []
        events = self._run(self._lexer.finish())
        if self._state == _CALL:
            events.append(self._degrade())
        if self._state == _TOOLS and self._gap.strip():
            events.append(ContentDelta(self._gap))
        self._gap, self._done = "", True
        return coalesce(events)

    def parse(self, text: str) -> ParsedOutput:
        """Non-streaming: the whole output at once (a fresh parser with these options)."""
        fresh = type(self).__new__(type(self))
        K3OutputParser.__init__(fresh, **self._options)
        return ParsedOutput().add(fresh.feed(text) + fresh.finish())

    # -- state machine ------------------------------------------------------------------------
    def _run(self, tokens: list[str | Marker]) -> list[Event]:
        out: list[Event] = []
        for tok in tokens:
            getattr(self, "_on_" + self._state)(tok, out)
            self._at_start = False
        return out

    def _on_reasoning(self, tok: str | Marker, out: list[Event]) -> None:
        if isinstance(tok, str):
            out.append(ReasoningDelta(tok))
        elif tok.is_("close", "think"):
            self._state = _CONTENT
        elif self._at_start and tok.is_("open", "think"):
            pass  # the model echoed the generation prefix
        elif self._at_start and tok.is_("open", "response"):
            self._state = _CONTENT  # the model skipped thinking
            if not self.strip_wrappers:
                out.append(ContentDelta(tok.raw))
        elif tok.kind != "eom":
            out.append(ReasoningDelta(tok.raw))

    def _on_content(self, tok: str | Marker, out: list[Event]) -> None:
        if isinstance(tok, str):
            out.append(ContentDelta(tok))
        elif self.thinking and self._at_start and tok.is_("open", "think"):
            self._state = _REASONING
        elif self.tools and tok.is_("open", "tools"):
            self._state = _TOOLS
        elif not (self.strip_wrappers and (tok.kind, tok.name) in _WRAPPERS):
            out.append(ContentDelta(tok.raw))

    def _on_tools(self, tok: str | Marker, out: list[Event]) -> None:
        if isinstance(tok, str):
            self._gap += tok
            return
        structural = tok.is_("open", "call") or tok.is_("close", "tools") or tok.is_("close", "message")
        if not (structural or tok.kind == "eom"):
            self._gap += tok.raw  # unknown marker between calls: text
            return
        if self._gap.strip():
            out.append(ContentDelta(self._gap))
        self._gap = ""
        if tok.is_("open", "call"):
            self._state, self._call_head, self._call_body = _CALL, tok, []
        else:  # tools closed (or the message ended without closing it)
            self._state = _CONTENT
            if tok.kind != "close" or tok.name != "tools":
                self._on_content(tok, out)

    def _on_call(self, tok: str | Marker, out: list[Event]) -> None:
        if isinstance(tok, str) or not (
            tok.kind == "eom" or tok.is_("close", "call") or tok.is_("open", "call")
            or tok.is_("close", "tools") or tok.is_("close", "message")
        ):
            self._call_body.append(tok)
            return
        if tok.is_("close", "call"):
            decoded = decode_call(self._call_head, self._call_body)
            if decoded is None:
                self._call_body.append(tok)
                out.append(self._degrade())
            else:
                index = self._n_calls
                self._n_calls += 1
                out.append(ToolCall(index, f"{self.call_id_prefix}{index}", *decoded))
            self._state = _TOOLS
            return
        out.append(self._degrade())  # cut off by the next call or the end of the channel
        self._state = _TOOLS
        self._on_tools(tok, out)

    def _degrade(self) -> ContentDelta:
        raw = self._call_head.raw + "".join(t if isinstance(t, str) else t.raw for t in self._call_body)
        self._call_head, self._call_body = None, []
        return ContentDelta(raw)


class K3ReasoningParser(K3OutputParser):
    """Splits reasoning from content, without tool parsing (vLLM ``kimi_k3`` reasoning parser).

    ``strip_wrappers=False`` keeps the response/message/tools markers in the content so it can be
    fed to a :class:`K3ToolParser`; that chain gives the same result as one K3OutputParser.
    """

    def __init__(self, *, thinking: bool = True, starts_in_reasoning: bool | None = None,
                 strip_wrappers: bool = True) -> None:
        super().__init__(thinking=thinking, tools=False, starts_in_reasoning=starts_in_reasoning,
                         strip_wrappers=strip_wrappers)


class K3ToolParser(K3OutputParser):
    """Content and tool calls of output that has no reasoning part (instruct mode, or the content
    a K3ReasoningParser passed on) (vLLM ``kimi_k3`` tool parser)."""

    def __init__(self, *, call_id_prefix: str = "call_") -> None:
        super().__init__(thinking=False, tools=True, call_id_prefix=call_id_prefix)


def parse_k3_output(text: str, **options) -> ParsedOutput:
    """Non-streaming parse of a whole output; ``options`` as for :class:`K3OutputParser`."""
    return K3OutputParser(**options).parse(text)


def is_reasoning_end(seq: str | Sequence[int], think_open: str | Sequence[int] = THINK_OPEN,
                     think_close: str | Sequence[int] = THINK_CLOSE) -> bool:
    """True when the LAST think-close marker comes after the LAST think-open marker.

    Works on text (markers as strings) or on token ids (pass the markers' id sequences). Applied
    to a prompt (history keeps earlier think channels) it says whether generation starts outside
    reasoning: ``starts_in_reasoning = thinking and not is_reasoning_end(prompt)``.
    """
    return _last_index(seq, think_close) > _last_index(seq, think_open)


def _last_index(seq: str | Sequence[int], needle: str | Sequence[int]) -> int:
    if isinstance(seq, str):
        return seq.rfind(needle)
    seq, needle = list(seq), list(needle)
    for i in range(len(seq) - len(needle), -1, -1):
        if seq[i : i + len(needle)] == needle:
            return i
    return -1
