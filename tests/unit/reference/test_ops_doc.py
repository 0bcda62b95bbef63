"""docs/ops.md is generated from the kernel protocols and the reference ops' docstrings
(`python -m k3.reference.ops_doc > docs/ops.md`): the committed file equals the generated text,
and it documents every kernel entry and every op k3.reference exports."""

import re
from pathlib import Path

from k3 import reference as ref
from k3.plugin import KERNEL_TABLES
from k3.reference import ops_doc

DOC = Path(__file__).resolve().parents[3] / "docs" / "ops.md"


def test_the_committed_ops_md_is_the_generated_one():
    assert DOC.read_text() == ops_doc.render(), (
        "docs/ops.md is stale: regenerate it with `python -m k3.reference.ops_doc > docs/ops.md`")


def test_every_entry_and_every_exported_op_has_a_section():
    text = ops_doc.render()
    headings = set(re.findall(r"^### `([\w.]+)`", text, re.M))
    entries = {f"{t.FAMILY}.{e}" for t in KERNEL_TABLES for e in t.entries()}
    assert entries <= headings, f"kernel entries without a section: {sorted(entries - headings)}"
    oracles = set(re.findall(r"^Oracle: `k3\.reference\.(\w+)`", text, re.M))
    documented = oracles | (headings - entries)
    assert set(ref.__all__) - documented == set(), "exported by k3.reference but not in docs/ops.md"
    assert documented - set(ref.__all__) == set(), "in docs/ops.md but not exported by k3.reference"
