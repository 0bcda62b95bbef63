"""AttnRes logit weights are folded once when the engine loads the model (K3Model.fold_weights),
not in every forward, and folding changes no output."""

import pytest
import torch

import k3.model.model as model_module
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3-tiny", tmp_path_factory.mktemp("fold-k3-tiny"), progress=False)


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
