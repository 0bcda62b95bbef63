"""`k3 plan` for distributed topologies: weights per GPU under TP / DP / EP against what each
rank really holds, fits / does not fit and the suggested topology on the full-size presets,
the JSON keys, the flag errors, and docs/planning.md against its generator."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from k3.cache.capacity import GIB, plan_capacity, weight_bytes_per_gpu, weight_terms_per_gpu
from k3.cache.topology import Topology, candidate_topologies
from k3.cli.main import main
from k3.config import K3Config

ROOT = Path(__file__).resolve().parents[3]
K3, PRO = K3Config.preset("kimi-k3"), K3Config.preset("kimi-k3.1-pro")
H200, MI355X = int(131.3 * GIB), int(268.2 * GIB)
EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.")
ROUTED = ("w13", "w13_packed", "w13_scale", "w2", "w2_packed", "w2_scale")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3-tiny", tmp_path_factory.mktemp("tiny") / "k3-tiny", progress=False)


def _checkpoint_expert_bytes(path: Path) -> dict[int, int]:
    """Bytes of every routed expert's tensors (all layers) as the checkpoint stores them."""
    from safetensors import safe_open

    out: dict[int, int] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for key in h.keys():
                m = EXPERT.search(key)
                if m:
                    t = h.get_tensor(key)
                    out[int(m.group(1))] = out.get(int(m.group(1)), 0) + t.numel() * t.element_size()
    return out


def _loaded_non_expert_bytes(path: Path, tp: int, rank: int) -> int:
    """Bytes TP rank `rank` really holds once loaded and folded, its routed experts aside."""
    from k3.checkpoint.loader import load_model
    from k3.model import ParallelContext

    model = load_model(path, parallel=ParallelContext(rank=rank, world_size=tp), progress=False)
    model.model.fold_weights()
    held = [t for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if n.rsplit(".", 1)[-1] not in ROUTED]
    held += [t for m in model.modules() if getattr(m, "_absorbed", None) for t in m._absorbed[1:]]
    held += [q for _, _, q in model.model._folded_queries.values()]
    return sum(t.numel() * t.element_size() for t in held)


@pytest.mark.parametrize("tp,dp,ep", [(2, 2, 4), (2, 2, 2), (1, 4, 4), (2, 2, None), (4, 1, 4)])
def test_weights_per_gpu_equal_what_each_rank_holds(tiny_checkpoint, tp, dp, ep):
    """Every GPU r = dp_rank x TP + tp_rank holds TP rank tp_rank's loaded non-expert weights
    (a real model loaded from the checkpoint) plus the checkpoint tensors of its routed experts:
    EP rank r mod EP's num_experts / EP of them with expert parallelism, TP rank tp_rank's
    num_experts / TP without. The plan (meta-device count) must equal every rank's sum."""
    cfg = K3Config.from_pretrained(tiny_checkpoint)
    experts = _checkpoint_expert_bytes(tiny_checkpoint)
    assert sorted(experts) == list(range(cfg.num_experts))
    split = ep or tp
    per_rank = cfg.num_experts // split
    planned = weight_terms_per_gpu(cfg, tp, ep)
    assert planned.experts_per_rank == per_rank
    non_expert = {t: _loaded_non_expert_bytes(tiny_checkpoint, tp, t) for t in range(tp)}
    for r in range(tp * dp):
        group = (r % ep) if ep else (r % tp)
        mine = sum(experts[e] for e in range(group * per_rank, (group + 1) * per_rank))
        assert planned.routed_experts == mine
        assert planned.total == non_expert[r % tp] + mine == weight_bytes_per_gpu(cfg, tp, ep)


def test_expert_parallel_divides_the_routed_experts_only():
    tp8 = weight_terms_per_gpu(K3, 8)
    ep32 = weight_terms_per_gpu(K3, 8, 32)
    assert (tp8.experts_per_rank, ep32.experts_per_rank) == (112, 28)
    assert ep32.routed_experts * 4 == tp8.routed_experts
    for part in ("attention", "shared_dense", "embedding_lm_head", "other"):
        assert getattr(ep32, part) == getattr(tp8, part) > 0
    assert weight_bytes_per_gpu(K3, 8) == tp8.total                        # the TP-only figure is unchanged
    assert weight_terms_per_gpu(PRO, 8).attention > tp8.attention          # the DSA indexer


def test_data_parallel_without_ep_replicates_and_multiplies_the_capacity():
    one = plan_capacity(K3, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=MI355X)
    dp4 = plan_capacity(K3, kv_cache_dtype="fp8", tensor_parallel_size=8, data_parallel_size=4,
                        gpu_memory_bytes=MI355X)
    assert dp4.weight_bytes_per_gpu == one.weight_bytes_per_gpu and dp4.capacity_tokens == one.capacity_tokens
    assert dp4.capacity_tokens_total == 4 * one.capacity_tokens and one.capacity_tokens_total == one.capacity_tokens
    assert (dp4.world_size, dp4.nnodes, dp4.gpus_per_node) == (32, 4, 8)


def test_k3_on_8_h200_does_not_fit_and_the_suggestion_is_the_smallest_that_does():
    r = plan_capacity(K3, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=H200,
                      max_model_len=1 << 20)
    assert not r.fits and r.capacity_tokens == 0
    s = r.suggested
    assert s["world_size"] == 32 and s["enable_expert_parallel"] and s["expert_parallel_size"] == 32
    assert (s["tensor_parallel_size"], s["data_parallel_size"], s["nnodes"], s["gpus_per_node"]) == (4, 8, 4, 8)
    fitting = plan_capacity(K3, kv_cache_dtype="fp8", tensor_parallel_size=4, data_parallel_size=8,
                            expert_parallel_size=32, gpu_memory_bytes=H200, max_model_len=1 << 20)
    assert fitting.fits and fitting.suggested is None and fitting.concurrent_max_len_requests >= 1
    # 16 GPUs with EP hold the weights but not one 1M-token request; TP 8 beats TP 4 only on TP
    sixteen = plan_capacity(K3, kv_cache_dtype="fp8", tensor_parallel_size=8, data_parallel_size=2,
                            expert_parallel_size=16, gpu_memory_bytes=H200, max_model_len=1 << 20)
    assert not sixteen.fits and sixteen.weight_bytes_per_gpu + sixteen.workspace_bytes < sixteen.usable_bytes
    assert sixteen.concurrent_max_len_requests == 0
    tp8_32 = plan_capacity(K3, kv_cache_dtype="fp8", tensor_parallel_size=8, data_parallel_size=4,
                           expert_parallel_size=32, gpu_memory_bytes=H200, max_model_len=1 << 20)
    assert tp8_32.fits                                                  # also fits; fewer TP comes first
    # at 128K the 16-GPU plan fits, and is suggested
    short = plan_capacity(K3, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=H200,
                          max_model_len=128 * 1024)
    assert not short.fits and short.suggested["world_size"] == 16


def test_fits_on_mi355x_and_what_fits_means():
    r = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, expert_parallel_size=8,
                      gpu_memory_bytes=MI355X, max_model_len=1 << 20)
    assert r.fits and r.concurrent_max_len_requests >= 1 and r.suggested is None
    assert "at least one max-length request" in r.fits_criterion
    # weights fit but a request longer than the cache does not
    long = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=MI355X,
                         max_model_len=1 << 30, suggest=False)
    assert long.cache_bytes > 0 and long.concurrent_max_len_requests == 0 and not long.fits


def test_candidate_order_fewest_gpus_then_ep_then_fewer_tp():
    first = [(t.world_size, t.expert_parallel_size, t.tensor_parallel_size)
             for t in candidate_topologies(max_gpus=16)]
    assert first[:4] == [(1, None, 1), (2, 2, 1), (2, 2, 2), (2, None, 1)]
    sixteen = [c for c in first if c[0] == 16]
    assert sixteen == [(16, 16, 1), (16, 16, 2), (16, 16, 4), (16, 16, 8),
                       (16, None, 1), (16, None, 2), (16, None, 4), (16, None, 8)]
    assert not any(c[0] in (9, 10, 12) for c in first)                    # beyond a node: whole nodes only


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_parallel_size=8, data_parallel_size=2, nnodes=3), "--nnodes 3 does not divide the 16 GPUs"),
    (dict(tensor_parallel_size=8, data_parallel_size=2, nnodes=2, gpus_per_node=4),
     r"--nnodes 2 x --gpus-per-node 4 = 8 GPUs, but --tensor-parallel-size 8 x --data-parallel-size 2 = 16"),
    (dict(tensor_parallel_size=4, data_parallel_size=3, expert_parallel_size=8),
     r"--expert-parallel-size 8 must divide --tensor-parallel-size 4 x --data-parallel-size 3 = 12"),
    (dict(tensor_parallel_size=4, data_parallel_size=2, expert_parallel_size=2), "be a multiple of TP"),
    (dict(tensor_parallel_size=2, data_parallel_size=3, gpus_per_node=4), "--gpus-per-node 4 does not divide"),
    (dict(tensor_parallel_size=1, data_parallel_size=0), "--data-parallel-size must be at least 1"),
])
def test_bad_topologies_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Topology.build(**kwargs)


def test_experts_that_do_not_split_error():
    with pytest.raises(ValueError, match="num_experts = 896 does not split evenly over expert-parallel size 3"):
        plan_capacity(K3, tensor_parallel_size=1, data_parallel_size=3, expert_parallel_size=3)


def test_k3_plan_json_topology_keys(capsys):
    assert main(["plan", "--preset", "kimi-k3", "--kv-cache-dtype", "fp8", "--gpu-memory", "131.3",
                 "--tensor-parallel-size", "8", "--data-parallel-size", "4", "--enable-expert-parallel",
                 "--max-model-len", "131072", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("weight_bytes_per_gpu", "capacity_tokens", "capacity_tokens_total", "fits", "fits_criterion",
                "suggested", "data_parallel_size", "expert_parallel_size", "nnodes", "gpus_per_node", "world_size",
                "weight_terms"):
        assert key in out, key
    assert out["fits"] is True and out["suggested"] is None and out["expert_parallel_size"] == 32
    assert out["capacity_tokens_total"] == 4 * out["capacity_tokens"] > 0
    assert out["weight_terms"]["total"] == out["weight_bytes_per_gpu"]
    assert out["weight_terms"]["experts_per_rank"] == 28


def test_k3_plan_does_not_fit_line_and_terms(capsys):
    assert main(["plan", "--preset", "kimi-k3", "--kv-cache-dtype", "fp8", "--gpu-memory", "131.3",
                 "--tensor-parallel-size", "8"]) == 0
    out = capsys.readouterr().out
    for term in ("attention:", "routed experts:", "shared experts/dense:", "embedding + lm_head:", "other:"):
        assert term in out, term
    assert ("does not fit: 192.14 GiB of weights per GPU + 6.00 GiB workspace exceed the usable 118.17 GiB; "
            "smallest fitting topology: --tensor-parallel-size 4 --data-parallel-size 8 --enable-expert-parallel "
            "(32 GPUs, 4 nodes of 8)") in out
    assert main(["plan", "--preset", "kimi-k3", "--kv-cache-dtype", "fp8", "--gpu-memory", "131.3",
                 "--tensor-parallel-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["suggested"]["flags"] == [
        "--tensor-parallel-size", "4", "--data-parallel-size", "8", "--enable-expert-parallel",
        "--nnodes", "4", "--gpus-per-node", "8"]


@pytest.mark.parametrize("argv,message", [
    (["--tensor-parallel-size", "8", "--nnodes", "2", "--gpus-per-node", "8"],
     "--nnodes 2 x --gpus-per-node 8 = 16 GPUs, but --tensor-parallel-size 8 x --data-parallel-size 1 = 8 GPUs"),
    (["--tensor-parallel-size", "2", "--data-parallel-size", "3", "--enable-expert-parallel"],
     "num_experts = 8 does not split evenly over expert-parallel size 6"),
    (["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--expert-parallel-size", "3"],
     "--expert-parallel-size 3 must divide"),
])
def test_k3_plan_bad_topology_exits_2(capsys, argv, message):
    assert main(["plan", "--preset", "k3-tiny", *argv]) == 2
    assert message in capsys.readouterr().err


def _plans_module():
    spec = importlib.util.spec_from_file_location("plans", ROOT / "bench" / "plans.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_planning_table_is_the_generated_one():
    """docs/planning.md's table between its markers is `python bench/plans.py`'s output."""
    doc = (ROOT / "docs" / "planning.md").read_text()
    plans = _plans_module()
    begin, end = doc.index(plans.BEGIN) + len(plans.BEGIN), doc.index(plans.END)
    assert doc[begin:end].strip() == plans.table().strip(), "regenerate: python bench/plans.py --write"
