"""AttnRes: worked example, and the fused kernel contract == the official mix-then-append order."""

import math

import pytest
import torch

from k3.reference.attn_res import attn_res, attn_res_mix, fold_attn_res_query
from k3.reference.norms import rms_norm


def test_worked_example():
    # k3-model-math.md 2.4: blocks [[1,0],[0,2]], partial [1,1], gamma [1,1], w [0.5,-0.5]
    sources = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]], [[1.0, 1.0]]], dtype=torch.float64)
    u = fold_attn_res_query(torch.ones(2, dtype=torch.float64), torch.tensor([[0.5, -0.5]], dtype=torch.float64))
    mix = attn_res_mix(sources, u, eps=1e-12)
    torch.testing.assert_close(mix[0], torch.tensor([0.85997, 0.56406], dtype=torch.float64), atol=1e-5, rtol=0)


def test_keys_are_normalised_values_raw():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    u = torch.randn(16, generator=g, dtype=torch.float64)
    scaled = src.clone()
    scaled[1] *= 7.0          # scaling a source leaves its logit unchanged, but not its value
    p_logits = lambda s: (s / s.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()) @ u
    expected = (torch.softmax(p_logits(src), 0).unsqueeze(-1) * scaled).sum(0)
    torch.testing.assert_close(attn_res_mix(scaled, u, eps=1e-12), expected, rtol=1e-12, atol=1e-12)


def _official_order(x0, sublayers, queries, norms, block, eps):
    """The official HF form: mix first, at a block boundary append the partial and reset."""
    blocks, partial, outs = [], None, []
    for l, (mixer, ffn) in enumerate(sublayers):
        if l == 0:
            h = x0
            blocks.append(x0)
            reset = True
        else:
            h = attn_res_mix(torch.stack(blocks + [partial]), queries[l][0], eps=eps)
            reset = l % block == 0
            if reset:
                blocks.append(partial)
        a = mixer(rms_norm(h, norms[l][0], eps))
        partial = a if reset else partial + a
        h = attn_res_mix(torch.stack(blocks + [partial]), queries[l][1], eps=eps)
        f = ffn(rms_norm(h, norms[l][1], eps))
        partial = partial + f
        outs.append(f)
    final = attn_res_mix(torch.stack(blocks + [partial]), queries[-1], eps=eps)
    return outs, final


def _fused_contract(x0, sublayers, queries, norms, block, eps):
    """vLLM's kernel sequence: prefix += delta, block write at l % block == 0, mix + norm."""
    t, d = x0.shape
    nl = len(sublayers)
    bank = torch.full((t, math.ceil(nl / block), d), float("nan"), dtype=x0.dtype)  # poisoned
    prefix, delta, outs = x0, None, []
    for l, (mixer, ffn) in enumerate(sublayers):
        write = l // block if l % block == 0 else None
        n = math.ceil(l / block)
        step = attn_res(prefix, delta, bank, query=queries[l][0], num_visible_blocks=n,
                        write_index=write, eps=eps, out_norm_weight=norms[l][0], out_eps=eps)
        h, prefix = step.h, step.prefix
        a = mixer(h)
        prefix = a if l % block == 0 else prefix + a
        m = n + (1 if l % block == 0 else 0)
        step = attn_res(prefix, None, bank, query=queries[l][1], num_visible_blocks=m,
                        write_index=None, eps=eps, out_norm_weight=norms[l][1], out_eps=eps)
        h, prefix = step.h, step.prefix
        delta = ffn(h)
        outs.append(delta)
    prefix = prefix + delta
    nb = math.ceil(nl / block)
    sources = torch.cat([bank.transpose(0, 1), prefix.unsqueeze(0)])
    return outs, attn_res_mix(sources[: nb + 1], queries[-1], eps=eps)


@pytest.mark.parametrize("layers,block", [(7, 3), (6, 3), (5, 12), (12, 4)])
def test_fused_contract_equals_official_order(layers, block):
    g = torch.Generator().manual_seed(layers * 100 + block)
    t, d, eps = 4, 8, 1e-5
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    mats = [(rnd(d, d) / d ** 0.5, rnd(d, d) / d ** 0.5) for _ in range(layers)]
    sublayers = [(lambda x, w=w1: torch.tanh(x @ w), lambda x, w=w2: torch.tanh(x @ w)) for w1, w2 in mats]
    queries = [(rnd(d), rnd(d)) for _ in range(layers)] + [rnd(d)]
    norms = [(1 + 0.1 * rnd(d), 1 + 0.1 * rnd(d)) for _ in range(layers)]
    x0 = rnd(t, d)
    ref_outs, ref_final = _official_order(x0, sublayers, queries, norms, block, eps)
    outs, final = _fused_contract(x0, sublayers, queries, norms, block, eps)
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, ref_final, rtol=0, atol=1e-12)


def test_bf16_prefix_is_rounded_after_add():
    g = torch.Generator().manual_seed(1)
    prefix = torch.randn(3, 8, generator=g).bfloat16()
    delta = torch.randn(3, 8, generator=g).bfloat16()
    bank = torch.empty(3, 1, 8, dtype=torch.bfloat16)
    step = attn_res(prefix, delta, bank, query=torch.randn(8, generator=g), num_visible_blocks=0,
                    write_index=0, eps=1e-5, out_norm_weight=None, out_eps=1e-5)
    h, new_prefix = step.h, step.prefix
    assert new_prefix.dtype == torch.bfloat16
    torch.testing.assert_close(new_prefix, (prefix.float() + delta.float()).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(bank[:, 0], new_prefix, rtol=0, atol=0)
    torch.testing.assert_close(h, new_prefix, rtol=0, atol=0)


def test_bad_shapes():
    with pytest.raises(ValueError, match="sources"):
        attn_res_mix(torch.randn(3, 4), torch.randn(4), eps=1e-5)
