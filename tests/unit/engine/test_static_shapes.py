"""Static-shape buckets (`k3_shape_buckets`, `k3.engine.padding`): the engine pads every step
to the platform's buckets; padding sequences write only the scratch row (every other cache row
bit-identical to the unpadded step's), their logits are dropped, and the padded engine gives
the unpadded engine's tokens. The platform is the reference with its hook answer replaced (no
platform check in the core: any platform that answers the hook gets the same padding)."""

import pytest
import torch

from k3.engine.batch import build_metadata
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.padding import StepPadding
from k3.engine.params import SamplingParams
from k3.platform.facade import Platform
from k3.plugin.types import ShapeBuckets

BUCKETS = ShapeBuckets(batch=(2, 4, 8), tokens=(16, 32, 64))
PROMPTS = [[(13 * i + 7 * j) % 380 + 1 for j in range(n)] for i, n in enumerate((23, 5, 37, 9, 14))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3-tiny", tmp_path_factory.mktemp("static-k3-tiny"), progress=False)


def test_bucket_choice():
    assert (BUCKETS.batch_for(1), BUCKETS.batch_for(5), BUCKETS.batch_for(9)) == (2, 8, 16)
    assert (BUCKETS.tokens_for(16), BUCKETS.tokens_for(17), BUCKETS.tokens_for(100)) == (16, 32, 128)
    with pytest.raises(ValueError):
        ShapeBuckets(batch=(), tokens=(8,))
    pad = StepPadding(BUCKETS, scratch_row=0, block_size=16, max_pages=4)
    assert pad.shape(3, 3, all_decodes=True) == (4, 4)             # decodes: batch bucket only
    assert pad.shape(3, 20, all_decodes=False) == (4, 32)
    assert pad.shape(4, 16, all_decodes=False) == (4, 16)           # exact: no padding
    assert pad.shape(4, 20, all_decodes=False) == (8, 32)           # padding tokens need a padding sequence


def _engine(ckpt, monkeypatch, buckets, **kw):
    monkeypatch.setattr(Platform, "shape_buckets", lambda self, max_num_seqs, max_num_batched_tokens: buckets)
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, kv_cache_memory_gib=0.02,
                                  max_num_seqs=8, max_num_batched_tokens=48, enforce_eager=True, **kw))


def _generate(engine):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


def test_padded_engine_gives_the_unpadded_tokens_at_bucket_shapes(ckpt, monkeypatch):
    eager = _generate(_engine(ckpt, monkeypatch, None))
    engine = _engine(ckpt, monkeypatch, BUCKETS)
    shapes = []
    forward = engine.runner.model.__class__.__call__

    def recording(model, meta, views, **kw):
        shapes.append((meta.num_seqs, meta.num_tokens, meta.block_table.shape[1], meta.logits_indices.shape[0]))
        return forward(model, meta, views, **kw)

    monkeypatch.setattr(engine.runner.model.__class__, "__call__", recording)
    assert _generate(engine) == eager
    width = -(-engine.plan.max_model_len // engine.plan.block_size)
    assert shapes and all(n in BUCKETS.batch and w == width for n, _, w, _ in shapes)
    assert all(t in BUCKETS.tokens or t == n for n, t, _, _ in shapes)     # prefill chunks / decode steps
    assert any(t == n for n, t, _, _ in shapes) and any(t in BUCKETS.tokens for n, t, _, _ in shapes)


def _step_from(engine, ids):
    """A scheduled mixed step: requests `ids` decoding after their prefill, one more prefilling."""
    for i in ids:
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()                                   # prefill of the first ones
    engine.add_request("late", PROMPTS[4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    out = engine.scheduler.schedule()
    assert len(out.scheduled) == len(ids) + 1
    return out


def _run(engine, out, padding):
    step = build_metadata(out, block_size=engine.plan.block_size, device="cpu", padding=padding)
    with torch.no_grad():
        logits = engine.runner.model(step.meta, engine.cache.views, tap_layers=()).logits
    return step, logits


@pytest.mark.parametrize("into", ["scratch", "a request's row (control: must fail)", "a free row (control: must fail)"])
def test_padding_writes_only_the_scratch_row(ckpt, monkeypatch, into):
    """Rows the step's requests do not own stay bit-identical (free rows, other requests'); the
    step's own rows equal the unpadded step's to float64 rounding (a bigger batch changes GEMM
    blocking at ~1e-14; a stray padding write would be O(1) or NaN); so do the real logits."""
    engine = _engine(ckpt, monkeypatch, BUCKETS)
    out = _step_from(engine, [0, 1, 2])
    backing = engine.cache.backing
    scratch = engine.plan.graph_scratch_row
    own = sorted({r for s in out.scheduled for r in s.request.rows + [s.request.state_row]})
    free = [r for r in range(backing.shape[0]) if r not in own and r != scratch]
    target = {"scratch": scratch, "a request's row (control: must fail)": out.scheduled[0].request.rows[0]}.get(
        into, free[0])
    padding = StepPadding(BUCKETS, scratch_row=target, block_size=engine.plan.block_size,
                          max_pages=-(-engine.plan.max_model_len // engine.plan.block_size))
    backing[scratch] = 0xFF                          # NaN in every cache float format: garbage padding reads
    before = backing.clone()
    plain, want = _run(engine, out, None)
    after_plain = backing.clone()
    backing.copy_(before)
    padded, got = _run(engine, out, padding)
    assert (plain.meta.num_seqs, padded.meta.num_seqs) == (4, 8)          # 4 real sequences, 4 padding ones
    assert padded.meta.num_tokens in BUCKETS.tokens and padded.meta.num_tokens > plain.meta.num_tokens
    m = plain.meta.logits_indices.shape[0]
    free_same = torch.equal(backing[free], before[free])
    own_close = all(torch.allclose(backing[r].view(torch.float64), after_plain[r].view(torch.float64),
                                   rtol=1e-12, atol=1e-12, equal_nan=True) for r in own)
    if into == "scratch":
        assert free_same, "a padding sequence wrote into a row it does not own"
        assert own_close, "a padding sequence changed a row of the step's requests"
        assert not torch.equal(backing[scratch], before[scratch])        # the padding did write (there)
        torch.testing.assert_close(got[:m], want, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(got).all()
    else:
        assert not (free_same and own_close)                             # the check catches a stray write
