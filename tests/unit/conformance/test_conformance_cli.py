"""`k3 conformance`: exit codes, the report files and their schema, a broken kernel caught end to
end (installed as a third-party plugin), expectations, stale entries, merge."""

import json
import tempfile
import textwrap

import pytest

from k3.cli.conformance import EXIT_CODES
from k3.cli.main import main
from k3.conformance.report import SCHEMA_VERSION, STATUSES

REPORT_KEYS = {"schema_version", "date", "tier", "duration_s", "platform", "plugins", "device", "k3_version",
               "torch_version", "python_version", "expectation_files", "summary", "stale_expectations", "cases"}
CASE_KEYS = {"id", "nodeid", "case", "family", "entry", "dtype", "shape", "status", "reason", "error_ratio",
             "max_abs_error", "tolerance", "provider", "implementation", "executed_on", "duration_s", "outputs",
             "notes"}


def test_exit_codes_never_pass_pytest_codes_through():
    assert EXIT_CODES == {0: 0, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2}


def test_unavailable_platform_is_2_with_one_sentence(capsys):
    assert main(["conformance", "--platform", "no-such-platform"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3: error: unknown platform 'no-such-platform'")


def test_missing_platform_or_bad_tier_is_2(capsys):
    assert main(["conformance"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["conformance", "--platform", "reference", "--tier", "huge"])
    assert info.value.code == 2


def test_bad_expectations_file_is_2_before_pytest(tmp_path, capsys):
    bad = tmp_path / "conformance.toml"
    bad.write_text('[[xfail]]\ncase = "kda.gate"\n')
    assert main(["conformance", "--platform", "reference", "--expectations", str(bad),
                 "--report", str(tmp_path / "r")]) == 2
    assert "reason is required" in capsys.readouterr().err
    assert not (tmp_path / "r" / "report.json").exists()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A smoke run with the temporary directory pointed at an empty folder (this process's
    and the pytest subprocess's): (report dir, that folder)."""
    out, temp = tmp_path_factory.mktemp("smoke"), tmp_path_factory.mktemp("smoke-tmp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(temp))
        mp.setattr(tempfile, "tempdir", str(temp))
        assert main(["conformance", "--platform", "reference", "--tier", "smoke", "--report", str(out)]) == 0
    return out, temp


@pytest.fixture(scope="module")
def smoke_report(smoke_run):
    return smoke_run[0]


def test_a_run_leaves_no_temporary_folders(smoke_run):
    """Tiny checkpoints, pytest's tmp_path folders and the collectives workers' rendezvous all
    live in the run's own scratch folder, which goes with the run (hundreds of k3-conformance-*
    folders used to pile up in the temporary directory)."""
    _, temp = smoke_run
    assert sorted(p.name for p in temp.iterdir()) == []


def test_smoke_run_writes_the_report(smoke_report):
    report = json.loads((smoke_report / "report.json").read_text())
    assert set(report) == REPORT_KEYS and report["schema_version"] == SCHEMA_VERSION
    assert report["tier"] == "smoke" and report["platform"]["name"] == "reference"
    assert report["device"]["capabilities"]["dist_backend"] == "gloo"
    assert any(p["name"] == "reference" and p["distribution"] == "k3" for p in report["plugins"])
    assert report["summary"]["total"] == len(report["cases"]) > 30
    summary = report["summary"]
    assert summary["failed"] == 0 and summary["passed"] + summary["skipped"] == summary["total"]
    skipped = [c for c in report["cases"] if c["status"] == "skipped"]
    assert [c["case"] for c in skipped] == ["model.graph_decode"]          # the reference captures no graphs
    assert "graph_capture" in skipped[0]["reason"]
    families = {c["family"] for c in report["cases"]}
    assert {"kda", "mla", "indexer", "moe", "attn_res", "elementwise", "quant", "cache", "collectives",
            "model"} <= families
    for case in report["cases"]:
        assert set(case) == CASE_KEYS and case["status"] in STATUSES
        assert case["id"] == f"{case['case']}/{case['shape']}/{case['dtype']}"
        assert case["provider"] in ("reference", "torch.distributed")
    md = (smoke_report / "report.md").read_text()
    assert md.startswith("# k3 conformance: reference") and "| elementwise |" in md


BROKEN_PLUGIN = '''
"""A third-party kernel-only plugin whose rms_norm is 10% off."""
from k3 import reference as ref
from k3.plugin import ElementwiseKernels, hookimpl

K3_HOOKSPEC_VERSIONS = (1,)


def wrong_rms_norm(x, weight, eps):
    return ref.rms_norm(x, weight, eps) * 1.1


@hookimpl
def k3_elementwise_kernels(platform):
    return ElementwiseKernels(rms_norm=wrong_rms_norm)
'''


@pytest.fixture(scope="module")
def broken_report(tmp_path_factory):
    """A smoke subset with a broken rms_norm installed as a plugin distribution (dist-info on
    PYTHONPATH, as pip would install it), with an xfail for the model case it breaks and a
    stale entry."""
    site = tmp_path_factory.mktemp("site")
    (site / "broken_k3_plugin.py").write_text(BROKEN_PLUGIN)
    info = site / "brokenk3-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenk3\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[k3]\nbroken = broken_k3_plugin\n")
    toml = site / "conformance.toml"
    toml.write_text(textwrap.dedent('''
        [[xfail]]
        case = "model.greedy/k3-tiny*"
        dtype = "float32"
        reason = "the broken rms_norm changes the tokens"

        [[xfail]]
        case = "kda.retired_case"
        reason = "a case that no longer exists"
    '''))
    out = tmp_path_factory.mktemp("broken")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(site))
    try:
        code = main(["conformance", "--platform", "reference", "--tier", "smoke", "-k", "rms_norm or greedy",
                     "--expectations", str(toml), "--report", str(out)])
    finally:
        mp.undo()
    return code, json.loads((out / "report.json").read_text())


def test_broken_kernel_fails_with_its_error_ratio(broken_report):
    code, report = broken_report
    assert code == 1
    cases = {c["case"]: c for c in report["cases"]}
    rms = cases["elementwise.rms_norm"]
    assert rms["status"] == "failed" and rms["provider"] == "broken"
    assert rms["error_ratio"] == pytest.approx(0.1, rel=0.05) and rms["error_ratio"] > rms["tolerance"]["ratio"]
    assert "error ratio" in rms["reason"]
    assert cases["elementwise.gated_rms_norm"]["status"] == "passed"        # -k "rms_norm" matched it too
    assert any(p["name"] == "broken" and p["distribution"] == "brokenk3" and p["version"] == "0.1"
               for p in report["plugins"])


def test_expectations_xfail_and_stale_entries(broken_report):
    _, report = broken_report
    greedy = next(c for c in report["cases"] if c["case"] == "model.greedy")
    assert greedy["status"] == "xfailed" and "the broken rms_norm changes the tokens" in greedy["reason"]
    assert [e["case"] for e in report["stale_expectations"]] == ["kda.retired_case"]
    assert report["summary"]["xfailed"] == 1 and report["summary"]["failed"] == 1


def test_merge_renders_one_support_matrix(smoke_report, broken_report, tmp_path):
    _, broken = broken_report
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text(json.dumps(broken))
    out = tmp_path / "matrix.md"
    assert main(["conformance", "merge", str(smoke_report), str(tmp_path / "b" / "report.json"),
                 "--out", str(out)]) == 0
    md = out.read_text()
    assert md.startswith("# k3 conformance support matrix")
    header = next(line for line in md.splitlines() if line.startswith("| family | dtype |"))
    assert header.count("reference (CPU (reference ops)") == 2
    assert "| elementwise | float32 | 7/7 | 2/3 (1 failed) |" in md      # add_rms_norm matches -k rms_norm too; sigmoid
    # the model family's float32 smoke items (model.batch_invariance_bitwise among them since issue 31)
    assert "| model | float32 | 3/4 (1 skipped) | 0/1 (1 xfail) |" in md
    assert "- failed: `elementwise.rms_norm/" in md and "stale expectation: `kda.retired_case`" in md
    assert md.count("- executed on: cpu: ") == 2                      # where each report's items ran


def test_merge_of_a_missing_report_is_2(tmp_path, capsys):
    assert main(["conformance", "merge", str(tmp_path), "--out", str(tmp_path / "m.md")]) == 2
    assert "no conformance report" in capsys.readouterr().err
