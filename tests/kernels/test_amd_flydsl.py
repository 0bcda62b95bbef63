"""The FlyDSL kernels of the amd plugin (k3.platforms.amd.fly_kernels), here, without ROCm or a GPU.

FlyDSL (0.5) has no execution path off ROCm (no interpreter, no CPU lowering), so the kernels
are never run: each is traced by FlyDSL and lowered for gfx942 and gfx950 through every stage
(Fly IR -> ROCDL -> LLVM dialect -> AMDGCN -> linked hsaco), and the lowered IR is checked
against the shapes and dtypes it must take and the operations it must contain. The wrappers'
torch side (pairs, GLU, combine; selection -> cache rows, absorptions) is checked numerically
against the reference ops with each kernel replaced by a torch stand-in of its documented
contract: that checks the glue, not the kernel. Opt-in serving (K3_AMD_FLYDSL) is checked on
the kernel table. Nothing here executes AMD code."""

import re

import pytest
import torch

pytest.importorskip("flydsl", reason="FlyDSL is not installed (pip install flydsl: the test extra)")
pytest.importorskip("triton._C.libtriton", reason="the hsaco link uses libtriton's lld")

from k3 import reference as ref  # noqa: E402
from k3.ops_helpers import masked_softmax  # noqa: E402
from k3.platforms.amd import archs, kernels  # noqa: E402
from k3.platforms.amd.fly_kernels import lowering, moe_w4a16, sparse_mla  # noqa: E402
from k3.quant.mxfp4 import MXFP4Tensor, mxfp4_dequantize, mxfp4_quantize  # noqa: E402

KERNELS = {
    "moe_w4a16": (moe_w4a16.mxfp4_gemv, moe_w4a16.example_args,
                  # kernel arguments: X bf16, codes, scales (bytes), pair token / expert, Y fp32, N
                  ("bf16", "i8", "i8", "i32", "i32", "f32", "i32"),
                  {"fly": ("gpu.shuffle xor",), "amdgcn": (r"global_load_[us]byte", r"global_store_dword\b")}),
    "sparse_mla": (sparse_mla.sparse_mla, sparse_mla.example_args,
                   # Q fp32, KV bf16 rows, selected rows, Out fp32, H, NSEL, scale
                   ("f32", "bf16", "i32", "f32", "i32", "i32", "f32"),
                   {"fly": ("gpu.shuffle xor", "math.exp2", "scf.for"),
                    "amdgcn": (r"v_exp_f32", r"global_load_dwordx4", r"global_store_dwordx4")}),
}


KERNEL_NAMES = {"moe_w4a16": "mxfp4_gemv_kernel", "sparse_mla": "sparse_mla_kernel"}


def _signature(fly_ir: str) -> list[str]:
    """Element types of the kernel's arguments in the traced Fly IR (memrefs by element type)."""
    head = re.search(r"gpu\.func @\w+\((.*?)\)\s+kernel", fly_ir, re.S).group(1)
    head = re.sub(r"loc\([^)]*\)", "", head)
    return [m.group(1) or m.group(2) for m in re.finditer(r"!fly\.memref<(\w+),|:\s*(i32|f32)\b", head)]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_lowers_to_a_linked_hsaco_with_the_expected_ir(name, arch):
    launcher, example, signature, expected = KERNELS[name]
    done = lowering.lower(launcher, example(), arch)
    assert done.error is None and done.stage == "hsaco" and done.hsaco_bytes > 0, done.error
    assert set(done.ir) == set(lowering.STAGES) - {"hsaco"}
    assert _signature(done.ir["fly"]) == list(signature)
    assert f"chip = \"{arch}\"" in done.ir["llvm"] and "rocdl.kernel" in done.ir["llvm"]
    assert "wave64 = true" in done.ir["llvm"] or ".wavefront_size: 64" in done.ir["amdgcn"]
    for stage, patterns in expected.items():
        for pattern in patterns:
            assert re.search(pattern, done.ir[stage]), (stage, pattern)
    (kernel, numbers), = done.resources.items()
    assert kernel.startswith(KERNEL_NAMES[name]), kernel
    assert 0 < numbers["vgprs"] <= 128 and numbers["sgprs"] > 0, numbers
    assert numbers["vgpr_spills"] == numbers["sgpr_spills"] == numbers["scratch_bytes"] == 0, numbers


# --------------------------------------------------------------------------- opt-in serving

def _entries(monkeypatch, opt_in: bool, family: str):
    monkeypatch.setenv(kernels.FLYDSL_ENV, "1" if opt_in else "")
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    return kernels.table_entries(family, archs.ARCHS["gfx950"], lambda module: True)


@pytest.mark.parametrize("family, entry, module", [("moe", "experts", moe_w4a16), ("mla", "decode", sparse_mla)])
def test_flydsl_kernels_are_served_only_when_opted_in(monkeypatch, family, entry, module):
    default = _entries(monkeypatch, False, family)[entry]
    assert getattr(default, "func", default).__module__ != module.__name__
    served = _entries(monkeypatch, True, family)[entry]
    assert served.func.__module__ == module.__name__
    fallback = served.keywords["fallback"]                  # the Triton entry keeps what FlyDSL does not cover
    assert getattr(fallback, "func", fallback) is getattr(default, "func", default)


def test_the_simulated_platform_never_serves_flydsl(monkeypatch):
    from k3.platform import select_platform

    monkeypatch.setenv("K3_AMD_SIMULATE", "gfx950")
    monkeypatch.setenv(kernels.FLYDSL_ENV, "1")
    platform = select_platform("amd")
    for fn in (platform.kernels.moe.experts, platform.kernels.mla.decode):
        assert "fly_kernels" not in getattr(getattr(fn, "func", fn), "__module__", "")


# ------------------------------------------- the wrappers' torch glue, each kernel as a stand-in

def _gemv_stand_in(x, codes, scales, token, expert, y, p, n, k):
    """mxfp4_gemv's contract in torch (flat arguments): y[p] = x[token[p]] @ W[expert[p]]^T, zeros
    where expert[p] < 0."""
    w = mxfp4_dequantize(codes.view(-1, n, k // 2), scales.view(-1, n, k // 32), dtype=torch.float64)
    rows = x.view(-1, k).double()[token.long()]
    out = torch.einsum("pk,pnk->pn", rows, w[expert.long().clamp(min=0)])
    y.view(p, n).copy_(torch.where(expert[:, None] >= 0, out, 0.0))


def test_moe_wrapper_glue_matches_the_reference(monkeypatch):
    g = torch.Generator().manual_seed(0)
    t, k, e_local, inter, width = 3, 2, 3, 128, 128
    w13 = MXFP4Tensor(*mxfp4_quantize(torch.randn(e_local, 2 * inter, width, generator=g)))
    w2 = MXFP4Tensor(*mxfp4_quantize(torch.randn(e_local, width, inter, generator=g)))
    x = torch.randn(t, width, generator=g)
    ids = torch.tensor([[4, 5], [2, 6], [3, 3]])              # expert_start 2: 5 local, 6 another rank's
    weights = torch.rand(t, k, generator=g)
    monkeypatch.setattr(moe_w4a16, "mxfp4_gemv", _gemv_stand_in)
    monkeypatch.setattr(moe_w4a16, "covers", lambda *a: True)
    got = moe_w4a16.experts_forward(x, w13, w2, weights, ids, activation="silu", expert_start=2)
    want = ref.experts_forward(x, w13, w2, weights, ids, activation="silu", expert_start=2)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def _mla_stand_in(q, kv, rows, out, t, h, nsel, scale, r, dr):
    """sparse_mla's contract in torch (flat arguments): softmax over the selected rows (-1 none)."""
    q, rows = q.view(t, h, r + dr).double(), rows.view(t, nsel).long()
    kv = kv.view(-1, r + dr).double()
    scores = torch.einsum("thd,tkd->thk", q, kv[rows.clamp(min=0)]) * scale
    p = masked_softmax(scores, (rows >= 0)[:, None, :].expand_as(scores))
    out.view(t, h, r).copy_(torch.einsum("thk,tkr->thr", p, kv[rows.clamp(min=0), :r]))


def test_sparse_mla_wrapper_glue_matches_the_reference(monkeypatch):
    g = torch.Generator().manual_seed(1)
    h, dn, r, dr, page = 4, 16, 512, 64, 16
    lens = torch.tensor([37, 20])
    table = torch.tensor([[5, 0, 3], [1, 4, 2]])               # shuffled pages
    kv = torch.randn(6, page, r + dr, generator=g).bfloat16()
    q_nope, q_pe = torch.randn(2, h, dn, generator=g), torch.randn(2, h, dr, generator=g)
    w_uk, w_uv = torch.randn(h, dn, r, generator=g) / 8, torch.randn(h, r, 32, generator=g) / 8
    # duplicates, padding, a position past the sequence and one past the table
    topk = torch.tensor([[3, 36, 3, -1, 0, 12, 40, 47], [19, 2, 2, 25, -1, -1, 7, 48]])
    monkeypatch.setattr(sparse_mla, "sparse_mla", _mla_stand_in)
    monkeypatch.setattr(sparse_mla, "covers", lambda *a: True)
    got = sparse_mla.mla_decode(q_nope, q_pe, kv, table, lens, w_uk, w_uv, scale=0.1, topk_indices=topk)
    want = ref.mla_decode(q_nope, q_pe, kv, table, lens, w_uk, w_uv, scale=0.1, topk_indices=topk)
    assert torch.isfinite(want).all() and (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_wrappers_hand_uncovered_inputs_to_their_fallback():
    calls = []
    fallback = lambda *a, **kw: calls.append(kw) or "fallback"  # noqa: E731
    x = torch.randn(2, 128)
    w = MXFP4Tensor(*mxfp4_quantize(torch.randn(2, 256, 128)))
    assert moe_w4a16.experts_forward(x, w, w, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long),
                                     activation="silu", fallback=fallback) == "fallback"   # CPU tensors
    q, kv = torch.randn(1, 4, 8), torch.randn(2, 16, 576).bfloat16()
    assert sparse_mla.mla_decode(q, torch.randn(1, 4, 64), kv, torch.zeros(1, 2, dtype=torch.int32),
                                 torch.tensor([9]), torch.randn(4, 8, 512), torch.randn(4, 512, 8), scale=1.0,
                                 topk_indices=None, fallback=fallback) == "fallback"        # a dense call
    assert len(calls) == 2 and calls[0]["activation"] == "silu"
