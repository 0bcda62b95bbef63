"""docs/serving.md's vLLM-to-k3 flag table is what tools/vllm_flag_table.py prints from the
`k3 serve` parser, and the vLLM flags it lists as refused are refused with that reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from k3.cli.main import main
from k3.cli.vllm_flags import REFUSED, VLLM_SPELLINGS

ROOT = Path(__file__).resolve().parents[3]


def _tool():
    spec = importlib.util.spec_from_file_location("vllm_flag_table", ROOT / "tools" / "vllm_flag_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doc_table_matches_the_parser():
    tool = _tool()
    generated = tool.table()           # raises when VLLM_SPELLINGS names an option the parser lacks
    assert tool.in_doc((ROOT / "docs" / "serving.md").read_text()) == generated, \
        "docs/serving.md is stale: run python tools/vllm_flag_table.py --write"
    for flag in [*VLLM_SPELLINGS, *REFUSED]:
        if flag != "model_tag":
            assert f"`{flag}`" in generated


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size", "-pp", "--tokenizer"])
def test_refused_vllm_flags_name_the_reason(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", flag, "2"] if flag != "--tokenizer" else ["serve", "m", f"{flag}=x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: k3 serve ")
    assert f"{flag} (vLLM's) is not supported by k3: {REFUSED[flag]}" in err
