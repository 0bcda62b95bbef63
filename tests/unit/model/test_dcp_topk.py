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
from k3.model.dcp_topk_packed import (gathered_selection, pack_words, score_key, simulate_packed_topk,
                                      tie_worst_case_scores, unpack_words)

CASES = [f"{kind}_{w}" for kind in ("random", "ties", "skewed", "masked") for w in (2, 4)]
PACKED_CASES = ["ties_2", "skewed_4", "masked_4", "keyties_2", "keyties_4", "allequal_4", "halfequal_2"]


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    jobs = [{"kind": "topk", "case": c, "world": topk_case(c)[2]} for c in CASES]
    jobs += [{"kind": "packed", "case": c, "world": topk_case(c)[2]} for c in PACKED_CASES]
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


@pytest.mark.parametrize("case", PACKED_CASES)
def test_gloo_packed_equals_single_rank(gloo_runs, case):
    """One-word candidates over gloo: the ranks' shares together are the reference top-k (ties
    to the lower index), each rank holds only its own tokens, and round 1 sends 4 bytes a
    candidate (the lossless format: 12 for these fp64 scores)."""
    jobs, ranks = gloo_runs
    index = next(i for i, j in enumerate(jobs) if j["case"] == case and j["kind"] == "packed")
    scores, topk, world = topk_case(case)
    want = ref.indexer_topk(scores, topk=topk).long()
    groups = [ranks[:2], ranks[2:]] if world == 2 else [ranks]
    for group in groups:
        res = [r[index] for r in group]
        for rank, r in enumerate(res):
            assert ((r["mine"] < 0) | (r["mine"] % world == rank)).all()
            assert (r["resent"], r["ties"]) == (res[0]["resent"], res[0]["ties"])
            assert r["round1"] == scores.shape[0] * candidate_count(topk, world) * 4
        mine = torch.cat([r["mine"] for r in res], -1)
        got = ordered_topk(torch.where(mine >= 0, scores.gather(-1, mine.clamp_min(0)), float("-inf")), mine, topk)[1]
        assert torch.equal(got, want), (case, world)
    if case.startswith(("keyties", "allequal", "halfequal")):
        assert ranks[0][index]["ties"] == scores.shape[0]                  # every row took the exact round
    if case.startswith("skewed"):
        assert ranks[0][index]["resent"] > 0


def _key_tie_case(g: torch.Generator, case: int) -> tuple[torch.Tensor, int, int]:
    scores, topk, world = _random_case(g, case)
    if case % 3 == 0:                                         # distinct scores sharing bf16 keys at the cut-off
        scores = (1 + scores.double() * 1e-3).to(scores.dtype)
    return scores, topk, world


def test_simulated_packed_protocol_cases():
    """200 random cases (as above, a third squeezed near 1 so that many distinct scores share
    a 16-bit key): every rank's share together is the reference top-k, ties included; the
    exact round and the resend path both run."""
    g = torch.Generator().manual_seed(123)
    ties = resent = 0
    for case in range(200):
        scores, topk, world = _key_tie_case(g, case)
        got = simulate_packed_topk(scores, topk=topk, world=world)
        want = ref.indexer_topk(scores, topk=topk).long()
        assert torch.equal(gathered_selection(got, scores, topk), want), (case, world, topk, scores.dtype)
        ties, resent = ties + got[0].tie_rows, resent + got[0].resent_rows
    assert ties > 50 and resent > 50


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("kind", ["allequal", "halfequal"])
def test_tie_worst_case_is_exact_and_bounded(kind, world):
    """Every score at the cut-off tied across ranks (all equal; half equal with the cut inside
    them): both formats select what one rank would (ties to the lower index), and the bytes a
    rank sends stay within the protocol's bound per row: one-word, 4 c + 4 topk (resend) + 8 need
    (the exact round's lossless fp32 words, need <= topk); lossless, 8 c + 8 topk. All equal
    meets the one-word bound exactly: every rank resends every row and sends topk tied words."""
    rows, length, topk = 3, 1024, 128
    scores = tie_worst_case_scores(kind, rows, length, topk, torch.Generator().manual_seed(world)).float()
    want = ref.indexer_topk(scores, topk=topk).long()
    packed = simulate_packed_topk(scores, topk=topk, world=world)
    lossless = simulate_distributed_topk(scores, topk=topk, world=world)
    assert torch.equal(gathered_selection(packed, scores, topk), want)
    assert torch.equal(lossless.indices, want)
    if kind == "allequal":
        assert torch.equal(want, torch.arange(topk).expand(rows, -1))      # the lowest indices win
    c = candidate_count(topk, world)
    bound = rows * (4 * c + 4 * topk + 8 * topk)
    assert packed[0].tie_rows == rows and packed[0].wire_bytes <= bound
    assert lossless.wire_bytes <= rows * (8 * c + 8 * topk)
    if kind == "allequal":
        assert packed[0].wire_bytes == bound and packed[0].resent_rows == rows * world


def test_packed_round1_is_half_the_lossless_bytes():
    scores = torch.randn(3, 400, generator=torch.Generator().manual_seed(6))       # fp32
    packed = simulate_packed_topk(scores, topk=32, world=4)[0]
    lossless = simulate_distributed_topk(scores, topk=32, world=4)
    c = candidate_count(32, 4)
    assert packed.round1_bytes == 3 * c * 4 and 2 * packed.round1_bytes == 3 * c * 8
    assert lossless.wire_bytes >= 3 * c * 8


def test_score_key_orders_and_words_round_trip():
    g = torch.Generator().manual_seed(7)
    s = torch.cat([torch.randn(500, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (500,), generator=g).double(),
                   torch.tensor([0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -1e-40])]).double()
    s = torch.cat([s, torch.tensor([1e300, -1e300], dtype=torch.float64)]).sort().values             # beyond bf16: keys saturate
    keys = score_key(s)
    assert (keys[1:] >= keys[:-1]).all() and (keys >= 1).all() and (keys <= 0xFFFF).all()
    assert score_key(torch.tensor([0.0]))[0] == score_key(torch.tensor([-0.0]))[0]
    assert score_key(torch.tensor([float("-inf"), float("nan"), float("inf")])).tolist() == [0, 0, 0]
    words = pack_words(keys[None, :60])
    assert words.dtype == torch.int32
    back_k, back_o = unpack_words(words)
    assert torch.equal(back_k[0], keys[:60]) and back_o[0].tolist() == list(range(60))
    with pytest.raises(ValueError, match="ordinals below 65536"):
        pack_words(torch.ones(1, 65537, dtype=torch.long))


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
