"""Every hook in k3.plugin.hookspecs has a section in docs/plugins.md (a heading naming it)."""

import inspect
import re
from pathlib import Path

from k3.plugin import hookspecs
from k3.plugin.markers import PROJECT

DOC = Path(__file__).resolve().parents[3] / "docs" / "plugins.md"


def hook_names() -> list[str]:
    return [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(fn, f"{PROJECT}_spec")]


def headings() -> list[str]:
    """Markdown headings of the doc, outside fenced code blocks."""
    out, fenced = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line)
    return out


def test_hookspecs_are_found():
    assert {"k3_detect_platform", "k3_kda_kernels", "k3_conformance_expectations"} <= set(hook_names())


def test_every_hook_has_a_section():
    missing = [name for name in hook_names() if not any(re.search(rf"\b{name}\b", h) for h in headings())]
    assert not missing, f"docs/plugins.md has no section heading for {missing}"


def test_sections_name_no_unknown_hook():
    named = {m for h in headings() for m in re.findall(r"\bk3_\w+", h)}
    unknown = sorted(named - set(hook_names()))
    assert not unknown, f"docs/plugins.md has sections for hooks that do not exist: {unknown}"
