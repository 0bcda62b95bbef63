"""A third-party plugin in its own distribution (tests/plugins/k3-example-plugin) adds a
platform and overrides one kernel entry, only when its platform is selected. Its hooks check no
platform name and declare fewer arguments than the hookspecs offer (`k3_elementwise_kernels()`,
`k3_allocate_cache(num_rows, row_bytes, alignment)`): pluggy passes only what they name."""

from importlib.metadata import PackageNotFoundError, version

import pytest
import torch

from k3.cli.main import main
from k3.platform import select_platform

try:
    version("k3-example-plugin")
except PackageNotFoundError:
    pytest.skip("k3-example-plugin is not installed: pip install -e tests/plugins/k3-example-plugin",
                allow_module_level=True)

import k3_example_plugin  # noqa: E402


def test_example_is_listed_with_its_distribution():
    platform = select_platform()
    record = platform.records["example"]
    assert (record.distribution, record.version, record.registered) == ("k3-example-plugin", "0.1.0", True)
    assert record.hooks == ["k3_allocate_cache", "k3_capabilities", "k3_config_defaults", "k3_detect_platform",
                            "k3_elementwise_kernels", "k3_kda_state_layout"]
    assert not record.detection.available and record.detection.forceable
    assert platform.name != "example"                                     # never auto-detected
    assert set(platform.kernels.providers.values()) == {"reference"}      # and never disturbs another platform
    assert record.blocked and platform.config_defaults() == {}             # a losing platform plugin is not asked


def test_forced_example_provides_rms_norm_and_a_tiny_model_runs(tiny_checkpoint):
    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_checkpoint
    from k3.config import K3Config
    from k3.model import contiguous_block_table
    from k3.model.metadata import ForwardMetadata

    platform = select_platform("example")
    assert platform.info.forced and platform.info.distribution == "k3-example-plugin"
    assert platform.capabilities.vendor == "example" and platform.config_defaults() == {"max_num_seqs": 4}
    providers = platform.kernels.providers
    assert providers["elementwise.rms_norm"] == "example"
    assert {p for key, p in providers.items() if key != "elementwise.rms_norm"} == {"reference"}

    cfg = K3Config.preset("k3-tiny")
    model = platform.build_model(cfg, dtype=torch.float64)
    load_checkpoint(model, tiny_checkpoint("k3-tiny"), progress=False)
    cache = CachePool.for_model(model, 2, block_size=16, platform=platform).views     # a state row, a page
    meta = ForwardMetadata.build([[1, 2, 3]], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, 1) + 1, page_size=16)
    before = k3_example_plugin.calls["rms_norm"]
    logits = model(meta, cache).logits
    assert torch.isfinite(logits).all() and k3_example_plugin.calls["rms_norm"] > before

    from k3.model.model import K3ForCausalLM

    reference = K3ForCausalLM(cfg, dtype=torch.float64)
    load_checkpoint(reference, tiny_checkpoint("k3-tiny"), progress=False)
    ref_cache = CachePool.for_model(reference, 2, block_size=16).views
    assert torch.equal(reference(meta, ref_cache).logits, logits)        # same function, other provider


def test_k3_platform_example_and_cli(capsys, monkeypatch):
    monkeypatch.setenv("K3_PLATFORM", "example")
    assert select_platform().name == "example"
    assert main(["plugins", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["selected"]["distribution"] == "k3-example-plugin"
    assert data["kernels"]["elementwise.rms_norm"] == {"provider": "example", "fallback": False}
    assert data["kernels"]["kda.chunked"] == {"provider": "reference", "fallback": True}


def _greedy(engine, prompts):
    from k3.engine.params import SamplingParams

    out = []
    for i, p in enumerate(prompts):                 # one after another: later prompts hit the prefix cache
        engine.add_request(f"q{i}", p, SamplingParams(max_tokens=6, temperature=0))
        while engine.has_unfinished_requests():
            out += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    return out


def test_engine_on_the_example_cache_allocation_and_transposed_state_rows(tiny_checkpoint):
    """The engine takes its cache from the platform (`k3_allocate_cache`, 4 KiB alignment from the
    capabilities) with KDA state rows stored transposed (`k3_kda_state_layout` "hvk"): greedy
    tokens equal the reference platform's, with prefix caching (row copies, state checkpoints)
    and speculative decoding (scratch state rows) on."""
    from k3.engine.engine import EngineConfig, LLMEngine

    path = tiny_checkpoint("k3.1-pro-tiny")
    shared = [(7 * i) % 300 + 1 for i in range(90)]
    prompts = [shared, shared[:70] + [5, 6, 7, 8], [1, 2, 3, 1, 2, 3, 1, 2, 3]]
    outputs = {}
    for name in ("reference", "example"):
        before = k3_example_plugin.calls["allocate_cache"]
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float64", kv_cache_memory_gib=0.02, max_num_seqs=4,
                                        block_size=16, enable_prefix_caching=True, prefix_match_unit=16, kda_checkpoint_interval=16,
                                        load_progress=False, platform=name,
                                        speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                            "kda_rollback": "states"}))
        view = engine.cache.views.kda[0]
        if name == "example":
            assert k3_example_plugin.calls["allocate_cache"] == before + 1
            assert view.layout == "hvk" and engine.cache.backing.data_ptr() % 4096 == 0
            assert engine.plan.layout.row_bytes % 4096 == 0
            assert view.stored().stride(-1) == 1 and view.recurrent.stride(-2) == 1     # stored transposed
        else:
            assert view.layout == "hkv" and view.recurrent.stride(-1) == 1
        outputs[name] = _greedy(engine, prompts)
        assert engine.prefix_cache_stats()["prefix_cache_hits_total"] >= 1
    assert outputs["example"] == outputs["reference"]


def test_a_bad_cache_allocation_names_the_plugin(monkeypatch):
    platform = select_platform("example")
    monkeypatch.setattr(k3_example_plugin, "CACHE_ALIGNMENT", 4096)
    monkeypatch.setattr(platform._pm.hook, "k3_allocate_cache", lambda **kw: torch.zeros(3, 4096))
    with pytest.raises(RuntimeError, match="k3_allocate_cache on platform 'example'.*expected uint8"):
        platform.allocate_cache(3, 4096)
    with pytest.raises(ValueError, match="not a multiple of the cache alignment"):
        platform.allocate_cache(3, 1000)
