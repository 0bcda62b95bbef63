"""conformance.toml: parsing, matching by glob, stale entries."""

import pytest

from k3.conformance import expectations as exp
from k3.conformance.registry import items

GOOD = """
[[xfail]]
case = "kda.chunked/ragged3_*"
dtype = "bfloat16"
reason = "chunk kernel needs K >= 32"

[[xfail]]
case = "mla.*"
reason = "no MLA kernel yet"

[[xfail]]
case = "kda.no_such_case"
reason = "removed long ago"
"""


def test_parse_and_match_globs():
    entries = exp.parse(GOOD, "nvidia/conformance.toml")
    assert [e.dtype for e in entries] == ["bfloat16", "*", "*"]
    assert entries[0].source == "nvidia/conformance.toml entry 1"
    full = items("full")
    chunked = [i for i in full if i.case.name == "kda.chunked"]
    hit = [i for i in chunked if exp.first_match(entries, i)]
    assert hit and all(i.dtype == "bfloat16" and i.sample.shape.startswith("ragged3_") for i in hit)
    mla = [i for i in full if i.case.family == "mla"]
    assert all(exp.first_match(entries, i) is entries[1] for i in mla)          # bare case-name globs, every dtype
    assert exp.first_match(entries, next(i for i in full if i.case.name == "kda.gate")) is None


def test_stale_entries_match_no_test_of_any_tier():
    entries = exp.parse(GOOD, "f.toml")
    stale = exp.stale(entries, items("full"))
    assert [e.case for e in stale] == ["kda.no_such_case"]


def test_empty_file_and_empty_array():
    assert exp.parse("", "f.toml") == []
    assert exp.parse("# nothing expected\nxfail = []\n", "f.toml") == []


@pytest.mark.parametrize("text, message", [
    ('[[xfail]]\ncase = "kda.gate"\n', "entry 1 (kda.gate): reason is required"),
    ('[[xfail]]\ncase = "kda.gate"\nreason = "  "\n', "reason is required"),
    ('[[xfail]]\nreason = "why"\n', "case (a glob on the test id) is required"),
    ('[[xfail]]\ncase = "kda.gate"\nreason = "r"\nshape = "x"\n', "unknown key(s) ['shape']"),
    ('[[xpass]]\ncase = "kda.gate"\nreason = "r"\n', "unknown table(s) ['xpass']"),
    ('[[xfail]\n', "not valid TOML"),
])
def test_bad_files_are_errors(text, message):
    with pytest.raises(exp.ExpectationError, match=None) as info:
        exp.parse(text, "p/conformance.toml")
    assert message in str(info.value) and "p/conformance.toml" in str(info.value)


def test_load_reads_files_in_order(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('[[xfail]]\ncase = "kda.gate"\nreason = "a"\n')
    b.write_text('[[xfail]]\ncase = "kda.gate"\nreason = "b"\n')
    assert [e.reason for e in exp.load([a, b])] == ["a", "b"]
    with pytest.raises(exp.ExpectationError, match="not found"):
        exp.load([tmp_path / "missing.toml"])


def test_the_platform_plugins_files_parse():
    from pathlib import Path

    import k3.platforms

    for path in Path(k3.platforms.__path__[0]).glob("*/conformance.toml"):
        exp.load([path])
