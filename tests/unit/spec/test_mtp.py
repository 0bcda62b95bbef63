"""The "mtp" speculative method: the checkpoint's own MTP layer drafts, the target verifies.

Exact greedy outputs with either KDA rollback; the MTP layer's math against an independent
float64 implementation (its MLA written out with einsum); the proposer's incremental, cached
drafts equal drafts recomputed from scratch over the whole sequence; clear errors for a
checkpoint without MTP layers or with a broken one; vLLM's checkpoint names load.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from k3 import reference as ref
from k3.cache.format import CacheFormat
from k3.cache.pool import CachePool
from k3.checkpoint.loader import CheckpointError
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams
from k3.engine.spec.config import SpeculativeConfigError
from k3.model import contiguous_block_table
from k3.model.metadata import ForwardMetadata
from k3.model.mtp import mtp_cache_config

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, list(range(20, 45))]
MTP = {"method": "mtp", "num_speculative_tokens": 3}
PAGE = 16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3-tiny-mtp", tmp_path_factory.mktemp("mtp") / "target", progress=False)


def _engine(path, spec=None, **kw):
    return LLMEngine(EngineConfig(model=str(path), dtype="float64", kv_cache_memory_gib=0.02, max_num_seqs=4,
                                  load_progress=False, speculative_config=spec, **kw))


def _run(engine, params, prompts=PROMPTS):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_greedy(target):
    return _run(_engine(target), SamplingParams(max_tokens=10, temperature=0))


@pytest.mark.parametrize("rollback", ["states", "recover"])
def test_greedy_outputs_are_exact(target, plain_greedy, rollback):
    engine = _engine(target, {**MTP, "kda_rollback": rollback})
    proposer = engine.strategy.proposer
    pages = proposer.pool.num_free
    assert _run(engine, SamplingParams(max_tokens=10, temperature=0)) == plain_greedy
    stats = engine.spec_stats()
    assert stats["spec_draft_tokens_total"] > 0 and len(stats["spec_acceptance_per_position"]) == 3
    assert engine.pool.num_free == engine.pool.num_rows and proposer.pool.num_free == pages and not proposer.seqs


def _mla(attn, cfg, h):
    """K3's gated NoPE MLA over one causal sequence h [T, d], written out (expanded form)."""
    heads, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank)
    q_a, kv, g = F.linear(h, attn.in_proj).split(attn.in_proj_split, -1)
    q = F.linear(ref.rms_norm(q_a, attn.q_a_layernorm, cfg.rms_norm_eps), attn.q_b_proj).view(-1, heads, dn + dr)
    c = ref.rms_norm(kv[:, :r], attn.kv_a_layernorm, cfg.rms_norm_eps)
    kvb = F.linear(c, attn.kv_b_proj).view(-1, heads, dn + dv)
    k = torch.cat([kvb[..., :dn], kv[:, None, r:].expand(-1, heads, dr)], -1)
    scores = torch.einsum("thd,shd->hts", q, k) * cfg.mla_softmax_scale
    t = h.shape[0]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), kvb[..., dn:]).reshape(t, heads * dv)
    return F.linear(o * torch.sigmoid(g), attn.o_proj)


def _fresh_mtp(layer, model, ids_next, hidden):
    """The MTP layer over positions 0.. of one sequence, one forward on a fresh cache: [T, d]."""
    cfg = mtp_cache_config(layer.cfg)
    pages = -(-len(ids_next) // PAGE)
    cache = CachePool(cfg, CacheFormat.build(cfg, activation_dtype=torch.float64, block_size=PAGE), pages)
    meta = ForwardMetadata.build([ids_next], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, pages), page_size=PAGE)
    return layer(meta.input_ids, hidden, meta, cache.views, embed=lambda ids: model.model.embed(ids, None))


def _target_hidden(model, tokens):
    """The target's pre-norm final hidden states [T, d] at every position of `tokens`."""
    pages = -(-len(tokens) // PAGE)
    cache = CachePool.for_model(model, 1 + pages, block_size=PAGE)
    meta = ForwardMetadata.build([tokens], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, pages) + 1, page_size=PAGE)
    return model(meta, cache.views).hidden_states


def test_mtp_layer_math_matches_an_independent_implementation(target):
    engine = _engine(target, MTP)
    layer, model = engine.strategy.proposer.layer, engine.model
    cfg, eps = layer.cfg, layer.cfg.rms_norm_eps
    tokens = PROMPTS[1][:20]
    hidden = _target_hidden(model, tokens)[:-1]                        # h_0 .. h_{T-2}
    ids_next = tokens[1:]                                              # t_1 .. t_{T-1}
    got = _fresh_mtp(layer, model, ids_next, hidden)

    e = model.model.embed_tokens[torch.tensor(ids_next)].clone()
    e[0] = 0                                                           # position 0's embedding is zeroed
    x = F.linear(torch.cat([ref.rms_norm(e, layer.enorm, eps), ref.rms_norm(hidden, layer.hnorm, eps)], -1),
                 layer.eh_proj)
    block = layer.block
    x = x + _mla(block.self_attn, cfg, ref.rms_norm(x, block.input_layernorm, eps))
    x = x + block.ffn(ref.rms_norm(x, block.post_attention_layernorm, eps))
    torch.testing.assert_close(got, x, rtol=0, atol=1e-10)
    logits = F.linear(ref.rms_norm(x, layer.shared_head_norm, eps), model.lm_head_weight)
    torch.testing.assert_close(layer.logits(got, model.lm_head_weight), logits, rtol=0, atol=1e-9)


def test_incremental_drafts_equal_drafts_recomputed_from_scratch(target):
    """Each proposal equals the drafts of the MTP layer run afresh over the whole sequence:
    draft 1 from the target's hidden states, draft j + 1 from one more position fed with draft j
    and the MTP output before it (so the cached rows, the pending features and the provisional
    chained rows are all what a full recompute gives)."""
    engine = _engine(target, MTP)
    proposer, model = engine.strategy.proposer, engine.model
    seen = []
    propose = proposer.propose_batch

    def recording(batch):
        out = propose(batch)
        seen.extend((list(r.all_token_ids), p.tokens) for (r, _), p in zip(batch, out) if p.tokens)
        return out

    proposer.propose_batch = recording
    _run(engine, SamplingParams(max_tokens=8, temperature=0))
    assert len(seen) >= 4
    for tokens, drafts in seen[:: max(1, len(seen) // 4)]:
        hidden = _target_hidden(model, tokens[:-1])                    # h_0 .. h_{n-2}
        ids_next = tokens[1:]
        expected = []
        for _ in drafts:
            x = _fresh_mtp(proposer.layer, model, ids_next, hidden)
            token = int(proposer.layer.logits(x[-1:], model.lm_head_weight).argmax())
            expected.append(token)
            ids_next, hidden = ids_next + [token], torch.cat([hidden, x[-1:]])
        assert drafts == expected


def test_a_checkpoint_without_mtp_layers_is_refused(tiny_checkpoint):
    with pytest.raises(SpeculativeConfigError, match="num_nextn_predict_layers = 0"):
        _engine(tiny_checkpoint("k3-tiny"), MTP, skip_tokenizer_init=True)


def test_a_missing_mtp_tensor_is_named(target, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in target.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v for k, v in load_file(f).items() if not k.endswith("layers.8.eh_proj.weight")}
            save_file(tensors, broken / f.name, metadata={"format": "pt"})
        else:
            (broken / f.name).write_bytes(f.read_bytes())
    index = broken / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.endswith("layers.8.eh_proj.weight")}
        index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"layers\.8\.eh_proj\.weight \(shape \[64, 128\]"):
        _engine(broken, MTP)
    # the target alone still loads: its MTP layer is not read without the method
    assert _engine(broken).model is not None


def test_the_target_skips_its_mtp_layer_and_the_mtp_loader_skips_the_target(target):
    from k3.checkpoint.loader import load_checkpoint

    engine = _engine(target, MTP)
    cfg = engine.model.cfg
    report = load_checkpoint(engine.strategy.proposer.layer, target, progress=False, part="mtp")
    assert report.skipped["text model"] > 0 and report.tensors_read > 0
    assert cfg.num_nextn_predict_layers == 1


def test_the_mtp_cache_comes_out_of_the_same_budget(target):
    """kv_cache_memory_gib bounds the target's cache and the MTP layer's cache together (on an
    accelerator the budget is what the weights leave, so planning the target alone fails the
    MTP allocation); the split still leaves the MTP cache a page per target token row."""
    budget = 0.02 * 2**30
    plain = _engine(target)
    engine = _engine(target, MTP)
    proposer = engine.strategy.proposer
    both = engine.cache.backing.numel() + proposer.cache.backing.numel()
    assert both <= budget * 1.01, f"{both} bytes of cache for a {budget:.0f}-byte budget"
    assert engine.cache.backing.numel() < plain.cache.backing.numel()
    assert proposer.cache.backing.shape[0] >= engine.plan.token_rows


def test_recover_rollback_with_bf16_activations(target):
    """The "recover" rollback's records are kept in the state dtype (float32) while bf16 activations
    come in: the verify pass casts them (it once failed on the dtype mismatch). Greedy output equals
    plain bf16 decoding of the same prompts."""
    def bf16(spec=None):
        return LLMEngine(EngineConfig(model=str(target), dtype="bfloat16", kv_cache_memory_gib=0.02, max_num_seqs=4,
                                      load_progress=False, speculative_config=spec))

    params = SamplingParams(max_tokens=6, temperature=0)
    engine = bf16({**MTP, "kda_rollback": "recover"})
    assert _run(engine, params) == _run(bf16(), params)
    assert engine.strategy.proposer is not None
