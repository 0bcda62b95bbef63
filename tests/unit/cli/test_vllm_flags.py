"""vLLM command lines parse into k3's engine config (issue 28 item 2): one test per flag group,
parse only (no model loads). The values are checked against what vLLM's flags mean, written
out here, not against k3's parser."""

from __future__ import annotations

import json
import shlex

import pytest

from k3.cli.common import CliError
from k3.cli.main import build_parser, main
from k3.cli.serve import engine_config, resolve_arguments, sampling_defaults


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A k3-tiny checkpoint without weights (config.json, generation_config.json, tokenizer)."""
    out = tmp_path_factory.mktemp("vllm-flags") / "k3-tiny"
    assert main(["checkpoint", "init", "--preset", "k3-tiny", "--out", str(out), "--config-only"]) == 0
    return out


def parse(line: str, model=None):
    argv = shlex.split(line.replace("MODEL", str(model)) if model is not None else line)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    resolve_arguments(args, parser._commands[("command", "serve")])
    return args


def config(line: str, model):
    return engine_config(parse(line + " --platform reference", model))[0]


def test_model_card_command_line(model):
    c = config("serve MODEL --tensor-parallel-size 1 --trust-remote-code --max-model-len 32k --kv-cache-dtype fp8 "
               """--speculative-config '{"method":"ngram","num_speculative_tokens":3}'""", model)
    assert (c.model, c.tensor_parallel_size, c.max_model_len, c.kv_cache_dtype) == (str(model), 1, 32_000, "fp8")
    assert json.loads(c.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    assert c.enable_prefix_caching is True          # vLLM's default


def test_amd_recipe_command_line(model):
    c = config("serve MODEL -tp 1 --trust-remote-code --max-model-len 1M --max-num-seqs 16 "
               "--gpu-memory-utilization 0.85 --kv-cache-dtype fp8_e4m3", model)
    assert (c.max_model_len, c.max_num_seqs, c.gpu_memory_utilization, c.kv_cache_dtype) == (2 ** 20, 16, 0.85, "fp8")


def test_short_forms(model):
    c = config("serve --model MODEL -tp 2 -dp 2 -ep -dcp 2", model)
    assert (c.tensor_parallel_size, c.data_parallel_size, c.enable_expert_parallel,
            c.decode_context_parallel_size) == (2, 2, True, 2)
    assert c.enable_prefix_caching is False         # left out with DCP > 1, which does not run with it yet


@pytest.mark.parametrize("value,expected", [("4096", 4096), ("32k", 32_000), ("25.6k", 25_600), ("32K", 32_768),
                                            ("1M", 1_048_576), ("auto", None), ("-1", None)])
def test_max_model_len_spellings(model, value, expected):
    assert config(f"serve MODEL --max-model-len {value}", model).max_model_len == expected


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("bfloat16", "bf16"), ("bf16", "bf16"),
                                            ("fp8", "fp8"), ("fp8_e4m3", "fp8")])
def test_kv_cache_dtype_spellings(model, value, expected):
    assert config(f"serve MODEL --kv-cache-dtype {value}", model).kv_cache_dtype == expected


@pytest.mark.parametrize("line,pattern", [("--kv-cache-dtype fp8_e5m2", "e4m3"), ("--max-model-len 1.5K", "1.5k"),
                                          ("--max-model-len lots", "whole number")])
def test_bad_values_are_usage_errors(model, capsys, line, pattern):
    with pytest.raises(SystemExit) as e:
        parse(f"serve MODEL {line}", model)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: k3 serve") and pattern in err


@pytest.mark.parametrize("flag,expected", [("", True), ("--enable-prefix-caching", True),
                                           ("--no-enable-prefix-caching", False)])
def test_prefix_caching(model, flag, expected):
    assert config(f"serve MODEL {flag}", model).enable_prefix_caching is expected


@pytest.mark.parametrize("flag", ["--cudagraph-capture-sizes", "--cuda-graph-sizes", "--graph-batch-sizes"])
def test_graph_capture_sizes(model, flag):
    assert config(f"serve MODEL {flag} 1 2 4", model).graph_batch_sizes == (1, 2, 4)


def test_generation_config(model, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "top_p": 0.8, "max_new_tokens": 9}')
    own = json.loads((model / "generation_config.json").read_text())
    assert sampling_defaults(parse("serve MODEL", model)) == {k: own[k] for k in ("temperature", "top_p", "top_k",
                                                                                   "min_p", "repetition_penalty")
                                                              if k in own} or None
    assert sampling_defaults(parse(f"serve MODEL --generation-config {tmp_path}", model)) == {"temperature": 0.3,
                                                                                              "top_p": 0.8}
    over = """--override-generation-config '{"temperature": 0.6}'"""
    assert sampling_defaults(parse(f"serve MODEL --generation-config {tmp_path} {over}", model)) == {
        "temperature": 0.6, "top_p": 0.8}
    assert sampling_defaults(parse(f"serve MODEL --generation-config vllm {over}", model)) == {"temperature": 0.6}
    assert sampling_defaults(parse("serve MODEL --generation-config vllm", model)) is None
    with pytest.raises(CliError, match="'seed'"):
        sampling_defaults(parse("""serve MODEL --override-generation-config '{"seed": 1}'""", model))


def test_api_keys(model, monkeypatch):
    monkeypatch.delenv("K3_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse("serve MODEL", model).api_key is None
    assert parse("serve MODEL --api-key a b", model).api_key == ["a", "b"]
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert parse("serve MODEL", model).api_key == ["v"]
    monkeypatch.setenv("K3_API_KEY", "k")
    assert parse("serve MODEL", model).api_key == ["k", "v"]
    assert parse("serve MODEL --api-key a", model).api_key == ["a"]     # the flag wins over the environment


def test_hf_overrides(model):
    from k3.config import K3Config

    c = config("""serve MODEL --hf-overrides '{"max_position_embeddings": 1234}'""", model)
    assert c.hf_overrides == {"max_position_embeddings": 1234}
    raw = json.loads((model / "config.json").read_text())
    text = raw.get("text_config", raw)
    assert text["max_position_embeddings"] != 1234
    cfg = K3Config.from_pretrained(model, c.hf_overrides)
    assert cfg.max_position_embeddings == 1234 and K3Config.from_pretrained(model).max_position_embeddings == \
        text["max_position_embeddings"]


def test_quantization_must_be_the_checkpoints(model):
    from k3.config import K3Config

    own = K3Config.from_pretrained(model).quantization.quant_method       # k3-tiny: compressed-tensors
    for spelling in (own, own.replace("-", "_"), own.upper()):
        assert config(f"serve MODEL -q {spelling}", model).model == str(model)
    with pytest.raises(CliError, match=f"--quantization fp8: .*{own}"):
        config("serve MODEL --quantization fp8", model)


def test_model_positional_or_flag(model, capsys):
    assert parse("serve MODEL", model).model == parse("serve --model MODEL", model).model == str(model)
    assert parse(f"serve MODEL --model {model}", model).model == str(model)
    for line in ("serve MODEL --model elsewhere", "serve --port 1"):
        with pytest.raises(SystemExit):
            parse(line, model)
        err = capsys.readouterr().err
        assert err.startswith("usage: k3 serve") and ("given twice" in err or "a model is required" in err)


def test_model_card_command_line_runs(tmp_path):
    """The model card's line builds an engine that generates what the same engine built from
    EngineConfig directly does (greedy: speculation and prefix caching leave tokens unchanged)."""
    from k3.cli.checkpoint import init_checkpoint
    from k3.cli.serve import build_engine
    from k3.engine.engine import EngineConfig, LLMEngine
    from k3.engine.params import SamplingParams

    path = init_checkpoint("k3-tiny", tmp_path / "k3-tiny", progress=False)
    args = parse("serve MODEL --tensor-parallel-size 1 --trust-remote-code --max-model-len 32k --kv-cache-dtype fp8 "
                 """--speculative-config '{"method":"ngram","num_speculative_tokens":3}' --platform reference """
                 "--kv-cache-memory 0.02 --dtype float32", path)
    plain = EngineConfig(model=str(path), platform="reference", dtype="float32", kv_cache_dtype="fp8",
                         kv_cache_memory_gib=0.02, load_progress=False)
    outputs = []
    for engine in (build_engine(args), LLMEngine(plain)):
        engine.add_request("r", [1, 2, 3, 1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
        while engine.has_unfinished_requests():
            for out in engine.step():
                last = out
        outputs.append(last.outputs[0].token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4


def test_chat_template_flag(model, tmp_path):
    from k3.cli.serve import chat_template

    assert chat_template(parse("serve MODEL", model)) is None
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat_template(parse(f"serve MODEL --chat-template {path}", model)).render([{"content": "x"}]) == "x"
    with pytest.raises(CliError, match="--chat-template: .*no such file"):
        chat_template(parse(f"serve MODEL --chat-template {tmp_path / 'missing.jinja'}", model))


def test_image_flags(model, tmp_path):
    """vLLM's image flags (and k3's --allow-remote-media) reach the engine config; defaults
    are vLLM's (weights mode, no limit), bad values are usage errors naming what is accepted."""
    c = config("serve MODEL", model)
    assert (c.max_num_encoder_tokens, c.mm_encoder_tp_mode, c.limit_mm_per_prompt) == (None, "weights", None)
    assert c.mm_processor_cache_gb == 4.0
    args = parse(f"""serve MODEL --limit-mm-per-prompt '{{"image": 2}}' --mm-encoder-tp-mode data """
                 "--mm-processor-cache-gb 0 "
                 f"--max-num-encoder-tokens 2k --allowed-local-media-path {tmp_path} --allow-remote-media", model)
    c = engine_config(args)[0]
    assert (c.max_num_encoder_tokens, c.limit_mm_per_prompt, c.max_images_per_prompt) == (2000, {"image": 2}, 2)
    assert (c.mm_encoder_tp_mode, c.mm_processor_cache_gb) == ("data", 0.0)
    assert (args.allowed_local_media_path, args.allow_remote_media) == (str(tmp_path), True)
    with pytest.raises(CliError, match="is not a directory"):
        from k3.cli.serve import _check_flags

        _check_flags(parse(f"serve MODEL --allowed-local-media-path {tmp_path / 'missing'}", model))


@pytest.mark.parametrize("line,pattern", [("""--limit-mm-per-prompt '{"video": 1}'""", '{"image": N}'),
                                          ("--limit-mm-per-prompt 3", "JSON object"),
                                          ("--max-num-encoder-tokens 0", "at least 1"),
                                          ("--mm-encoder-tp-mode shard", "invalid choice"),
                                          ("--mm-processor-cache-gb -1", "at least 0")])
def test_bad_image_flags_are_usage_errors(model, capsys, line, pattern):
    with pytest.raises(SystemExit) as e:
        parse(f"serve MODEL {line}", model)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: k3 serve") and pattern in err


def test_issue_example_command_line_with_fastsafetensors(model, caplog):
    """The K3 model card's vLLM line with only the binary changed: `--load-format fastsafetensors`
    is read as safetensors (the same tensors) with one warning naming what k3 does instead."""
    from k3.cli.serve import FASTSAFETENSORS_NOTE

    with caplog.at_level("WARNING", logger="k3"):
        c = config("serve MODEL -tp 8 --load-format fastsafetensors --enable-auto-tool-choice --tool-call-parser "
                   "kimi_k3 --reasoning-parser kimi_k3 --max-model-len 256k --kv-cache-dtype fp8 "
                   """--speculative-config '{"method":"ngram","num_speculative_tokens":3}'""", model)
    assert (c.tensor_parallel_size, c.load_format, c.max_model_len, c.kv_cache_dtype) == (8, "safetensors", 256_000,
                                                                                          "fp8")
    assert [r.getMessage() for r in caplog.records].count(FASTSAFETENSORS_NOTE) == 1


def test_accepted_but_ignored_flags_warn_once(model, caplog):
    from k3.cli.serve import TRUST_REMOTE_CODE_NOTE

    with caplog.at_level("WARNING", logger="k3"):
        config("serve MODEL --trust-remote-code", model)
    assert [r.getMessage() for r in caplog.records].count(TRUST_REMOTE_CODE_NOTE) == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="k3"):
        config("serve MODEL", model)
    assert TRUST_REMOTE_CODE_NOTE not in [r.getMessage() for r in caplog.records]


def test_other_vllm_load_formats_are_usage_errors(model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("serve MODEL --load-format gguf", model)
    assert exit_info.value.code == 2
    assert "--load-format: invalid choice: 'gguf'" in capsys.readouterr().err


def test_structured_outputs_backend_flags(model):
    """vLLM's --structured-outputs-config JSON and its older --guided-decoding-backend pick the
    grammar backend ("guidance" is vLLM's name for llguidance; "auto" is xgrammar here)."""
    assert config("serve MODEL", model).structured_outputs_backend == "xgrammar"
    c = config("""serve MODEL --structured-outputs-config '{"backend": "guidance", "disable_any_whitespace": true}'""",
               model)
    assert c.structured_outputs_backend == "guidance"
    assert config("serve MODEL --guided-decoding-backend llguidance", model).structured_outputs_backend == "llguidance"
    from k3.cli.serve import _check_flags

    for line, problem in [("""--structured-outputs-config '{"backend": "outlines"}'""", "not implemented by k3"),
                          ("--guided-decoding-backend xgrammar --structured-outputs-config '{}'", "not both")]:
        with pytest.raises(CliError, match=problem):
            _check_flags(parse(f"serve MODEL {line}", model))


def test_precompile_context_bounds_flag(model):
    """k3's own flag beside vLLM's graph flags: every decode context bound captured at start-up."""
    assert config("serve MODEL", model).precompile_context_bounds is False
    assert config("serve MODEL --precompile-context-bounds", model).precompile_context_bounds is True
