"""`k3 checkpoint init`: a loadable tiny checkpoint with its tokenizer; clear refusals."""

import torch

from k3.checkpoint.loader import load_model
from k3.cli.main import main
from k3.tokenizer import load_tokenizer


def test_init_writes_a_loadable_checkpoint_with_tokenizer(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["checkpoint", "init", "--preset", "k3.1-pro-tiny", "--out", str(out), "--seed", "3"]) == 0
    assert capsys.readouterr().out == ""                      # notices go to stderr
    model = load_model(out, progress=False)
    assert model.cfg.uses_dsa and model.dtype == torch.bfloat16
    tok = load_tokenizer(out)
    assert tok.flavor == "k3" and tok.token_id("<|end_of_msg|>") in model.cfg.eos_token_ids
    assert (out / "tiktoken.model").exists() and (out / "generation_config.json").exists()


def test_kimi_linear_tiny_ships_tokenizer_json(tmp_path):
    assert main(["checkpoint", "init", "--preset", "kimi-linear-tiny", "--out", str(tmp_path)]) == 0
    tok = load_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").exists() and tok.flavor == "k2"


def test_refuses_huge_and_existing(tmp_path, capsys):
    assert main(["checkpoint", "init", "--preset", "kimi-k3", "--out", str(tmp_path / "big")]) == 2
    assert "1,453 GiB" in capsys.readouterr().err and not (tmp_path / "big").exists()
    assert main(["checkpoint", "init", "--preset", "k3-tiny", "--out", str(tmp_path)]) == 0
    assert main(["checkpoint", "init", "--preset", "k3-tiny", "--out", str(tmp_path)]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_config_only_writes_no_weights_and_serves_with_dummy_weights(tmp_path, capsys):
    from k3.engine.engine import EngineConfig, LLMEngine
    from k3.engine.params import SamplingParams

    assert main(["checkpoint", "init", "--preset", "k3-tiny", "--out", str(tmp_path / "t"), "--config-only"]) == 0
    assert "no weights" in capsys.readouterr().err
    files = sorted(p.name for p in (tmp_path / "t").iterdir())
    assert "config.json" in files and not any(f.endswith(".safetensors") for f in files)
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "t"), load_format="dummy", dtype="float32",
                                    load_progress=False, kv_cache_memory_gib=0.02))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # the huge presets too: no 64 GiB guard, nothing but the config
    assert main(["checkpoint", "init", "--preset", "kimi-k3", "--out", str(tmp_path / "k"), "--config-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["config.json", "generation_config.json"]
