"""The argument parser of every `k3` command: no abbreviations, and errors that help.

`K3ArgumentParser` refuses abbreviated long options (`--max-model` is not `--max-model-len`),
reports an unknown option with the usage of the subcommand it was given to (not the top-level
`k3` usage), and adds "did you mean" hints for unknown options, subcommands and choices. A
parser's `refused_options` ({flag: reason}) answers flags it knows but does not implement (vLLM's
that k3 has no counterpart of) with the reason instead.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

_ARGV: list[str] = []          # the command line being parsed (for hints in errors of subparsers)
_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<value>[^']*)' \(choose from (?P<choices>.*)\)")


def did_you_mean(word: str, candidates) -> str:
    """' (did you mean X?)' for the closest candidates to `word`, '' when none is close."""
    key = word.split("=", 1)[0]
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    if not close and key.startswith("--"):      # a prefix of a known option: name the options it starts
        close = sorted(c for c in candidates if c.startswith(key))[:2]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


class K3ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with allow_abbrev=False and "did you mean" hints (see the module)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._commands: dict[tuple[str, str], argparse.ArgumentParser] = {}

    def add_command(self, subparsers, name: str, **kwargs) -> "K3ArgumentParser":
        """A subcommand parser (of this parser's class, no abbreviations), remembered so that an
        unknown option is reported with the subcommand's usage."""
        parser = subparsers.add_parser(name, allow_abbrev=False, **kwargs)
        self._commands[(subparsers.dest, name)] = parser
        return parser

    def option_strings(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings]

    def parse_args(self, args=None, namespace=None):
        global _ARGV
        _ARGV = list(sys.argv[1:] if args is None else args)
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            target = self._innermost(args)
            refused = getattr(target, "refused_options", {})
            for e in extras:
                if e.split("=", 1)[0] in refused:
                    target.error(f"{e.split('=', 1)[0]} (vLLM's) is not supported by k3: {refused[e.split('=', 1)[0]]}")
            options = target.option_strings()
            hints = "".join(did_you_mean(e, options) for e in extras if e.startswith("-"))
            target.error(f"unrecognized arguments: {' '.join(extras)}{hints}")
        return args

    def _innermost(self, args) -> argparse.ArgumentParser:
        """The parser of the (sub)command `args` selected (nested subcommands followed)."""
        parser: argparse.ArgumentParser = self
        while isinstance(parser, K3ArgumentParser):
            chosen = next((p for (dest, name), p in parser._commands.items()
                           if getattr(args, dest, None) == name), None)
            if chosen is None:
                break
            parser = chosen
        return parser

    def error(self, message: str) -> NoReturn:
        m = _INVALID_CHOICE.search(message)
        if m and "did you mean" not in message:
            choices = re.findall(r"'([^']*)'", m.group("choices"))
            message += did_you_mean(m.group("value"), choices)
        elif message.startswith("the following arguments are required"):
            # argparse reports a missing required option before unknown ones: name a misspelt one
            options = self.option_strings()
            unknown = [w.split("=", 1)[0] for w in _ARGV if w.startswith("--") and w.split("=", 1)[0] not in options]
            message += "".join(f"; unrecognized {w}{did_you_mean(w, options)}" for w in unknown)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")
