"""AttnRes logit weights and MLA absorbed decode weights are folded once when the engine loads
the model (K3Model.fold_weights), not in every forward, and folding changes no output."""

import pytest
import torch

import k3.model.model as model_module
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tokenized_checkpoint):
    return tokenized_checkpoint("k3-tiny")


def _generate(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", load_progress=False, kv_cache_memory_gib=0.02))
    engine.add_request("r", list(range(30, 52)), SamplingParams(max_tokens=6, temperature=0, logprobs=2,
                                                                ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    completion = outs[0].outputs[0]
    return engine, completion.token_ids, completion.logprobs


def test_folded_queries_give_the_same_tokens_and_no_per_forward_folding(ckpt, monkeypatch):
    calls = []
    fold = model_module.ref.fold_attn_res_query
    monkeypatch.setattr(model_module.ref, "fold_attn_res_query", lambda *a: (calls.append(1), fold(*a))[1])
    engine, tokens, logprobs = _generate(ckpt)
    layers = engine.model.cfg.num_hidden_layers
    assert len(calls) == 2 * layers + 1                 # at load only: two mixes a layer and the output mix
    monkeypatch.setattr(model_module.K3Model, "fold_weights", lambda self: None)
    calls.clear()
    _, unfolded_tokens, unfolded_logprobs = _generate(ckpt)
    assert len(calls) > 2 * layers + 1                  # folded in every forward
    assert tokens == unfolded_tokens and logprobs == unfolded_logprobs


def test_replaced_weights_are_not_served_stale(ckpt):
    engine, _, _ = _generate(ckpt)
    inner = engine.model.model
    norm, proj = inner.output_attn_res_norm, inner.output_attn_res_proj
    assert torch.equal(inner._attn_res_query(norm, proj), norm.reshape(-1) * proj.reshape(-1))
    other = torch.randn_like(norm)
    assert torch.equal(inner._attn_res_query(other, proj), other.reshape(-1) * proj.reshape(-1))


def test_mla_absorbed_weights_are_split_at_load_only(ckpt, monkeypatch):
    import k3.model.mla as mla_module

    calls = []
    absorb = mla_module.ref.mla_absorb_weights
    monkeypatch.setattr(mla_module.ref, "mla_absorb_weights", lambda *a, **kw: (calls.append(1), absorb(*a, **kw))[1])
    engine, tokens, logprobs = _generate(ckpt)
    mla_layers = [m for m in engine.model.modules() if isinstance(m, mla_module.MLAMixer)]
    assert mla_layers and len(calls) == len(mla_layers)          # once per layer, at load
    monkeypatch.setattr(mla_module.MLAMixer, "fold_weights", lambda self: None)
    calls.clear()
    _, unfolded_tokens, unfolded_logprobs = _generate(ckpt)
    assert len(calls) > len(mla_layers)                          # split in every decode step
    assert tokens == unfolded_tokens and logprobs == unfolded_logprobs


def test_a_replaced_kv_b_proj_is_split_again(ckpt):
    import k3.model.mla as mla_module

    engine, _, _ = _generate(ckpt)
    layer = next(m for m in engine.model.modules() if isinstance(m, mla_module.MLAMixer))
    w_uk, w_uv = layer.absorbed_weights()
    assert w_uk is layer.absorbed_weights()[0]                   # the folded copy
    layer.kv_b_proj = torch.nn.Parameter(torch.randn_like(layer.kv_b_proj), requires_grad=False)
    fresh_uk, fresh_uv = layer.absorbed_weights()
    want_uk, want_uv = layer._absorb()
    assert torch.equal(fresh_uk, want_uk) and torch.equal(fresh_uv, want_uv) and not torch.equal(fresh_uk, w_uk)
