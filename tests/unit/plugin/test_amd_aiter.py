"""The amd plugin's AITER wrappers (k3.platforms.amd.aiter_ops) without ROCm: the import guard and
opt-in, and the argument mapping onto AITER's Python API checked against a fake `aiter` module
whose functions compute what amd-aiter 0.1.7.post2.dev18's signatures and docstrings say the real
ones compute. That checks k3's mapping (layouts, EP ids, selection -> kv_indices), never AITER's
numerics: nothing here executes AITER (it cannot import without ROCm)."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from k3 import reference as ref
from k3.ops_helpers import masked_softmax
from k3.platforms.amd import aiter_ops, kernels
from k3.quant.mxfp4 import MXFP4Tensor, mxfp4_dequantize


def _fail(*a, **k):
    raise AssertionError("the fallback ran where the AITER path should have")


def _fake_aiter():
    """A stand-in for `aiter` computing each op's documented result in torch (float64)."""
    aiter = types.ModuleType("aiter")
    aiter.dtypes = types.SimpleNamespace(fp4x2=torch.uint8, fp8_e8m0=torch.uint8)
    aiter.ActivationType = types.SimpleNamespace(Silu="silu")
    aiter.QuantType = types.SimpleNamespace(per_1x32="per_1x32")
    shuffle = types.ModuleType("aiter.ops.shuffle")
    shuffle.shuffle_weight = lambda x, layout: x.clone()            # identity layout: the fake reads it plainly
    fp4 = types.ModuleType("aiter.utility.fp4_utils")
    fp4.e8m0_shuffle = lambda s: s.clone()

    def rmsnorm2d_fwd_with_add(out, x, residual_in, residual_out, weight, eps):
        residual_out.copy_(x + residual_in)
        r = residual_out.double()
        out.copy_(r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.double())

    def fused_moe(x, w1, w2, topk_weight, topk_ids, *, activation, quant_type, w1_scale, w2_scale):
        assert activation == "silu" and quant_type == "per_1x32"
        e, n, _ = w1.shape
        d1 = mxfp4_dequantize(w1, w1_scale.view(e, n, -1), dtype=torch.float64)
        d2 = mxfp4_dequantize(w2, w2_scale.view(e, w2.shape[1], -1), dtype=torch.float64)
        out = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(x.shape[0]):
            for i in range(topk_ids.shape[1]):
                gate, up = (d1[topk_ids[t, i]] @ x[t].double()).chunk(2)
                out[t] += topk_weight[t, i].double() * (d2[topk_ids[t, i]] @ (F.silu(gate) * up))
        return out.to(x.dtype)

    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, *,
                       sm_scale):
        assert kv_buffer.shape[1:3] == (1, 1) and max_seqlen_q == 1 and (kv_last_page_lens == 1).all()
        rows = kv_buffer[:, 0, 0].double()
        for b in range(qo_indptr.shape[0] - 1):
            kv = rows[kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()]
            for t in range(qo_indptr[b], qo_indptr[b + 1]):
                p = masked_softmax(q[t].double() @ kv.T * sm_scale, torch.ones(q.shape[1], kv.shape[0], dtype=torch.bool))
                o[t] = p @ kv[:, :o.shape[-1]]

    aiter.rmsnorm2d_fwd_with_add = rmsnorm2d_fwd_with_add
    aiter.fused_moe = fused_moe
    aiter.mla = types.SimpleNamespace(mla_decode_fwd=mla_decode_fwd)
    return aiter, {"aiter.ops": types.ModuleType("aiter.ops"), "aiter.ops.shuffle": shuffle,
                   "aiter.utility": types.ModuleType("aiter.utility"), "aiter.utility.fp4_utils": fp4}


@pytest.fixture
def fake(monkeypatch):
    """The fake `aiter` importable, torch looking like a ROCm build with a GPU, tensors of the
    CPU counted as the device's (the mapping runs on the CPU)."""
    aiter, submodules = _fake_aiter()
    monkeypatch.setitem(sys.modules, "aiter", aiter)
    for name, module in submodules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(aiter_ops, "DEVICE_TYPE", "cpu")
    monkeypatch.setenv(aiter_ops.ENV, "1")
    aiter_ops.load.cache_clear()
    aiter_ops._SHUFFLED.clear()
    yield aiter
    aiter_ops.load.cache_clear()


def test_the_guard_says_why_aiter_does_not_serve(monkeypatch):
    aiter_ops.load.cache_clear()
    monkeypatch.delenv(aiter_ops.ENV, raising=False)
    assert aiter_ops.status() == (False, f"{aiter_ops.ENV} is not set (AITER paths are opt-in: never executed)")
    monkeypatch.setenv(aiter_ops.ENV, "1")
    monkeypatch.setattr(torch.version, "hip", None)
    serves, reason = aiter_ops.status()
    assert not serves and "not a ROCm build" in reason
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "aiter", None)                  # `import aiter` raises ImportError
    aiter_ops.load.cache_clear()
    serves, reason = aiter_ops.status()
    assert not serves and "import aiter" in reason
    aiter_ops.load.cache_clear()


def test_aiter_entries_serve_only_when_opted_in_with_the_previous_entry_as_fallback(monkeypatch):
    monkeypatch.delenv(kernels.FLYDSL_ENV, raising=False)
    target = kernels.archs.ARCHS["gfx942"]
    monkeypatch.delenv(kernels.AITER_ENV, raising=False)
    before = kernels.table_entries("moe", target, lambda m: True)["experts"]
    monkeypatch.setenv(kernels.AITER_ENV, "1")
    served = kernels.table_entries("moe", target, lambda m: True)["experts"]
    assert served.func is aiter_ops.experts_forward and served.keywords["fallback"].func is before.func
    norm = kernels.table_entries("elementwise", target, lambda m: True)["add_rms_norm"]
    assert norm.func is aiter_ops.add_rms_norm and norm.keywords["fallback"] is ref.add_rms_norm
    assert "add_rms_norm" not in kernels.table_entries("elementwise", target, lambda m: m != "aiter")


def test_add_rms_norm_mapping(fake):
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 3, 64, generator=g).bfloat16(), torch.randn(2, 3, 64, generator=g).bfloat16()
    weight = torch.rand(64, generator=g).bfloat16()
    normed, total = aiter_ops.add_rms_norm(x, residual, weight, 1e-5, fallback=_fail)
    want_normed, want_total = ref.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, want_total) and normed.shape == x.shape
    assert (normed.float() - want_normed.float()).abs().max() <= 2e-2 * want_normed.float().abs().max()


def test_experts_mapping_under_expert_parallelism(fake):
    g = torch.Generator().manual_seed(1)
    el, inter, width = 3, 64, 64
    w13 = MXFP4Tensor(torch.randint(0, 256, (el, 2 * inter, width // 2), generator=g, dtype=torch.uint8),
                      torch.randint(120, 124, (el, 2 * inter, width // 32), generator=g).to(torch.uint8))
    w2 = MXFP4Tensor(torch.randint(0, 256, (el, width, inter // 2), generator=g, dtype=torch.uint8),
                     torch.randint(120, 124, (el, width, inter // 32), generator=g).to(torch.uint8))
    x = torch.randn(4, width, generator=g).bfloat16()
    ids = torch.tensor([[2, 3], [7, 4], [1, 5], [4, 4]])          # this rank: experts 2..4
    weights = torch.rand(4, 2, generator=g)
    got = aiter_ops.experts_forward(x, w13, w2, weights, ids, activation="silu", expert_start=2, fallback=_fail)
    want = ref.experts_forward(x.double(), w13, w2, weights.double(), ids, activation="silu", expert_start=2)
    assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max()
    situ = aiter_ops.experts_forward(x, w13, w2, weights, ids, activation="situ", beta=4.0,
                                     fallback=lambda *a, **k: "fallback")
    assert situ == "fallback"                                     # AITER has no SiTU


@pytest.mark.parametrize("topk, q_lens", [(None, None), (8, None), (None, (1, 2)), (8, (2, 1))])
def test_mla_decode_mapping(fake, topk, q_lens):
    from k3.conformance.cases.mla import decode_inputs

    g = torch.Generator().manual_seed(2)
    inputs = decode_inputs(g, torch.bfloat16, seq_lens=(30, 12), q_lens=q_lens, page_size=16, topk=topk, h=4, r=32,
                           dn=16, dr=8, dv=16)
    got = aiter_ops.mla_decode(*inputs.args, **inputs.kwargs, fallback=_fail)
    want = ref.mla_decode(*inputs.args, **inputs.kwargs)
    assert torch.isfinite(want).all()
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
