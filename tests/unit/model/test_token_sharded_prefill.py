"""Token-sharded prefill (float64): 4 gloo processes run every job of tsp_worker.py in one
launch (W = 2 over ranks {0, 1} and W = 4 over all, the three tiny presets, prompts of 37, 11
and 3 tokens: not a multiple of 16, shorter than 16 (empty pieces), and so short that two of
four ranks hold no token), and each must give the unsharded prefill's logits (every position,
1e-9) and cache contents (KDA recurrent and conv rows, MLA latents, DSA index keys) on every
rank, after which rank 0's greedy decode steps give the unsharded run's tokens; the same with
the model sharded over the group as its TP group (the MLA heads <-> tokens re-layout). In one
process: the piece rule, W = 1, and the refusals."""

import functools
from pathlib import Path

import pytest
import torch

from k3.checkpoint.loader import load_model
from k3.config import K3Config
from k3.model import ExpertParallel, K3ForCausalLM, LocalCollectives, ParallelContext
from k3.model.token_sharded import PiecePlan, TokenShardedPrefill, piece_bounds, rank_pieces
from rank_launch import one_thread, run_ranks  # noqa: F401 (one_thread: an autouse fixture)
from tsp_worker import (PAGE_SIZE, STATE_ROW, WORLD, cache_snapshot, greedy_decode, new_cache, prompt,
                        reference_prefill)

WORKER = Path(__file__).with_name("tsp_worker.py")
ALL = ("k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny")
LENGTHS = (37, 11, 3)
DECODE = 3
# the last-token-only run: every position's logits are not gathered
LAST_ONLY = 53
# TP = W: the heads <-> tokens re-layout of the MLA layers (3 tokens at W = 4: idle ranks)
TP_LENGTHS = {2: (37,), 4: (37, 3)}



def _jobs(tiny_checkpoint) -> list[dict]:
    def job(p, w, n, seed, all_logits=True, tp=False):
        return {"preset": p, "checkpoint": str(tiny_checkpoint(p)), "world": w, "tp": tp, "length": n, "seed": seed,
                "all_logits": all_logits, "decode": DECODE}

    jobs = [job(p, w, n, n + w) for p in ALL for w in (2, 4) for n in LENGTHS]
    jobs += [job(p, 4, LAST_ONLY, 7, all_logits=False) for p in ALL]
    jobs += [job(p, w, n, n + w, tp=True) for p in ALL for w in (2, 4) for n in TP_LENGTHS[w]]
    return jobs


@pytest.fixture(scope="module")
def tsp_runs(tiny_checkpoint, tmp_path_factory):
    """[(job, [rank results or None])] for every job of `_jobs`."""
    work = tmp_path_factory.mktemp("tsp")
    jobs = _jobs(tiny_checkpoint)
    ranks = run_ranks(WORKER, jobs, work, WORLD)
    return [(job, [r.get(i) for r in ranks]) for i, job in enumerate(jobs)]


@functools.cache
def _model(path: str) -> K3ForCausalLM:
    return load_model(path, dtype=torch.float64, progress=False)


@functools.cache
def _unsharded(path: str, length: int, seed: int):
    """(every position's logits, cache snapshot, greedy tokens, their logits) of one process."""
    model = _model(path)
    ids = prompt(length, model.cfg.vocab_size, seed)
    logits, pool, row = reference_prefill(model, ids, length + DECODE)
    snap = cache_snapshot(model, pool, length)
    tokens, steps = greedy_decode(model, pool, row, length, logits[-1], DECODE)
    return logits, snap, tokens, steps


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=lambda m: f"{what}: {m}")


def _tp_share(snap: dict, name: str, layer: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """TP rank `rank`'s share of an unsharded cache row: its heads of the KDA rows (the conv
    row's q, k and v channels each), the whole of the replicated latents and index keys."""
    if name == "recurrent":
        return layer.chunk(world, 0)[rank]
    if name == "conv":
        return torch.cat([part.chunk(world, 0)[rank] for part in layer.chunk(3, 0)])
    return layer


def _check(tsp_runs, *, world=None, lengths=None, all_logits=True, tp=False) -> int:
    """Every matching job: each participating rank's logits and caches equal the unsharded
    prefill's (under TP: its share); the decode tokens and logits too. Returns the rank
    results checked."""
    checked = 0
    for job, ranks in tsp_runs:
        if (world is not None and job["world"] != world) or (lengths is not None and job["length"] not in lengths) \
                or job["all_logits"] != all_logits or job["tp"] != tp:
            continue
        logits, snap, tokens, steps = _unsharded(job["checkpoint"], job["length"], job["seed"])
        for rank, res in enumerate(ranks):
            what = f"{job['preset']} W={job['world']} T={job['length']} rank {rank}"
            if rank >= job["world"]:
                assert res is None, what
                continue
            _close(res["logits"], logits if all_logits else logits[-1:], f"{what} logits")
            assert res["cache"].keys() == snap.keys()
            for name, layers in snap.items():
                assert len(res["cache"][name]) == len(layers)
                for i, (a, b) in enumerate(zip(res["cache"][name], layers)):
                    want = _tp_share(snap, name, b, rank, job["world"]) if tp else b
                    _close(a, want, f"{what} cache {name}[{i}]")
            if rank == 0 or tp:
                assert res["tokens"] == tokens, what
                for a, b in zip(res["decode_logits"], steps):
                    _close(a, b, f"{what} decode logits")
            checked += 1
    return checked


def test_w2_equals_unsharded_prefill(tsp_runs):
    assert _check(tsp_runs, world=2, lengths=(37,)) == len(ALL) * 2


def test_w4_equals_unsharded_prefill(tsp_runs):
    assert _check(tsp_runs, world=4, lengths=(37,)) == len(ALL) * 4


def test_prompts_shorter_than_16_tokens(tsp_runs):
    """11 tokens: five empty pieces; 3 tokens at W = 4: ranks 2 and 3 hold no token at all
    and only take part in the gathers (their caches still end up complete)."""
    assert [len(PiecePlan(3, 4, r).my_tokens) for r in range(4)] == [1, 2, 0, 0]
    assert sum(b == e for b, e in piece_bounds(11)) == 5
    assert _check(tsp_runs, lengths=(11, 3)) == len(ALL) * (2 + 4) * 2


def test_last_token_logits_only(tsp_runs):
    """Without all_logits every rank gets the last token's logits (rank 0 holds piece 15)."""
    assert _check(tsp_runs, all_logits=False) == len(ALL) * 4
    # what moved: the latents of every MLA layer (and the KDA pieces' maps), not just logits
    job, ranks = next((j, r) for j, r in tsp_runs if not j["all_logits"])
    cfg = K3Config.preset(job["preset"])
    assert ranks[0]["bytes"]["tokens"] >= len(cfg.mla_layer_ids) * LAST_ONLY * cfg.mla_latent_size * 8


def test_tp_heads_tokens_relayout_equals_unsharded_prefill(tsp_runs):
    """TP = W over the same ranks: MLA attends with each rank's pieces' queries over all heads
    (two all-to-alls a layer); logits, every rank's cache share and the TP decode match."""
    assert _check(tsp_runs, world=2, tp=True) == len(ALL) * 2
    assert _check(tsp_runs, world=4, tp=True) == len(ALL) * 4 * 2
    job, ranks = next((j, r) for j, r in tsp_runs if j["tp"] and j["world"] == 4 and j["length"] == 3)
    assert ranks[2]["bytes"]["all_to_all"] > 0          # an idle rank still sends its heads' queries


def test_piece_rule():
    """Pairs (p, 15 - p); rank r of W takes the pairs r, r + W, ...; every piece once."""
    assert [rank_pieces(r, 8) for r in (0, 3, 7)] == [[0, 15], [3, 12], [7, 8]]
    assert rank_pieces(1, 4) == [1, 5, 10, 14]
    assert rank_pieces(0, 2) == [0, 2, 4, 6, 9, 11, 13, 15]
    assert rank_pieces(0, 1) == list(range(16))
    for w in (1, 2, 4, 8):
        assert sorted(p for r in range(w) for p in rank_pieces(r, w)) == list(range(16))
    for n in (1, 15, 16, 37, 1000):
        sizes = [e - b for b, e in piece_bounds(n)]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
        assert piece_bounds(n)[-1][1] == n and sizes[-1] >= 1       # the last token is piece 15's
    with pytest.raises(ValueError, match="world size dividing 8"):
        rank_pieces(0, 3)
    with pytest.raises(ValueError, match="outside world size"):
        rank_pieces(4, 4)


@pytest.mark.parametrize("preset", ALL)
def test_one_rank_equals_unsharded_prefill(tiny_checkpoint, preset):
    """W = 1: all 16 pieces on one process (the chaining over 16 pieces with no collectives)."""
    path = str(tiny_checkpoint(preset))
    model = _model(path)
    logits, snap, tokens, steps = _unsharded(path, 37, 0)
    pool, row = new_cache(model, 37 + DECODE)
    out = TokenShardedPrefill(model, rank=0, world=1, collectives=LocalCollectives()).prefill(
        prompt(37, model.cfg.vocab_size, 0), pool.views, block_row=row, state_row=STATE_ROW, page_size=PAGE_SIZE,
        all_logits=True)
    _close(out.logits, logits, "logits")
    for name, layers in cache_snapshot(model, pool, 37).items():
        for a, b in zip(layers, snap[name]):
            _close(a, b, name)
    assert greedy_decode(model, pool, row, 37, out.logits[-1], DECODE)[0] == tokens


def test_refuses_other_groups_and_bad_inputs(tiny_checkpoint):
    """A TP group other than the prefill group, expert parallelism, a prompt the pages cannot
    hold, an empty prompt."""
    cfg = K3Config.preset("k3-tiny")
    tp = K3ForCausalLM(cfg, parallel=ParallelContext(rank=0, world_size=2), dtype=torch.float64, device="meta")
    with pytest.raises(NotImplementedError, match="TP rank 0 of 2, prefill rank 0 of 4"):
        TokenShardedPrefill(tp, rank=0, world=4, collectives=LocalCollectives())
    ep = K3ForCausalLM(cfg, parallel=ParallelContext(ep=ExpertParallel(rank=0, size=2)), dtype=torch.float64,
                       device="meta")
    with pytest.raises(NotImplementedError, match="without expert parallelism"):
        TokenShardedPrefill(ep, rank=0, world=2, collectives=LocalCollectives())
    model = _model(str(tiny_checkpoint("k3-tiny")))
    runner = TokenShardedPrefill(model, rank=0, world=1, collectives=LocalCollectives())
    pool, row = new_cache(model, 16)
    with pytest.raises(ValueError, match="holds 16 tokens; the prompt has 17"):
        runner.prefill([1] * 17, pool.views, block_row=row, state_row=STATE_ROW, page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="at least one prompt token"):
        runner.prefill([], pool.views, block_row=row, state_row=STATE_ROW, page_size=PAGE_SIZE)
