"""Extra forward outputs: pre-norm hidden state, layer taps, per-position KDA states, media
embeddings injected at placeholder tokens."""

import torch

from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_model
from k3.model import contiguous_block_table
from k3.model.metadata import ForwardMetadata


def _run(model, tokens, **kw):
    cache = CachePool.for_model(model, 3, block_size=16).views                # a state row, then 2 pages
    batch = ForwardMetadata.build([tokens], context_lens=[0], state_indices=[0],
                               block_table=contiguous_block_table(1, 2) + 1, page_size=16, all_logits=True)
    return model(batch, cache, **kw), cache


def test_hidden_taps_and_per_position_states(tiny_checkpoint):
    model = load_model(tiny_checkpoint("k3-tiny"), dtype=torch.float64, progress=False)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    out, cache = _run(model, tokens, tap_layers=(0, 5), per_position_kda_states=True)
    torch.testing.assert_close(out.logits, model.compute_logits(out.hidden_states), rtol=0, atol=0)
    assert set(out.taps) == {0, 5} and out.taps[5].shape == (len(tokens), model.cfg.hidden_size)
    assert set(out.kda_states) == set(model.cfg.kda_layer_ids)
    for i, layer in enumerate(model.cfg.kda_layer_ids):
        states = out.kda_states[layer]                        # [T, H, K, V]
        torch.testing.assert_close(states[-1], cache.kda[i].recurrent[0], rtol=0, atol=1e-12)
    plain, _ = _run(model, tokens)
    torch.testing.assert_close(plain.logits, out.logits, rtol=0, atol=1e-10)   # recurrent path == chunked


def test_media_placeholders_take_injected_embeddings(tiny_checkpoint):
    model = load_model(tiny_checkpoint("k3-tiny"), dtype=torch.float64, progress=False)
    media = model.cfg.media_placeholder_token_id
    tokens = [7, 8, 9, 10, 11, 12]
    injected = model.model.embed_tokens[[40, 41]].clone()
    with_media, _ = _run(model, [7, media, 9, media, 11, 12], media_embeds=injected)
    plain, _ = _run(model, [7, 40, 9, 41, 11, 12])
    torch.testing.assert_close(with_media.logits, plain.logits, rtol=0, atol=0)
    unchanged, _ = _run(model, tokens)
    assert not torch.allclose(unchanged.logits, plain.logits)


def test_a_backed_add_rms_norm_serves_the_plain_residual_stream(tiny_checkpoint):
    """Kimi-Linear's residual stream calls `elementwise.add_rms_norm` once a layer when a plugin
    backs it (AITER on AMD), and composes add + the served rms_norm when only the reference
    does; both give the same logits (the reference op is that composition)."""
    import dataclasses

    from k3 import reference as ref

    model = load_model(tiny_checkpoint("kimi-linear-tiny"), dtype=torch.bfloat16, progress=False)
    tokens = [3, 14, 15, 92, 65, 35, 89]
    plain, _ = _run(model, tokens)
    calls = []
    inner = model.model
    kernels = inner.kernels
    fused = dataclasses.replace(kernels.elementwise, add_rms_norm=lambda *a: calls.append(1) or ref.add_rms_norm(*a))
    inner.kernels = dataclasses.replace(kernels, elementwise=fused,
                                        providers={**kernels.providers, "elementwise.add_rms_norm": "vendor"})
    backed, _ = _run(model, tokens)
    assert len(calls) == model.cfg.num_hidden_layers
    torch.testing.assert_close(backed.logits, plain.logits, rtol=0, atol=0)
