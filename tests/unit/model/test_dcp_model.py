"""Decode context parallelism in the model (float64): 4 gloo processes run every scenario of
dcp_worker.py in one launch (DCP = 2 as two groups at once, DCP = 4 over all), a prefill then
one-token decode steps (and a chunked prefill), teacher-forced; every rank's logits must equal
DCP = 1's to 1e-9, each rank must have stored only its own tokens' records, and on K3.1 Pro the
DSA top-k runs sparse (index_topk < context) with the resend path taken, including a skewed
prompt. In one process: the log-sum-exp combine over simulated ranks against plain softmax
attention, the local selection, and the DCP record's errors."""

import functools

import pytest
import torch

from dcp_worker import launch
from k3.checkpoint.loader import load_model
from k3.config import K3Config
from k3.model import DecodeContextParallel, ParallelContext
from k3.model.dcp_attention import combine, local_selection, partial_attention
from model_runs import teacher_forced
from rank_launch import one_thread  # noqa: F401 (an autouse fixture)

PROMPTS = [[(7 * i + 3 + 5 * j) % 384 for i in range(n)] for j, n in enumerate((30, 23))]
# one rank (1 of 4) holds the same token at every 4th position: its index keys cluster
SKEWED = [[200 if i % 4 == 1 else (7 * i + 3) % 384 for i in range(34)]]
# (name, preset, DCP world, prompts, first, chunk, TP size: None = 1, else the DCP group lies inside it)
PLAN = (("decode", "k3-tiny", 2, PROMPTS, 18, 1, None), ("decode", "k3-tiny", 4, PROMPTS, 18, 1, None),
        ("decode", "k3.1-pro-tiny", 2, PROMPTS, 18, 1, None), ("decode", "k3.1-pro-tiny", 4, PROMPTS, 18, 1, None),
        ("decode", "kimi-linear-tiny", 4, PROMPTS, 18, 1, None),
        ("chunked", "k3.1-pro-tiny", 4, PROMPTS, None, 7, None), ("skewed", "k3.1-pro-tiny", 4, SKEWED, 14, 1, None),
        ("tp2", "k3.1-pro-tiny", 2, PROMPTS, 18, 1, 2), ("tp4", "k3-tiny", 2, PROMPTS, 18, 1, 4),
        ("tp4", "k3.1-pro-tiny", 4, PROMPTS, 18, 1, 4), ("fp4", "k3.1-pro-tiny", 2, [PROMPTS[0][:21]], 18, 1, None))
# the cache formats of a PLAN name (default: the model's dtype, fp8 index keys)
CACHE = {"fp4": {"kv_cache_dtype": "nvfp4", "index_cache_dtype": "mxfp4"}}



@pytest.fixture(scope="module")
def dcp_runs(tiny_checkpoint, tmp_path_factory):
    """{(name, preset, world): (job, [rank results])} for PLAN."""
    jobs = [{"kind": "model", "name": n, "preset": p, "world": w, "checkpoint": str(tiny_checkpoint(p)),
             "prompts": ps, "first": f, "chunk": c, "index_scale": 1, "tp": tp, "cache": CACHE.get(n, {})}
            for n, p, w, ps, f, c, tp in PLAN]
    ranks = launch(jobs, tmp_path_factory.mktemp("dcp_model"))
    return {(j["name"], j["preset"], j["world"]): (j, [r[i] for r in ranks]) for i, j in enumerate(jobs)}


@functools.cache
def _dcp1(path: str, name: str) -> list[torch.Tensor]:
    job = next(p for p in PLAN if p[0] == name)
    return teacher_forced(load_model(path, dtype=torch.float64, progress=False), job[3], chunk=job[5], first=job[4],
                          **CACHE.get(name, {}))


def test_dcp_inside_tensor_parallel(dcp_runs):
    """vLLM's layout: the DCP ranks are TP ranks holding different heads (queries all-gathered
    over DCP, each rank keeping its heads of the combined output): TP 2 = DCP 2, TP 4 with two
    DCP groups of 2, TP 4 = DCP 4."""
    for key in (("tp2", "k3.1-pro-tiny", 2), ("tp4", "k3-tiny", 2), ("tp4", "k3.1-pro-tiny", 4)):
        _check(dcp_runs, *key)


def _check(dcp_runs, name: str, preset: str, world: int) -> list[dict]:
    job, ranks = dcp_runs[name, preset, world]
    want = _dcp1(job["checkpoint"], name)
    cfg = K3Config.preset(preset)
    tokens = sum(map(len, job["prompts"]))
    for rank, res in enumerate(ranks):
        assert len(res["logits"]) == len(want)
        for a, b in zip(want, res["logits"]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-9, msg=lambda m: f"{name} {preset} DCP {world} rank {rank}: {m}")
        r = rank % world
        mine = sum(len(range(r, len(p), world)) for p in job["prompts"])
        assert res["stored"] == mine * len(cfg.mla_layer_ids), (rank, res["stored"])       # its tokens only
        assert res["stored"] < tokens * len(cfg.mla_layer_ids)
    return ranks


@pytest.mark.parametrize("preset", ["k3-tiny", "k3.1-pro-tiny"])
@pytest.mark.parametrize("world", [2, 4])
def test_prefill_then_decode_equals_dcp1(dcp_runs, preset, world):
    ranks = _check(dcp_runs, "decode", preset, world)
    if preset == "k3.1-pro-tiny":
        assert K3Config.preset(preset).index_topk < max(map(len, PROMPTS))   # the sparse path selects
        assert all(r["resent"] == ranks[0]["resent"] for r in ranks[:world])
    else:
        assert ranks[0]["resent"] == 0                                       # no DSA: no top-k


def test_fp4_caches_dcp2(dcp_runs):
    """NVFP4 latents and MXFP4 index keys, each rank storing its own tokens' records: the same
    logits as DCP 1 over the same formats (the kernels read a dense copy of each rank's pages);
    21 tokens, so the top-16 selects sparsely in the decode steps."""
    _check(dcp_runs, "fp4", "k3.1-pro-tiny", 2)


def test_kimi_linear_dcp4(dcp_runs):
    _check(dcp_runs, "decode", "kimi-linear-tiny", 4)


def test_chunked_prefill_dcp4(dcp_runs):
    """Prefill chunks of 7 over context stored on other ranks, DSA selecting across them."""
    _check(dcp_runs, "chunked", "k3.1-pro-tiny", 4)


def test_skewed_keys_take_the_resend_path(dcp_runs):
    """A token repeated at every 4th position (all on rank 1): decode steps resend, and the
    logits still equal DCP = 1's."""
    ranks = _check(dcp_runs, "skewed", "k3.1-pro-tiny", 4)
    assert ranks[0]["decode_resent"] > 0
    assert all(r["decode_resent"] == ranks[0]["decode_resent"] for r in ranks)


class _Stacked:
    """Collectives stub for simulated ranks: all_gather returns the precomputed parts of every
    rank after checking this rank's part is the one it was given."""

    def __init__(self, parts: torch.Tensor, rank: int):
        self.parts, self.rank = parts, rank

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        assert dim == 0 and torch.equal(x[0], self.parts[self.rank])
        return self.parts


def test_lse_combine_equals_softmax_attention():
    """Attention of 5 queries over 13 rows split token-interleaved over 4 simulated ranks (one
    query sees only row 0, so 3 ranks have nothing visible): the combine of the partials equals
    plain softmax attention."""
    g = torch.Generator().manual_seed(5)
    t, h, c, r, world = 5, 3, 10, 8, 4
    q = torch.randn(t, h, c, generator=g, dtype=torch.float64)
    rows = torch.randn(1, 13, c, generator=g, dtype=torch.float64)
    visible = torch.rand(t, 13, generator=g) < 0.7
    visible[:, 0], visible[0] = True, torch.arange(13) == 0
    scores = torch.einsum("thc,sc->ths", q, rows[0]) * 0.3
    want = torch.einsum("ths,sr->thr", torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1),
                        rows[0, :, :r])
    seq = torch.zeros(t, dtype=torch.long)
    partials = [partial_attention(q, rows[:, k::world], seq, visible[:, k::world], scale=0.3, latent_dim=r)
                for k in range(world)]
    assert torch.isinf(partials[1][1][0]).all()                      # nothing visible on rank 1 for query 0
    parts = torch.stack([torch.cat([o, lse[..., None]], -1) for o, lse in partials])
    for k in range(world):
        dcp = DecodeContextParallel(rank=k, size=world, collectives=_Stacked(parts, k))
        torch.testing.assert_close(combine(*partials[k], dcp), want, rtol=0, atol=1e-12)


def test_local_selection():
    dcp = DecodeContextParallel(rank=1, size=3)
    sel = local_selection(torch.tensor([[4, 1, 7, -1, 0], [2, 4, 3, -1, -1]]), dcp, 4)
    assert sel.tolist() == [[True, True, True, False], [False, True, False, False]]   # 1, 4, 7 | 4 (local 0, 1, 2 | 1)


def test_dcp_record():
    dcp = DecodeContextParallel(rank=2, size=4)
    assert dcp.local_lens(torch.tensor([0, 1, 2, 3, 7, 8])).tolist() == [0, 0, 0, 1, 2, 2]
    assert dcp.owns(torch.arange(8)).nonzero().squeeze(-1).tolist() == [2, 6]
    with pytest.raises(ValueError, match="decode-context-parallel rank 4 is outside decode-context-parallel size 4"):
        DecodeContextParallel(rank=4, size=4)
    assert ParallelContext(dcp=DecodeContextParallel()).context_parallel is None     # size 1: unsharded
    assert ParallelContext(dcp=dcp).context_parallel is dcp
