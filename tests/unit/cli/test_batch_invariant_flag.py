"""`k3 serve --batch-invariant` (and K3_BATCH_INVARIANT=1) reaches the engine config, turns
prefix caching's default off, and is refused, naming the entries, on a platform whose kernels
are not marked batch invariant."""

import shlex

import pytest

from k3.cli.main import build_parser, main
from k3.cli.serve import engine_config, resolve_arguments
from k3.platform import BatchInvariantUnsupported, facade


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch-invariant-flag") / "k3-tiny"
    assert main(["checkpoint", "init", "--preset", "k3-tiny", "--out", str(out), "--config-only"]) == 0
    return out


def config(line: str, model):
    argv = shlex.split(line.replace("MODEL", str(model)) + " --platform reference")
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    resolve_arguments(args, parser._commands[("command", "serve")])
    return engine_config(args)


def test_flag_and_environment(model, monkeypatch):
    monkeypatch.delenv("K3_BATCH_INVARIANT", raising=False)
    c, platform = config("serve MODEL --batch-invariant", model)
    assert c.batch_invariant and platform.batch_invariant and c.enable_prefix_caching is True   # bit-exact hits
    c, platform = config("serve MODEL", model)
    assert not c.batch_invariant and not platform.batch_invariant and c.enable_prefix_caching is True
    monkeypatch.setenv("K3_BATCH_INVARIANT", "1")
    assert config("serve MODEL", model)[0].batch_invariant
    assert not config("serve MODEL --no-batch-invariant", model)[0].batch_invariant


def test_refused_where_kernels_are_not_marked(model, monkeypatch):
    monkeypatch.setattr(facade, "is_batch_invariant", lambda kernel: False)
    with pytest.raises(BatchInvariantUnsupported, match=r"platform 'reference' has no batch-invariant kernel for "
                                                        r"kda\.gate, .*lora\.experts"):
        config("serve MODEL --batch-invariant", model)
