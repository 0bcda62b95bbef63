"""The mutation run (tests/mutants, run by .ci/peers.sh) needs every mutant's line to occur
exactly once in its file; code moves break that silently, so the main tier checks it in
milliseconds instead of the peer tier finding out after its venv and oracle runs."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "mutants"))

from mutants import MUTANTS, misplaced  # noqa: E402


def test_every_mutant_line_occurs_exactly_once():
    problems = misplaced(MUTANTS, ROOT)
    assert not problems, problems


def test_mutant_names_are_unique_and_change_something():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert all(m.old != m.new for m in MUTANTS)
