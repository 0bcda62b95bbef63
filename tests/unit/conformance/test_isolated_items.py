"""The [run] isolate option of conformance.toml: items of the named cases run in a process of
their own (k3.conformance.isolated) with the same outcome, and a child that dies is that item's
failure, not the run's."""

import pytest

from k3.conformance import expectations as exp
from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item


def test_run_table_is_parsed_and_checked(tmp_path):
    good = tmp_path / "a.toml"
    good.write_text('xfail = []\n[run]\nisolate = ["model.*", "cache.kda_state_rows"]\n')
    other = tmp_path / "b.toml"
    other.write_text('[run]\nisolate = ["model.*"]\n')
    assert exp.load([good]) == []
    assert exp.run_options([good, other]) == {"isolate": ("model.*", "cache.kda_state_rows"), "timeout_s": None,
                                              "env": {}}
    assert exp.isolated(("model.*",), "model.greedy") and not exp.isolated(("model.*",), "kda.chunked")
    bad = tmp_path / "c.toml"
    bad.write_text('[run]\nisolate = ["model.*"]\nparallel = 2\n')
    with pytest.raises(exp.ExpectationError, match="unknown key"):
        exp.load([bad])
    bad.write_text('[run]\nisolate = "model.*"\n')
    with pytest.raises(exp.ExpectationError, match="list of case-name globs"):
        exp.load([bad])
    assert exp.run_options([tmp_path / "missing.toml"]) == {"isolate": (), "timeout_s": None, "env": {}}


def _item(case, shape_prefix):
    return next(i for i in items("full") if i.case.name == case and i.sample.shape.startswith(shape_prefix)
                and i.dtype == "float32")


def test_an_isolated_item_gives_the_in_process_outcome(tmp_path):
    from k3.platform import select_platform

    platform = select_platform("reference")
    item = _item("elementwise.rms_norm", "T37")
    here = run_item(RunContext(platform, workdir=tmp_path), item)
    there = run_item(RunContext(platform, workdir=tmp_path, isolate=("elementwise.*",)), item)
    assert here.passed and there.passed
    assert [(o.name, o.kind, o.ratio, o.max_abs) for o in there.outputs] == \
        [(o.name, o.kind, o.ratio, o.max_abs) for o in here.outputs]
    assert any("own process" in n for n in there.notes)


def test_a_dead_child_is_the_items_failure(tmp_path, monkeypatch):
    from k3.conformance import isolated
    from k3.platform import select_platform

    item = _item("elementwise.rms_norm", "T37")
    monkeypatch.setattr(isolated, "_command", lambda ctx, item, out: ["/bin/false"])   # exits 1, writes nothing
    outcome = isolated.run_isolated(RunContext(select_platform("reference"), workdir=tmp_path), item)
    assert not outcome.passed and "exited with status 1" in outcome.outputs[0].message


def test_an_item_past_the_timeout_fails_saying_so(tmp_path, monkeypatch):
    from k3.conformance import isolated
    from k3.platform import select_platform

    (tmp_path / "t.toml").write_text('[run]\nisolate = ["model.*"]\ntimeout_s = 0.5\n')
    assert exp.run_options([tmp_path / "t.toml"])["timeout_s"] == 0.5
    item = _item("elementwise.rms_norm", "T37")
    monkeypatch.setattr(isolated, "_command", lambda ctx, item, out: ["/bin/sleep", "5"])
    outcome = isolated.run_isolated(RunContext(select_platform("reference"), workdir=tmp_path, isolate_timeout_s=0.5),
                                    item)
    assert not outcome.passed and "did not finish in 0.5 s" in outcome.outputs[0].message


def test_a_case_that_skips_in_the_child_is_skipped(tmp_path, monkeypatch):
    import sys

    from k3.conformance import isolated
    from k3.platform import select_platform

    item = _item("elementwise.rms_norm", "T37")
    write = "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'skipped': 'no batch-invariant kernel'}))"
    monkeypatch.setattr(isolated, "_command", lambda ctx, item, out: [sys.executable, "-c", write, str(out)])
    with pytest.raises(pytest.skip.Exception, match="no batch-invariant kernel"):
        isolated.run_isolated(RunContext(select_platform("reference"), workdir=tmp_path), item)


def test_run_env_is_merged_checked_and_reaches_the_child(tmp_path, monkeypatch):
    import sys

    from k3.conformance import isolated
    from k3.platform import select_platform

    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('[run]\nisolate = ["model.*"]\nenv = { K3_TEST_FLAG = "on" }\n')
    b.write_text('[run]\nenv = { K3_TEST_FLAG = "on", OTHER = "1" }\n')
    assert exp.run_options([a, b])["env"] == {"K3_TEST_FLAG": "on", "OTHER": "1"}
    b.write_text('[run]\nenv = { K3_TEST_FLAG = "off" }\n')
    with pytest.raises(exp.ExpectationError, match="another file sets"):
        exp.run_options([a, b])
    b.write_text('[run]\nenv = { K3_TEST_FLAG = 1 }\n')
    with pytest.raises(exp.ExpectationError, match="env must be a table"):
        exp.load([b])
    # the child sees it: it skips with the variable's value as its reason
    write = ("import json, os, sys; open(sys.argv[1], 'w').write(json.dumps({'skipped': "
             "'flag=' + os.environ.get('K3_TEST_FLAG', 'unset')}))")
    monkeypatch.setattr(isolated, "_command", lambda ctx, item, out: [sys.executable, "-c", write, str(out)])
    ctx = RunContext(select_platform("reference"), workdir=tmp_path, isolate_env={"K3_TEST_FLAG": "on"})
    with pytest.raises(pytest.skip.Exception, match="flag=on"):
        isolated.run_isolated(ctx, _item("elementwise.rms_norm", "T37"))
