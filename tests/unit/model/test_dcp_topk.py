"""The exact distributed top-k of DCP (k3.model.dcp_topk): equal to the single-rank
`k3.reference.indexer_topk` (same indices in the same order, ties to the lower index) for
random scores, ties, masked rows and a skewed distribution that forces the resend path; many
cases in one process (the protocol's steps over simulated ranks), and W = 2 / 4 over gloo
processes (one launch for the module)."""

import pytest
import torch

from dcp_worker import launch, topk_case
from k3 import reference as ref
from k3.model.dcp_topk import (candidate_count, distributed_topk, interleave, ordered_topk, pack,
                               simulate_distributed_topk, unpack)

CASES = [f"{kind}_{w}" for kind in ("random", "ties", "skewed", "masked") for w in (2, 4)]


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    jobs = [{"kind": "topk", "case": c, "world": topk_case(c)[2]} for c in CASES]
    return jobs, launch(jobs, tmp_path_factory.mktemp("dcp_topk"))


@pytest.mark.parametrize("case", CASES)
def test_gloo_equals_single_rank(gloo_runs, case):
    jobs, ranks = gloo_runs
    index = next(i for i, j in enumerate(jobs) if j["case"] == case)
    scores, topk, world = topk_case(case)
    want = ref.indexer_topk(scores, topk=topk).long()
    assert (want >= 0).sum() > 0
    for rank, res in enumerate(ranks):
        assert torch.equal(res[index]["indices"], want), (case, rank)
        assert res[index]["resent"] == ranks[0][index]["resent"]          # every rank agrees
    if case.startswith("skewed"):
        assert ranks[0][index]["resent"] > 0                               # the resend path ran
    assert torch.equal(simulate_distributed_topk(scores, topk=topk, world=world).indices, want)


def _random_case(g: torch.Generator, case: int) -> tuple[torch.Tensor, int, int]:
    world = (1, 2, 3, 4, 8)[case % 5]
    length, topk = int(torch.randint(1, 90, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    scores = torch.randn(4, length, generator=g, dtype=torch.float64)
    if case % 4 == 1:
        scores = scores.round()                                # ties
    elif case % 4 == 2:
        scores[:, case % world::world] += 3                    # one rank holds most of the top-k
    if case % 7 == 0:
        scores[:, length // 2:] = float("-inf")                # fewer finite than topk, maybe
    return scores.to((torch.float64, torch.float32, torch.bfloat16, torch.float16)[case % 4]), topk, world


def test_simulated_protocol_many_cases():
    """600 random cases (W in 1, 2, 3, 4, 8; fp64 / fp32 / bf16 / fp16; ties, skew, masks):
    the same indices as the single-rank reference, and the resend path taken in some."""
    g = torch.Generator().manual_seed(23)
    resent = 0
    for case in range(600):
        scores, topk, world = _random_case(g, case)
        got = simulate_distributed_topk(scores, topk=topk, world=world)
        want = ref.indexer_topk(scores, topk=topk).long()
        assert torch.equal(got.indices, want), (case, world, topk, scores.dtype)
        resent += got.resent_rows
    assert resent > 50


def test_set_equals_torch_topk_on_distinct_scores():
    scores = torch.randn(5, 200, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = simulate_distributed_topk(scores, topk=33, world=4).indices
    want = torch.topk(scores, 33, dim=-1).indices
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_resend_is_needed_for_exactness():
    """All of the top-k on one rank: round 1 alone (c candidates from it) cannot be exact."""
    topk, world = 16, 4
    scores = torch.randn(2, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    scores[:, 2::world] += 100
    got = simulate_distributed_topk(scores, topk=topk, world=world)
    assert got.resent_rows >= 2                                  # rank 2, both rows (others may too)
    assert candidate_count(topk, world) == 6 < topk
    assert torch.equal(got.indices.sort(-1).values, torch.arange(2, 64, 4).expand(2, -1))


def test_one_rank_group_is_a_plain_topk():
    scores = torch.randn(3, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = distributed_topk(scores, topk=4, rank=0, world=1, all_gather=lambda x: x[None])
    assert torch.equal(got.indices, ref.indexer_topk(scores, topk=4).long())
    assert got.resent_rows == 0


def test_wire_packing_is_lossless_and_ordered():
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        s = torch.randn(3, 7, generator=g, dtype=torch.float64).to(dtype)
        i = torch.randint(0, 2**31 - 1, (3, 7), generator=g)
        words = pack(s, i)
        assert words.dtype == torch.int32 and words.shape == (3, 7, 3 if dtype == torch.float64 else 2)
        back_s, back_i = unpack(words, dtype)
        assert torch.equal(back_s.to(dtype), s) and torch.equal(back_i, i)
    top_s, top_i = ordered_topk(torch.tensor([[1.0, 2.0, 2.0, float("-inf")]]), torch.tensor([[5, 9, 3, 1]]), 5)
    assert top_i.tolist() == [[3, 9, 5, -1, -1]] and top_s[0, :3].tolist() == [2.0, 2.0, 1.0]


def test_interleave_and_errors():
    scores = torch.arange(10.0)[None]
    assert [x.tolist() for x in interleave(scores, 3)] == [[[0, 3, 6, 9]], [[1, 4, 7]], [[2, 5, 8]]]
    assert candidate_count(2048, 8) == 384 and candidate_count(16, 1) == 16
    with pytest.raises(ValueError, match="topk >= 1 and world >= 1"):
        candidate_count(0, 2)
