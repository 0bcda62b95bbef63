"""MLA prefill on torch's fused attention (platforms/torch_kernels/mla_prefill_sdpa.py)
against k3.reference.mla_prefill: ragged sequences, chunked prefill after a cached prefix
(queries are the last q_len kv tokens), an empty query span, fp32 and bf16; DSA selections
and float64 fall back to the reference."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels.mla_prefill_sdpa import mla_prefill

H, DN, DR, DV, R = 3, 16, 8, 12, 32


def _case(q_lens, kv_lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    args = (rnd(sum(q_lens), H, DN + DR), rnd(sum(kv_lens), R), rnd(sum(kv_lens), DR), rnd(H * (DN + DV), R) / R ** 0.5)
    kw = dict(cu_seqlens_q=cu(q_lens), cu_seqlens_kv=cu(kv_lens), scale=(DN + DR) ** -0.5, qk_nope_head_dim=DN,
              v_head_dim=DV)
    return args, kw


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_matches_the_reference(dtype, tol):
    args, kw = _case([7, 0, 20, 5], [7, 3, 45, 5], dtype)           # second: a span with no query; third: chunk
    got, want = mla_prefill(*args, **kw), ref.mla_prefill(*args, **kw)
    assert got.dtype == dtype and got.shape == want.shape
    assert ((got.double() - want.double()).norm() / want.double().norm()) < tol


def test_dsa_and_float64_fall_back():
    args, kw = _case([4], [9], torch.float32, seed=1)
    topk = torch.tensor([[0, 2, -1], [1, 5, 6], [0, 7, -1], [8, 3, 1]])
    torch.testing.assert_close(mla_prefill(*args, **kw, topk_indices=topk),
                               ref.mla_prefill(*args, **kw, topk_indices=topk), rtol=0, atol=0)
    args64 = tuple(a.double() for a in args)
    torch.testing.assert_close(mla_prefill(*args64, **kw), ref.mla_prefill(*args64, **kw), rtol=0, atol=0)
