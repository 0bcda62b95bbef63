"""Expert parallelism (float64): 4 gloo processes run every scenario of ep_worker.py in one
launch (EP = 4 and EP = 2 with distinct prompts per rank, TP = 2 x EP = 2 with replicated
prompts, DP = 2 x TP = 2 with EP = 4 over both, idle data-parallel ranks, decode steps), in both
dispatch variants, and every busy rank must get the logits of EP = 1 to 1e-9. In one process:
placement errors, the static capacity, a sync-free decode capture, and the loader reading only
the rank's experts."""

import functools
import re
from pathlib import Path

import pytest
import torch

import k3.checkpoint.shard_file as shard_file
from ep_worker import SCENARIOS, WORLD, prompts
from k3.checkpoint.loader import load_checkpoint, load_model
from k3.config import K3Config
from k3.model import ExpertParallel, K3ForCausalLM, ParallelContext
from model_runs import teacher_forced
from rank_launch import one_thread, run_ranks  # noqa: F401 (one_thread: an autouse fixture)

WORKER = Path(__file__).with_name("ep_worker.py")
MODES = ("all_to_all", "all_to_all_static")
ALL = ("k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny")
# (scenario, presets, chunk, trim): chunk 1 = decode steps (prompts trimmed to 5 + owner tokens,
# so ranks finish at different steps and fill the rest with idle_forward)
PLAN = (("ep4", ALL, 6, None), ("ep2", ALL, 6, None), ("ep4_idle", ALL[1:], 6, None),
        ("tp2_ep2", ALL[1:], 6, None), ("dp2_tp2_ep4", ALL[:2], 6, None), ("dp2_tp2_ep4_idle", ALL[2:], 6, None),
        ("ep4", ALL[:1], 1, 5), ("dp2_tp2_ep4", ALL[2:], 1, 5))



@pytest.fixture(scope="module")
def ep_runs(tiny_checkpoint, tmp_path_factory):
    """{(scenario, preset, chunk, mode): (jobs entry, [rank results or None])} for PLAN."""
    work = tmp_path_factory.mktemp("ep")
    jobs = [{"scenario": s, "mode": m, "checkpoint": str(tiny_checkpoint(p)), "chunk": c, "trim": t, "preset": p}
            for s, presets, c, t in PLAN for p in presets for m in MODES]
    ranks = run_ranks(WORKER, jobs, work, WORLD)
    return {(j["scenario"], j["preset"], j["chunk"], j["mode"]): (j, [r.get(i) for r in ranks])
            for i, j in enumerate(jobs)}


@functools.cache
def _ep1(path: str, owner: int, chunk: int, trim: int | None) -> list[torch.Tensor]:
    return teacher_forced(load_model(path, dtype=torch.float64, progress=False), prompts(owner, trim), chunk=chunk)


def _check(ep_runs, scenario: str, chunk: int = 6) -> int:
    """Every busy rank of every job of `scenario` has EP = 1's logits and holds its own block
    of experts; idle ranks returned nothing. Returns the number of rank results checked."""
    _, ep, owners, idle = SCENARIOS[scenario]
    ep_size = WORLD if ep == "world" else 2
    checked = 0
    for (s, preset, c, mode), (job, ranks) in ep_runs.items():
        if s != scenario or c != chunk:
            continue
        for rank, res in enumerate(ranks):
            if rank in idle:
                assert res is None
                continue
            el = 8 // ep_size
            assert res["experts"] == ((rank % ep_size) * el, el), (scenario, rank)
            want = _ep1(job["checkpoint"], owners[rank], chunk, job["trim"])
            assert len(res["logits"]) == len(want)
            for a, b in zip(want, res["logits"]):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-9,
                                           msg=lambda m: f"{scenario} {preset} {mode} chunk {chunk} rank {rank}: {m}")
            checked += 1
    return checked


def test_ep4_equals_ep1_distinct_prompts(ep_runs):
    assert _check(ep_runs, "ep4") == 3 * 2 * 4


def test_ep2_equals_ep1_distinct_prompts(ep_runs):
    """Two EP = 2 groups ({0, 1}, {2, 3}) at once."""
    assert _check(ep_runs, "ep2") == 3 * 2 * 4


def test_idle_rank_keeps_the_others_in_lockstep(ep_runs):
    """Rank 3 only calls idle_forward (no tokens, no cache) as often as the others call forward;
    ranks 0-2 still get EP = 1's logits (rank 3's experts served them)."""
    assert _check(ep_runs, "ep4_idle") == 2 * 2 * 3


def test_tp2_ep2_replicated_tokens(ep_runs):
    """TP = 2 attention with EP = 2 over the same two ranks: each TP rank dispatches half the
    tokens and the halves are all-gathered."""
    assert _check(ep_runs, "tp2_ep2") == 2 * 2 * 4


def test_dp2_tp2_ep4(ep_runs):
    """Two data-parallel replicas of TP = 2, EP = 4 over all of them: tokens distinct per
    replica and replicated (split) inside it."""
    assert _check(ep_runs, "dp2_tp2_ep4") == 2 * 2 * 4


def test_idle_replica_of_tp_ranks(ep_runs):
    """Both TP ranks of replica 1 are idle while replica 0 runs."""
    assert _check(ep_runs, "dp2_tp2_ep4_idle") == 1 * 2 * 2


def test_decode_steps_with_idle_fill(ep_runs):
    """One token per sequence per call (the decode path), ranks finishing at different steps
    and filling the rest with idle_forward; with TP = 2 a slice is sometimes empty (T = 0)."""
    assert _check(ep_runs, "ep4", chunk=1) == 2 * 4
    assert _check(ep_runs, "dp2_tp2_ep4", chunk=1) == 2 * 4


def test_num_experts_not_divisible_by_ep_size():
    cfg = K3Config.preset("k3-tiny")
    parallel = ParallelContext(ep=ExpertParallel(rank=1, size=3))
    with pytest.raises(ValueError, match="num_experts = 8 does not split evenly over expert-parallel size 3"):
        K3ForCausalLM(cfg, parallel=parallel, dtype=torch.float64, device="meta")


def test_expert_parallel_record_errors():
    with pytest.raises(ValueError, match="unknown MoE dispatch 'ring'"):
        ExpertParallel(dispatch="ring")
    with pytest.raises(ValueError, match="expert-parallel rank 2 is outside expert-parallel size 2"):
        ExpertParallel(rank=2, size=2)
    with pytest.raises(ValueError, match="capacity must be >= 0 tokens, got -1"):
        ExpertParallel(capacity=-1)


def test_static_capacity_per_step(tiny_checkpoint):
    """EP group of one (identity collectives): the forward's ep_dispatch / ep_capacity override
    the record's; the static variant with a capacity that bounds the step equals no EP, and a
    missing or too small one is a clear error (also for idle_forward)."""
    path = tiny_checkpoint("k3-tiny")
    model = load_model(path, dtype=torch.float64, progress=False, parallel=ParallelContext(ep=ExpertParallel()))
    forward = model.forward
    for capacity in (12, 40):                # 2 prompts x 6 tokens per call at most
        model.forward = functools.partial(forward, ep_dispatch="all_to_all_static", ep_capacity=capacity)
        got = teacher_forced(model, prompts(0), chunk=6)
        for a, b in zip(_ep1(str(path), 0, 6, None), got):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-9)
    model.forward = functools.partial(forward, ep_dispatch="all_to_all_static", ep_capacity=11)
    with pytest.raises(ValueError, match="12 tokens in one MoE call exceed the expert-parallel capacity of 11"):
        teacher_forced(model, prompts(0), chunk=6)
    with pytest.raises(ValueError, match="'all_to_all_static' needs a capacity"):
        model.idle_forward(ep_dispatch="all_to_all_static")
    model.idle_forward(ep_dispatch="all_to_all_static", ep_capacity=4)     # zero tokens: runs
    model.idle_forward()                                                     # host-sized: runs


def _moe_capture(model):
    """Compile one MoE layer on a 2-token decode batch with fullgraph=True (the CPU proxy for a
    captured graph); returns (eager, compiled) outputs."""
    moe = next(layer.block_sparse_moe for layer in model.model.layers if layer.is_moe)
    h = torch.randn(2, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    captured = torch.compile(lambda x: moe(x, decode=True), fullgraph=True, backend="eager")
    return moe(h, decode=True), captured(h)


def test_static_dispatch_has_no_host_sync(tiny_checkpoint):
    """The static dispatch of a decode batch compiles as one graph and computes what eager mode
    does; the host-sized dispatch cannot (its split sizes are read on the host)."""
    path = tiny_checkpoint("k3.1-pro-tiny")
    static = ParallelContext(ep=ExpertParallel(dispatch="all_to_all_static", capacity=2))
    eager, compiled = _moe_capture(load_model(path, dtype=torch.float32, progress=False, parallel=static))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    exact = load_model(path, dtype=torch.float32, progress=False, parallel=ParallelContext(ep=ExpertParallel()))
    with pytest.raises(Exception, match="tolist|item|data-dependent|Unsupported"):
        _moe_capture(exact)


_SAFE_OPEN = shard_file.safe_open


class _CountingReader:
    """safe_open that records the keys whose data is read (get_tensor, or indexing a slice)."""

    def __init__(self, read: list[str]):
        self.read = read

    def __call__(self, path, framework):
        reader, read = _SAFE_OPEN(path, framework=framework), self.read

        class Slice:
            def __init__(self, key):
                self.key, self.view = key, reader.get_slice(key)

            def __getattr__(self, name):
                return getattr(self.view, name)

            def __getitem__(self, index):
                read.append(self.key)
                return self.view[index]

        class File:
            def __enter__(self):
                reader.__enter__()
                return self

            def __exit__(self, *exc):
                return reader.__exit__(*exc)

            def keys(self):
                return reader.keys()

            def get_slice(self, key):
                return Slice(key)

            def get_tensor(self, key):
                read.append(key)
                return reader.get_tensor(key)

        return File()


@pytest.mark.parametrize("preset,ep_size", [("k3.1-pro-tiny", 4), ("kimi-linear-tiny", 2)])
def test_loader_reads_only_the_ranks_experts(tiny_checkpoint, monkeypatch, preset, ep_size):
    """Every expert tensor the loader reads (counted at the safetensors reader) belongs to the
    rank's block, each of its experts' tensors is read once, and the weights match the full
    model's slice."""
    cfg = K3Config.preset(preset)
    path = tiny_checkpoint(preset)
    full = load_model(path, dtype=torch.float64, progress=False)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    per_expert = 3 * (2 if cfg.experts_mxfp4 else 1)     # w1, w3, w2 (MXFP4: weight_packed + weight_scale)
    el = cfg.num_experts // ep_size
    for rank in range(ep_size):
        read: list[str] = []
        monkeypatch.setattr(shard_file, "safe_open", _CountingReader(read))
        model = K3ForCausalLM(cfg, parallel=ParallelContext(ep=ExpertParallel(rank=rank, size=ep_size)),
                              dtype=torch.float64)
        report = load_checkpoint(model, path, progress=False)
        experts = [int(m.group(1)) for k in read if (m := re.search(r"\.experts\.(\d+)\.", k))]
        assert sorted(set(experts)) == list(range(rank * el, (rank + 1) * el))
        assert len(experts) == len(set(k for k in read if ".experts." in k)) == moe_layers * el * per_expert
        assert report.skipped["another rank's expert"] == moe_layers * (cfg.num_experts - el) * per_expert
        names = ("w13_packed", "w2_scale") if cfg.experts_mxfp4 else ("w13", "w2")
        for mine, whole in zip(model.modules(), full.modules()):
            if hasattr(mine, "expert_start"):
                assert (mine.expert_start, mine.num_local_experts) == (rank * el, el)
                for name in names:
                    torch.testing.assert_close(getattr(mine, name), getattr(whole, name)[rank * el:(rank + 1) * el],
                                               rtol=0, atol=0)
