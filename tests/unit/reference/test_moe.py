"""Router, routed experts and Stable LatentMoE against independent straightforward loops. The
routed experts are checked on both implementations: the naive oracle (k3.reference) and the
torch kernel the reference platform serves (k3.platforms.torch_kernels)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import moe_experts as torch_experts
from k3.quant.mxfp4 import MXFP4Tensor
from k3.reference.moe import (
    glu_mlp, latent_moe, latent_moe_finish, latent_moe_routed_partial, router_logits, select_experts,
)  # fmt: skip

F64 = torch.float64
ACT = dict(activation="situ", beta=4.0, linear_beta=25.0)  # K3's SiTU
IMPLS = {"reference": SimpleNamespace(experts_forward=ref.experts_forward),
         "torch": SimpleNamespace(experts_forward=torch_experts.experts_forward)}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


# ---------------------------------------------------------------- router


def test_router_worked_example():
    chosen = select_experts(
        torch.tensor([[2.0, 0.0, -1.0, 1.0]]), top_k=2, correction_bias=torch.tensor([0.0, 0.5, 2.0, 0.0])
    )
    w, ids = chosen.weights, chosen.ids
    assert ids.dtype == torch.int64 and ids.tolist() == [[2, 1]]
    assert w.dtype == torch.float32
    assert w[0].tolist() == pytest.approx([0.3498, 0.6502], abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64], ids=str)
def test_router_logits_dtype(dtype):
    g = _gen(1)
    h, wg = torch.randn(5, 32, generator=g).to(dtype), torch.randn(8, 32, generator=g).to(dtype)
    out = router_logits(h, wg)
    want = F64 if dtype == F64 else torch.float32
    assert out.dtype == want and out.shape == (5, 8)
    assert torch.equal(out, h.to(want) @ wg.to(want).T)


def _plain_topk(logits, bias, k):
    """Independent: sigmoid, sort by s + bias (Python), unbiased weights renormalised."""
    ws, ids = [], []
    for row in logits.tolist():
        s = [1 / (1 + math.exp(-v)) for v in row]
        order = sorted(range(len(row)), key=lambda e: -(s[e] + float(bias[e])))[:k]
        tot = sum(s[e] for e in order)
        ids.append(order)
        ws.append([s[e] / (tot + 1e-20) for e in order])
    return ws, ids


@pytest.mark.parametrize("e,k,groups", [(64, 8, 1), (64, 8, 4), (896, 16, 1)],
                         ids=["E64k8g1", "E64k8g4", "E896k16g1"])
def test_grouped_topk_noop_equals_plain_topk(e, k, groups):
    g = _gen(2)
    logits, bias = torch.randn(9, e, generator=g, dtype=F64), torch.randn(e, generator=g, dtype=F64) * 0.1
    want_w, want_ids = _plain_topk(logits, bias, k)
    # one group of everything, or every group kept: both are plain top-k
    chosen = select_experts(logits, top_k=k, correction_bias=bias, num_expert_group=groups, topk_group=groups)
    w, ids = chosen.weights, chosen.ids
    assert ids.tolist() == want_ids
    assert torch.allclose(w, torch.tensor(want_w, dtype=F64), rtol=1e-12, atol=0)


def test_grouped_topk_hand_built():
    # 4 groups of 2. Group top-2 sums: g0 0.95+0.05, g1 0.70+0.65, g2 0.60+0.62, g3 0.1+0.1.
    p = [0.95, 0.05, 0.70, 0.65, 0.60, 0.62, 0.10, 0.10]
    logits = torch.tensor([[_logit(v) for v in p]], dtype=F64)
    plain = select_experts(logits, top_k=3).ids
    assert plain.tolist() == [[0, 2, 3]]
    chosen = select_experts(logits, top_k=3, num_expert_group=4, topk_group=2)
    w, ids = chosen.weights, chosen.ids
    assert ids.tolist() == [[2, 3, 5]]  # group 0 is dropped although expert 0 scores highest
    assert w[0].tolist() == pytest.approx([0.70 / 1.97, 0.65 / 1.97, 0.62 / 1.97], rel=1e-12)
    # the bias acts on the group score too: lifting group 3 makes it a kept group
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0.7, 0.7], dtype=F64)  # selection 0.8, 0.8
    chosen = select_experts(logits, top_k=3, correction_bias=bias, num_expert_group=4, topk_group=2)
    w, ids = chosen.weights, chosen.ids
    assert sorted(ids[0].tolist()[:2]) == [6, 7] and ids[0, 2].item() == 2
    assert w[0].tolist() == pytest.approx([0.1 / 0.9, 0.1 / 0.9, 0.7 / 0.9], rel=1e-12)


def test_softmax_scoring_and_scaling():
    g = _gen(3)
    logits = torch.randn(6, 16, generator=g, dtype=F64)
    probs = torch.softmax(logits, dim=-1)
    chosen = select_experts(logits, top_k=4, scoring="softmax", renormalize=False, routed_scaling_factor=2.5)
    w, ids = chosen.weights, chosen.ids
    want_ids = probs.argsort(dim=-1, descending=True)[:, :4]
    assert torch.equal(ids, want_ids)
    assert torch.allclose(w, probs.gather(1, want_ids) * 2.5, rtol=1e-14, atol=0)
    chosen = select_experts(logits, top_k=4, scoring="softmax", routed_scaling_factor=2.5)
    w2, ids2 = chosen.weights, chosen.ids
    assert torch.equal(ids2, want_ids)
    assert torch.allclose(w2.sum(-1), torch.full((6,), 2.5, dtype=F64), rtol=1e-14, atol=0)


def test_sigmoid_without_renormalize_uses_unbiased_scores():
    g = _gen(4)
    logits, bias = torch.randn(4, 12, generator=g), torch.randn(12, generator=g)
    chosen = select_experts(logits, top_k=3, correction_bias=bias, renormalize=False)
    w, ids = chosen.weights, chosen.ids
    sel = torch.sigmoid(logits) + bias
    assert torch.equal(ids, sel.topk(3, dim=-1).indices)
    assert torch.equal(w, torch.sigmoid(logits).gather(1, ids))


def test_router_bad_inputs_raise():
    x = torch.randn(3, 8, generator=_gen(5))
    with pytest.raises(ValueError, match="correction_bias"):
        select_experts(x, top_k=2, correction_bias=torch.zeros(7))
    with pytest.raises(ValueError, match="top_k"):
        select_experts(x, top_k=9)
    with pytest.raises(ValueError, match="num_expert_group"):
        select_experts(x, top_k=2, num_expert_group=3, topk_group=1)
    with pytest.raises(ValueError, match="scoring"):
        select_experts(x, top_k=2, scoring="relu")
    with pytest.raises(ValueError, match="weight"):
        router_logits(x, torch.zeros(4, 7))


# ---------------------------------------------------------------- experts


def _experts(e, inter, l, seed, dtype=F64):
    g = _gen(seed)
    w13 = torch.randn(e, 2 * inter, l, generator=g, dtype=F64) / math.sqrt(l)
    w2 = torch.randn(e, l, inter, generator=g, dtype=F64) / math.sqrt(inter)
    return w13.to(dtype), w2.to(dtype)


def _routing(t, e, k, seed):
    g = _gen(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k] distinct
    return torch.rand(t, k, generator=g, dtype=F64) + 0.1, ids


def _glu(h13, activation, beta=4.0, lin=25.0):
    """Scalar-loop GLU of a [2I] float64 vector -> [I] (first half gate)."""
    i = h13.shape[0] // 2
    out = []
    for gv, uv in zip(h13[:i].tolist(), h13[i:].tolist()):
        if activation == "silu":
            out.append(gv / (1 + math.exp(-gv)) * uv)
        else:
            out.append(beta * math.tanh(gv / beta) / (1 + math.exp(-gv)) * lin * math.tanh(uv / lin))
    return torch.tensor(out, dtype=F64)


def _loop_experts(x, w13, w2, tw, ids, activation):
    """Per-token, per-expert Python loop (float64)."""
    out = torch.zeros_like(x, dtype=F64)
    for t in range(x.shape[0]):
        for wt, e in zip(tw[t].tolist(), ids[t].tolist()):
            out[t] += wt * (w2[e].double() @ _glu(w13[e].double() @ x[t].double(), activation))
    return out


@pytest.mark.parametrize("activation", ["situ", "silu"])
@pytest.mark.parametrize("t,l,e,inter,k", [(7, 32, 6, 16, 3), (3, 16, 4, 8, 1)],
                         ids=["T7L32E6I16k3", "T3L16E4I8k1"])
def test_experts_forward_vs_loop(t, l, e, inter, k, activation, impl):
    x = torch.randn(t, l, generator=_gen(6), dtype=F64)
    w13, w2 = _experts(e, inter, l, seed=7)
    tw, ids = _routing(t, e, k, seed=8)
    got = impl.experts_forward(x, w13, w2, tw, ids, activation=activation, beta=4.0, linear_beta=25.0)
    assert got.dtype == F64 and got.shape == (t, l)
    assert torch.allclose(got, _loop_experts(x, w13, w2, tw, ids, activation), rtol=1e-12, atol=1e-12)


class _RecordingMX(MXFP4Tensor):
    """MXFP4Tensor that records which experts were dequantised."""

    def dequantize(self, dtype=torch.float32, index=None):
        self.seen = getattr(self, "seen", []) + [index]
        return super().dequantize(dtype, index=index)


def test_mxfp4_experts_equal_their_dequantised_dense_weights(impl):
    t, l, e, inter, k = 6, 64, 8, 32, 2
    x = torch.randn(t, l, generator=_gen(9), dtype=F64)
    w13, w2 = _experts(e, inter, l, seed=10, dtype=torch.float32)
    q13, q2 = _RecordingMX.from_float(w13), _RecordingMX.from_float(w2)
    tw, ids = _routing(t, e - 1, k, seed=11)
    ids = ids + (ids >= 5).long()  # expert 5 receives no token
    want = impl.experts_forward(x, q13.dequantize(F64), q2.dequantize(F64), tw, ids, **ACT)
    q13.seen, q2.seen = [], []
    assert torch.equal(impl.experts_forward(x, q13, q2, tw, ids, **ACT), want)
    used = sorted(set(ids.reshape(-1).tolist()))
    assert sorted(q13.seen) == used and sorted(q2.seen) == used  # one expert at a time, 5 never


@pytest.mark.parametrize("ranks", [2, 4], ids=lambda r: f"ep{r}")
def test_expert_parallel_partials_sum_to_whole(ranks, impl):
    t, l, e, inter, k = 9, 32, 8, 16, 3
    x = torch.randn(t, l, generator=_gen(12), dtype=F64)
    w13, w2 = _experts(e, inter, l, seed=13)
    tw, ids = _routing(t, e, k, seed=14)
    whole = impl.experts_forward(x, w13, w2, tw, ids, **ACT)
    n = e // ranks
    shard = [slice(r * n, (r + 1) * n) for r in range(ranks)]
    parts = [impl.experts_forward(x, w13[sl], w2[sl], tw, ids, expert_start=sl.start, **ACT) for sl in shard]
    assert torch.allclose(sum(parts), whole, rtol=1e-12, atol=1e-12)
    far = impl.experts_forward(x, w13[:n], w2[:n], tw, ids, expert_start=e, **ACT)  # holds no routed id
    assert (far == 0).all()


def test_experts_bf16_close_to_fp32(impl):
    t, l, e, inter, k = 8, 64, 4, 32, 2
    x = torch.randn(t, l, generator=_gen(15)).bfloat16()
    w13, w2 = _experts(e, inter, l, seed=16, dtype=torch.bfloat16)
    tw, ids = _routing(t, e, k, seed=17)
    out = impl.experts_forward(x, w13, w2, tw.float(), ids, **ACT)
    ref = impl.experts_forward(x.double(), w13.double(), w2.double(), tw, ids, **ACT)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_experts_bad_inputs_raise(impl):
    x = torch.randn(4, 16, generator=_gen(18))
    w13, w2 = _experts(3, 8, 16, seed=19, dtype=torch.float32)
    tw, ids = _routing(4, 3, 2, seed=20)
    with pytest.raises(ValueError, match="w2"):
        impl.experts_forward(x, w13, w2[:, :, :4], tw, ids, activation="silu")
    with pytest.raises(ValueError, match="w13"):
        impl.experts_forward(x, w13[:, :, :8], w2, tw, ids, activation="silu")
    with pytest.raises(ValueError, match="topk_ids"):
        impl.experts_forward(x, w13, w2, tw, ids[:, :1], activation="silu")
    with pytest.raises(ValueError, match="beta"):
        impl.experts_forward(x, w13, w2, tw, ids, activation="situ")


# ---------------------------------------------------------------- LatentMoE


def _block(d, l, e, inter, i_s, seed, dtype=F64):
    """Random LatentMoE weights (float64 master copy, cast to dtype)."""
    g = _gen(seed)

    def r(*shape, scale):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)

    w13, w2 = _experts(e, inter, l, seed=seed + 1, dtype=dtype)
    return dict(
        gate_weight=r(e, d, scale=d**-0.5), correction_bias=r(e, scale=0.1).float(), w13=w13, w2=w2,
        down_weight=r(l, d, scale=d**-0.5), up_weight=r(d, l, scale=l**-0.5),
        latent_norm_weight=(torch.rand(l, generator=g, dtype=F64) + 0.5).to(dtype),
        shared_gate_up=r(2 * i_s, d, scale=d**-0.5), shared_down=r(d, i_s, scale=i_s**-0.5),
    )  # fmt: skip


ROUTING = dict(top_k=3, scoring="sigmoid", renormalize=True, routed_scaling_factor=1.5, num_expert_group=1,
               topk_group=1, **ACT)  # fmt: skip


def _straightforward_latent_moe(h, p, *, top_k, routed_scaling_factor, eps=1e-5, **_):
    """Independent float64 LatentMoE (SiTU 4 / 25), one token at a time (k3-architecture 2.7)."""
    w = {k: v.double() for k, v in p.items()}
    out = []
    for x in h.double():
        s = torch.sigmoid(w["gate_weight"] @ x).tolist()
        bias = w["correction_bias"].tolist()
        chosen = sorted(range(len(s)), key=lambda e: -(s[e] + bias[e]))[:top_k]
        tot = sum(s[e] for e in chosen)
        z = w["down_weight"] @ x
        experts = [w["w2"][e] @ _glu(w["w13"][e] @ z, "situ") for e in chosen]
        u = sum(s[e] / tot * routed_scaling_factor * r for e, r in zip(chosen, experts))
        y_lat = u / torch.sqrt((u * u).mean() + eps) * w["latent_norm_weight"]
        shared = w["shared_down"] @ _glu(w["shared_gate_up"] @ x, "situ")
        out.append(w["up_weight"] @ y_lat + shared)
    return torch.stack(out)


@pytest.mark.parametrize("t,d,l,e,inter,i_s", [(5, 48, 32, 8, 16, 24), (2, 32, 16, 6, 8, 8)],
                         ids=["T5D48L32E8I16Is24", "T2D32L16E6I8Is8"])  # fmt: skip
def test_latent_moe_vs_straightforward(t, d, l, e, inter, i_s):
    p = _block(d, l, e, inter, i_s, seed=21)
    h = torch.randn(t, d, generator=_gen(22), dtype=F64)
    got = latent_moe(h, **p, **ROUTING)
    assert got.dtype == F64 and got.shape == (t, d)
    assert torch.allclose(got, _straightforward_latent_moe(h, p, **ROUTING), rtol=1e-10, atol=1e-10)


def test_plain_moe_without_latent_projections(impl):
    p = _block(32, 32, 6, 16, 8, seed=23)
    h = torch.randn(4, 32, generator=_gen(24), dtype=F64)
    plain = {k: v for k, v in p.items() if k not in ("down_weight", "up_weight", "latent_norm_weight")}
    got = latent_moe(h, **plain, **dict(ROUTING, top_k=2))
    logits = router_logits(h, p["gate_weight"])
    chosen = select_experts(logits, top_k=2, correction_bias=p["correction_bias"], routed_scaling_factor=1.5)
    w, ids = chosen.weights, chosen.ids
    want = impl.experts_forward(h, p["w13"], p["w2"], w, ids, **ACT)
    want = want + glu_mlp(h, p["shared_gate_up"], p["shared_down"], **ACT)
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-13)


def test_parallel_split_matches_whole():
    """EP ranks' latent partials and TP shards of the shared expert, reduced, then finished."""
    d, l, e, inter, i_s = 32, 16, 8, 8, 16
    p = _block(d, l, e, inter, i_s, seed=25)
    h = torch.randn(6, d, generator=_gen(26), dtype=F64)
    whole = latent_moe(h, **p, **ROUTING)
    routed = {k: p[k] for k in ("gate_weight", "correction_bias", "down_weight")}
    ep = (slice(0, 4), slice(4, 8))  # two EP ranks of 4 experts
    partials = [latent_moe_routed_partial(h, w13=p["w13"][sl], w2=p["w2"][sl], expert_start=sl.start,
                                          **routed, **ROUTING) for sl in ep]  # fmt: skip
    u = partials[0] + partials[1]
    gate, up = p["shared_gate_up"][:i_s], p["shared_gate_up"][i_s:]
    tp = (slice(0, i_s // 2), slice(i_s // 2, i_s))  # two TP shards of the shared intermediate
    shared = sum(glu_mlp(h, torch.cat([gate[sl], up[sl]]), p["shared_down"][:, sl], **ACT) for sl in tp)
    got = latent_moe_finish(
        u, up_weight=p["up_weight"], latent_norm_weight=p["latent_norm_weight"], shared_out=shared
    )
    assert torch.allclose(got, whole, rtol=1e-12, atol=1e-12)


def test_latent_moe_mxfp4_experts_equal_dequantised():
    p = _block(32, 32, 4, 32, 8, seed=27, dtype=torch.float32)
    h = torch.randn(5, 32, generator=_gen(28))
    q = dict(p, w13=MXFP4Tensor.from_float(p["w13"]), w2=MXFP4Tensor.from_float(p["w2"]))
    dq = dict(p, w13=q["w13"].dequantize(torch.float32), w2=q["w2"].dequantize(torch.float32))
    assert torch.equal(latent_moe(h, **q, **ROUTING), latent_moe(h, **dq, **ROUTING))


def test_latent_moe_bf16_within_tolerance():
    p = _block(64, 32, 8, 32, 32, seed=29, dtype=torch.bfloat16)
    h = torch.randn(8, 64, generator=_gen(30)).bfloat16()
    out = latent_moe(h, **p, **ROUTING)
    # same bf16 values in fp32: identical fp32 router logits, so identical expert choice
    ref = latent_moe(h.float(), **{k: v.float() for k, v in p.items()}, **ROUTING)
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err.item() < 2e-2


def test_latent_moe_bad_inputs_raise():
    p = _block(32, 16, 4, 8, 8, seed=31)
    h = torch.randn(3, 32, generator=_gen(32), dtype=F64)
    with pytest.raises(ValueError, match="down_weight"):
        latent_moe(h, **dict(p, up_weight=None), **ROUTING)
    with pytest.raises(ValueError, match="shared_down"):
        latent_moe(h, **dict(p, shared_down=None), **ROUTING)
    with pytest.raises(ValueError, match="gate_weight"):
        latent_moe(h, **dict(p, gate_weight=p["gate_weight"][:, :8]), **ROUTING)
    with pytest.raises(ValueError, match="latent_norm_weight"):
        latent_moe(h, **dict(p, latent_norm_weight=p["latent_norm_weight"][:4]), **ROUTING)
