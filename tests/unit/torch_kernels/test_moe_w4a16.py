"""W4A16 routed experts in torch (platforms/torch_kernels/moe_w4a16.py) against
k3.reference.experts_forward on fresh random MXFP4 experts: routings with empty experts, one
token, every pair on one expert and ids of other ranks; host and device (dense) dispatch; the
grouped GEMM and the per-expert loop; a workspace of one expert (many groups) and of all; the
reused workspace poisoned with NaN between calls, which must not reach the output."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels.device_support import grouped_gemm_supported
from k3.platforms.torch_kernels.moe_w4a16 import W4A16Experts, build_experts, dequantize_into, group_size
from k3.quant.mxfp4 import MXFP4Tensor

E, L, I, K = 6, 64, 32, 2
START = 1                                     # this rank holds global experts 1..6


def _experts(seed):
    g = torch.Generator().manual_seed(seed)
    return (MXFP4Tensor.from_float(torch.randn(E, 2 * I, L, generator=g)),
            MXFP4Tensor.from_float(torch.randn(E, L, I, generator=g) / I ** 0.5))


def _routing(kind, seed):
    g = torch.Generator().manual_seed(seed)
    t = {"one_token": 1, "all_on_one": 9}.get(kind, 11)
    ids = torch.randint(0, E + 2, (t, K), generator=g)          # 0 and 7: other ranks' experts
    if kind == "empty_experts":
        ids = torch.where(ids % 2 == 0, 3, 6)                   # only two experts used
    if kind == "all_on_one":
        ids = torch.full((t, K), 4)
    return torch.randn(t, L, generator=g), torch.rand(t, K, generator=g), ids.int()


MODES = [(False, False), (True, True)]        # host dispatch + loop, dense dispatch + grouped GEMM


@pytest.mark.parametrize("kind, dense, grouped",
                         [(k, d, g) for k in ("random", "empty_experts", "one_token", "all_on_one") for d, g in MODES]
                         + [("random", True, False), ("random", False, True)])
def test_matches_the_reference(kind, dense, grouped):
    if grouped and not grouped_gemm_supported("cpu"):
        pytest.skip("this torch build has no CPU torch._grouped_mm")
    w13, w2 = _experts(seed=hash(kind) % 97)
    x, tw, ids = _routing(kind, seed=hash((kind, dense)) % 89)
    for budget, dtype in ((1, torch.bfloat16), (1 << 30, torch.float32)):   # groups of one expert / all
        fn = W4A16Experts(grouped=grouped, compiled_glu=False, workspace_bytes=budget)
        xd = x.to(dtype)
        want = ref.experts_forward(xd, w13, w2, tw, ids, activation="situ", beta=4.0, expert_start=START)
        got = fn(xd, w13, w2, tw, ids, activation="situ", beta=4.0, expert_start=START, dense_dispatch=dense)
        assert got.dtype == dtype and got.shape == want.shape
        err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (kind, dtype, err)


def test_workspace_is_one_group_reused_and_poison_never_leaks():
    w13, w2 = _experts(seed=3)
    per_expert = 3 * I * L * 4
    fn = W4A16Experts(grouped=False, compiled_glu=False, workspace_bytes=2 * per_expert)
    assert group_size(E, I, L, 4, 2 * per_expert) == 2
    x, tw, ids = _routing("random", seed=5)
    fn(x, w13, w2, tw, ids, activation="situ", beta=4.0, expert_start=START)
    (ws13, ws2), = fn.workspace.buffers.values()
    assert ws13.shape == (2, 2 * I, L) and ws2.shape == (2, L, I)       # never the whole expert stack
    ws13.fill_(float("nan")), ws2.fill_(float("nan"))
    x, tw, ids = _routing("empty_experts", seed=6)
    got = fn(x, w13, w2, tw, ids, activation="silu", expert_start=START, dense_dispatch=True)
    want = ref.experts_forward(x, w13, w2, tw, ids, activation="silu", expert_start=START)
    assert (fn.workspace.buffers[next(iter(fn.workspace.buffers))][0].data_ptr() == ws13.data_ptr())
    assert got.isfinite().all()                                         # no poisoned row read
    # an error ratio, as above: the experts' unscaled gate/up rows reach |g| ~ 8, where an
    # elementwise 1e-5 is under fp32's rounding of a 64-term sum (matmul blocking differs by CPU)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-5, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float16])
def test_dequantize_into_is_exact(dtype):
    w13, _ = _experts(seed=8)
    out = torch.full((3, 2 * I, L), float("nan"), dtype=dtype)
    dequantize_into(out, w13, 2, 5, W4A16Experts(grouped=False, compiled_glu=False).workspace)
    torch.testing.assert_close(out, w13.dequantize(dtype, index=[2, 3, 4]), rtol=0, atol=0)


def test_dense_weights_and_the_set_up():
    g = torch.Generator().manual_seed(9)
    w13, w2 = torch.randn(E, 2 * I, L, generator=g), torch.randn(E, L, I, generator=g)
    x, tw, ids = _routing("random", seed=10)
    fn = build_experts("cpu")
    assert fn.compiled_glu is False                      # no compilation on the CPU
    torch.testing.assert_close(fn(x, w13, w2, tw, ids, activation="situ", beta=4.0, linear_beta=1.0),
                               ref.experts_forward(x, w13, w2, tw, ids, activation="situ", beta=4.0, linear_beta=1.0),
                               rtol=1e-5, atol=1e-4)
