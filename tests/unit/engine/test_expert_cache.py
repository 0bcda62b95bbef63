"""The expert cache (k3.engine.expert_cache): MXFP4 routed experts held dense after load. The
capacity plan counts the dense stacks in place of the planes (so the KV cache shrinks by exactly
the difference), "auto" follows the plan's fit (all layers, the first layers that fit, or none),
and an engine holding all or some layers' experts dense decodes what the MXFP4 engine decodes."""

from types import SimpleNamespace

import pytest
import torch

from k3.cache.capacity import GIB, plan_capacity, weight_terms_per_gpu
from k3.cache.format import CacheFormat
from k3.config import K3Config
from k3.engine import expert_cache
from k3.engine.config import EngineConfig
from k3.engine.factory import cache_bytes
from k3.model.ffn import MoE

SLICE = K3Config.preset("k3-slice")       # 11 MoE layers of 128 MXFP4 experts, 3072 x 3584
H200 = 150_119_981_056


def _accelerator(memory=H200, default="auto"):
    return SimpleNamespace(info=SimpleNamespace(device="cuda"), capabilities=SimpleNamespace(memory_bytes=memory),
                           config_defaults=lambda: {"expert_cache": default})


def test_plan_counts_the_dense_stacks_instead_of_the_planes():
    packed, dense = weight_terms_per_gpu(SLICE, 1), weight_terms_per_gpu(SLICE, 1, expert_cache_dtype=torch.bfloat16)
    moe_layers = SLICE.num_hidden_layers - SLICE.first_k_dense_replace
    per_expert = 3 * SLICE.moe_intermediate_size * SLICE.expert_hidden_size          # weights of one expert
    assert dense.routed_experts == moe_layers * SLICE.num_experts * per_expert * 2
    assert packed.routed_experts == moe_layers * SLICE.num_experts * per_expert * (1 / 2 + 1 / 32)   # codes + scales
    assert (dense.total - dense.routed_experts) == (packed.total - packed.routed_experts)
    kw = dict(gpu_memory_bytes=H200, max_model_len=8448, max_num_seqs=64, max_num_batched_tokens=8192)
    off, on = plan_capacity(SLICE, **kw), plan_capacity(SLICE, expert_cache=True, **kw)
    assert off.cache_bytes - on.cache_bytes == dense.routed_experts - packed.routed_experts
    assert on.expert_cache and not off.expert_cache and on.fits
    assert not plan_capacity(SLICE, expert_cache=True, **{**kw, "gpu_memory_utilization": 0.6}).fits


def test_a_partial_cache_counts_its_layers_dense_and_the_others_packed():
    packed, dense = weight_terms_per_gpu(SLICE, 1), weight_terms_per_gpu(SLICE, 1, expert_cache_dtype=torch.bfloat16)
    layers = packed.expert_layers
    assert layers == SLICE.num_hidden_layers - SLICE.first_k_dense_replace and dense.dense_expert_layers == layers
    for n in (0, 1, 4, layers - 1):
        part = weight_terms_per_gpu(SLICE, 1, expert_cache_dtype=torch.bfloat16, expert_cache_layers=n)
        assert part.dense_expert_layers == n
        assert part.routed_experts * layers == n * dense.routed_experts + (layers - n) * packed.routed_experts
    kw = dict(gpu_memory_bytes=80 * GIB, max_model_len=8448, max_num_seqs=64, max_num_batched_tokens=8192)
    report = plan_capacity(SLICE, expert_cache=True, expert_cache_layers=4, **kw)
    assert report.expert_cache and report.expert_cache_layers == 4
    assert plan_capacity(SLICE, **kw).cache_bytes - report.cache_bytes == 4 * (dense.routed_experts
                                                                              - packed.routed_experts) // layers


def test_the_engine_sizes_its_cache_after_the_dense_experts():
    config = EngineConfig(model="unused", max_model_len=8448, max_num_batched_tokens=8192)
    fmt = CacheFormat.build(SLICE, activation_dtype=torch.bfloat16)
    off = cache_bytes(config, SLICE, fmt, _accelerator())
    on = cache_bytes(config, SLICE, fmt, _accelerator(), expert_cache=True)
    gap = weight_terms_per_gpu(SLICE, 1, expert_cache_dtype=torch.bfloat16).total - weight_terms_per_gpu(SLICE, 1).total
    assert off - on == gap and gap > 60 * GIB


@pytest.mark.parametrize("memory, util, seqs, want", [(H200, 0.9, 64, "all"), (H200, 0.6, 64, "part"),
                                                      (80 * GIB, 0.9, 64, "part"), (H200, 0.9, 256, "part"),
                                                      (24 * GIB, 0.9, 64, "none")])
def test_auto_follows_the_plan(memory, util, seqs, want):
    """Every layer's experts dense where the plan fits and its cache still holds the fewer of
    max_num_seqs and the MXFP4 plan's max-length requests; else the most layers for which that
    holds (one more would not); else none. At 256 sequences on the H200 the whole cache would fit
    (64 requests) but cut the concurrency: 4 layers are held instead."""
    config = EngineConfig(model="unused", max_model_len=8448, max_num_batched_tokens=8192, gpu_memory_utilization=util,
                          max_num_seqs=seqs)
    platform = _accelerator(memory)
    fmt = CacheFormat.build(SLICE, activation_dtype=torch.bfloat16)
    from k3.engine.factory import capacity_report

    def plan(layers=None):
        return capacity_report(config, SLICE, fmt, platform, expert_cache=True, expert_cache_layers=layers)

    floor = max(1, min(seqs, plan(0).concurrent_max_len_requests))

    def acceptable(report):
        return report.fits and report.concurrent_max_len_requests >= floor

    decision = expert_cache.decide(config, SLICE, platform, plan)
    assert decision.mode == "auto" and decision.on is (want != "none"), decision.reason
    if want == "all":
        assert decision.layers is None and acceptable(plan())
    elif want == "part":
        n = decision.layers
        assert 0 < n < 11 and acceptable(plan(n)) and not acceptable(plan(n + 1)), decision.reason
        assert f"the first {n} of 11 MoE layers'" in decision.reason
        assert plan().fits is (seqs == 256)                         # 256: the floor, not the fit, said no
    else:
        assert decision.layers is None and not acceptable(plan(1))


def test_largest_fitting_layers_bisects():
    asked = []

    def acceptable(n):
        asked.append(n)
        return n <= 6
    assert expert_cache.largest_fitting_layers(acceptable, 10) == 6 and len(asked) <= 4
    assert expert_cache.largest_fitting_layers(lambda n: False, 10) == 0
    assert expert_cache.largest_fitting_layers(lambda n: True, 10) == 10


def test_modes_without_a_plan():
    never = lambda: pytest.fail("the plan is read only for auto on a device with a memory size")  # noqa: E731
    decide = expert_cache.decide
    assert decide(EngineConfig(model="m", expert_cache="on"), SLICE, _accelerator(default="off"), never).on
    assert not decide(EngineConfig(model="m"), SLICE, _accelerator(default="off"), never).on
    assert not decide(EngineConfig(model="m", expert_cache="off"), SLICE, _accelerator(), never).on
    cpu = SimpleNamespace(info=SimpleNamespace(device="cpu"), capabilities=SimpleNamespace(memory_bytes=None),
                          config_defaults=lambda: {"expert_cache": "auto"})
    assert not decide(EngineConfig(model="m"), SLICE, cpu, never).on
    dense = K3Config.preset("kimi-linear-tiny")                                          # bf16 experts
    assert not decide(EngineConfig(model="m", expert_cache="on"), dense, cpu, never).on
    with pytest.raises(ValueError, match="expert_cache must be auto, on or off"):
        decide(EngineConfig(model="m"), SLICE, _accelerator(default="sometimes"), never)
    with pytest.raises(ValueError, match="expert_cache must be auto, on or off"):
        EngineConfig(model="m", expert_cache="yes").validate()


def _engine(path, mode):
    from k3.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), platform="ppu", dtype="float32", kv_cache_memory_gib=0.02,
                                  max_num_seqs=2, load_progress=False, expert_cache=mode))


def test_an_engine_with_dense_experts_decodes_what_mxfp4_decodes(tiny_checkpoint):
    from k3.engine.params import SamplingParams

    path = tiny_checkpoint("k3-tiny")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs = {}
    for mode in ("on", None):                                  # None: ppu's default, auto: off on the CPU
        engine = _engine(path, mode)
        moes = [m for m in engine.model.modules() if isinstance(m, MoE)]
        held_dense = mode == "on"
        assert engine.expert_cache.on is held_dense and moes
        for m in moes:
            assert ("w13_packed" in m._buffers) is not held_dense
            w13, w2 = m.expert_weights()
            assert isinstance(w13, torch.Tensor) is held_dense and isinstance(w2, torch.Tensor) is held_dense
        for i, prompt in enumerate(([5, 9, 13, 21, 40], [7, 3])):
            engine.add_request(f"r{i}", prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        outputs[mode] = done
    assert outputs["on"] == outputs[None] and all(len(t) == 5 for t in outputs["on"].values())


def test_a_partial_cache_decodes_what_mxfp4_decodes(tiny_checkpoint):
    """The first MoE layer's experts dense, the others MXFP4: the ppu experts entry takes its way
    per layer from the weights it is given, and the tokens are the MXFP4 engine's."""
    from k3.engine.params import SamplingParams

    path = tiny_checkpoint("k3-tiny")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs = []
    for layers in (None, 1):
        engine = _engine(path, None)                        # ppu's auto: off on the CPU
        moes = [m for m in engine.model.modules() if isinstance(m, MoE)]
        assert len(moes) >= 2
        if layers:
            assert expert_cache.hold_experts_dense(engine.model, layers) > 0
        assert ["w13_packed" in m._buffers for m in moes] == [not layers or i >= layers for i in range(len(moes))]
        for i, prompt in enumerate(([5, 9, 13, 21, 40], [7, 3])):
            engine.add_request(f"r{i}", prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        outputs.append(done)
    assert outputs[0] == outputs[1] and all(len(t) == 5 for t in outputs[0].values())


def test_hold_experts_dense_is_exact_and_frees_the_planes():
    from k3.checkpoint.dummy import load_dummy_weights
    from k3.model import K3ForCausalLM

    cfg = K3Config.preset("k3-tiny")
    model = K3ForCausalLM(cfg, dtype=torch.bfloat16)
    load_dummy_weights(model, seed=3, progress=False)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    w13, w2 = moe.expert_weights()
    want13, want2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    held = expert_cache.hold_experts_dense(model)
    got13, got2 = moe.expert_weights()
    assert torch.equal(got13, want13) and torch.equal(got2, want2) and got13.dtype == torch.bfloat16
    assert not any(name.endswith(("_packed", "_scale")) for name, _ in model.named_buffers())
    moe_layers = sum(isinstance(m, MoE) for m in model.modules())
    assert held == moe_layers * 3 * cfg.moe_intermediate_size * cfg.expert_hidden_size * cfg.num_experts * 2
    assert expert_cache.hold_experts_dense(model) == 0                                      # done already


def test_experts_repacked_tile_major_compute_what_the_checkpoint_layout_computes():
    """MoE.hold_experts_tile_major (a platform's k3_process_weights): the planes replaced by
    their tile-major copies, expert_weights gives TileMajorMXFP4s that dequantise to the same
    weights, the reference experts give the same output bit for bit, the expert cache still
    works after it; a model whose expert dimensions do not divide into 128 x 64 tiles stays."""
    from k3.checkpoint.dummy import load_dummy_weights
    from k3.model import K3ForCausalLM
    from k3.quant.mxfp4_tiles import TileMajorMXFP4
    from k3.reference import experts_forward

    tiny = K3Config.preset("k3-tiny")
    model = K3ForCausalLM(tiny, dtype=torch.bfloat16)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert not moe.hold_experts_tile_major()                                  # 32 x 32 experts: no whole tile
    cfg = tiny.replace(moe_intermediate_size=64, routed_expert_hidden_size=128)
    model = K3ForCausalLM(cfg, dtype=torch.bfloat16)
    load_dummy_weights(model, seed=4, progress=False)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    w13, w2 = moe.expert_weights()
    x = torch.randn(5, 128).bfloat16()
    weights, ids = torch.rand(5, cfg.num_experts).topk(2, -1)
    want = experts_forward(x, w13, w2, weights, ids, activation="situ", beta=4.0)
    assert moe.hold_experts_tile_major() and not moe.hold_experts_tile_major()          # once
    t13, t2 = moe.expert_weights()
    assert isinstance(t13, TileMajorMXFP4) and isinstance(t2, TileMajorMXFP4) and t13.shape == w13.shape
    assert torch.equal(t13.dequantize(torch.bfloat16), w13.dequantize(torch.bfloat16))
    assert torch.equal(experts_forward(x, t13, t2, weights, ids, activation="situ", beta=4.0), want)
    assert expert_cache.hold_experts_dense(model) > 0
    dense13, _ = moe.expert_weights()
    assert torch.equal(dense13, w13.dequantize(torch.bfloat16))


def test_the_flag_reaches_the_engine_and_the_plan(tmp_path, capsys):
    import json

    from k3.cli.main import build_parser, main
    from k3.cli.serve import engine_config, resolve_arguments

    model = tmp_path / "k3-tiny"
    assert main(["checkpoint", "init", "--preset", "k3-tiny", "--out", str(model), "--config-only"]) == 0
    for extra, want in (([], None), (["--expert-cache", "on"], "on")):
        argv = ["serve", str(model), "--platform", "reference", *extra]
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        resolve_arguments(args, parser._commands[("command", "serve")])
        assert engine_config(args)[0].expert_cache == want
    capsys.readouterr()
    plans = {}
    for mode in ("off", "on"):
        assert main(["plan", "--preset", "k3-slice", "--gpu-memory", "139.8", "--max-model-len", "8448",
                     "--expert-cache", mode, "--json"]) == 0
        plans[mode] = json.loads(capsys.readouterr().out)
    assert plans["on"]["expert_cache"] and not plans["off"]["expert_cache"]
    assert plans["on"]["weight_terms"]["routed_experts"] > 3.7 * plans["off"]["weight_terms"]["routed_experts"]
    assert main(["plan", "--preset", "k3-slice", "--gpu-memory", "80", "--max-model-len", "8448",
                 "--expert-cache", "auto"]) == 0
    text = capsys.readouterr().out
    assert "held dense in the first " in text and " of 11 MoE layers, the expert cache" in text, text
