"""Cache plan: record sizes, row layout, default block sizes, capacity terms, `k3 plan`."""

import json

import pytest
import torch

from k3.cache.capacity import GIB, plan_capacity, weight_bytes_per_gpu
from k3.cache.plan import default_block_size, row_layout
from k3.cache.records import attention_bytes_per_token
from k3.cli.main import main
from k3.config import K3Config

K3, PRO = K3Config.preset("kimi-k3"), K3Config.preset("kimi-k3.1-pro")


@pytest.mark.parametrize("cfg,kv,index,expected", [
    (K3, "fp8", "fp8", 13_824), (PRO, "fp8", "fp8", 16_992), (PRO, "nvfp4", "mxfp4", 10_080),
    (K3, "bf16", "fp8", 27_648), (PRO, "fp8", "mxfp4", 24 * (576 + 68)),
])
def test_bytes_per_token_per_gpu(cfg, kv, index, expected):
    assert attention_bytes_per_token(cfg, kv_cache_dtype=kv, index_cache_dtype=index) == expected


@pytest.mark.parametrize("tp,kv,index,block", [
    (8, "fp8", "fp8", 4096), (8, "bf16", "fp8", 2048), (8, "nvfp4", "mxfp4", 8192), (1, "fp8", "fp8", 32768),
])
def test_default_block_sizes_of_the_design(tp, kv, index, block):
    assert default_block_size(PRO, tensor_parallel_size=tp, kv_cache_dtype=kv, index_cache_dtype=index) == block


def test_row_layout_regions_do_not_overlap_and_are_aligned():
    layout = row_layout(PRO, block_size=4096, tensor_parallel_size=8, kv_cache_dtype="fp8", index_cache_dtype="fp8")
    for regions in (layout.attention_regions, layout.state_regions):
        ends = 0
        for r in regions:
            assert r.offset % 256 == 0 and r.offset >= ends
            ends = r.offset + r.nbytes
        assert ends <= layout.row_bytes
    assert len(layout.attention_regions) == 48 and len(layout.state_regions) == 2 * 69
    assert layout.attention_bytes >= layout.state_bytes           # an attention row can hold a state
    assert layout.row_bytes % 256 == 0
    with pytest.raises(ValueError, match="power of two"):
        row_layout(PRO, block_size=3000, tensor_parallel_size=8, kv_cache_dtype="fp8", index_cache_dtype="fp8")


def test_capacity_terms_add_up():
    r = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=288 * GIB)
    assert r.usable_bytes == int(288 * GIB * 0.9)
    assert r.cache_bytes == r.usable_bytes - r.weight_bytes_per_gpu - r.workspace_bytes
    assert r.num_rows == r.cache_bytes // r.row_bytes
    assert r.rows_per_max_len_request == 1_048_576 // 4096 + 1
    assert r.concurrent_max_len_requests == r.num_rows // r.rows_per_max_len_request
    assert r.capacity_tokens == (r.num_rows - r.concurrent_max_len_requests) * 4096
    dcp = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, decode_context_parallel_size=8,
                        gpu_memory_bytes=288 * GIB)
    assert dcp.bytes_per_token_per_gpu == r.bytes_per_token_per_gpu      # not divided by DCP
    assert dcp.concurrent_max_len_requests > 5 * r.concurrent_max_len_requests


def test_weights_per_gpu_split_under_tp():
    tp1, tp8 = weight_bytes_per_gpu(K3, 1), weight_bytes_per_gpu(K3, 8)
    assert 1.40e12 < tp1 < 1.62e12                   # ~1.45 TiB: MXFP4 experts + bf16 rest
    assert tp1 / 8 < tp8 < tp1 / 6                   # replicated latents, router, norms


def test_weights_that_do_not_fit_give_zero_and_a_note():
    r = plan_capacity(K3, kv_cache_dtype="fp8", tensor_parallel_size=1, gpu_memory_bytes=80 * GIB)
    assert r.capacity_tokens == 0 and r.num_rows == 0 and "exceed the usable memory" in r.notes[0]


def test_k3_plan_json(capsys):
    assert main(["plan", "--preset", "kimi-k3.1-pro", "--kv-cache-dtype", "nvfp4", "--index-cache-dtype", "mxfp4",
                 "--tensor-parallel-size", "8", "--gpu-memory", "288", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token_per_gpu"] == 10_080 and out["block_size"] == 8192
    for key in ("bytes_per_token_per_gpu", "state_bytes_per_request", "block_size", "capacity_tokens"):
        assert isinstance(out[key], int)


def test_k3_plan_does_not_fit_exits_zero(capsys):
    assert main(["plan", "--preset", "kimi-k3", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "capacity:           0 tokens" in out and "exceed the usable memory" in out


def test_k3_plan_bad_block_size(capsys):
    assert main(["plan", "--preset", "k3-tiny", "--block-size", "100"]) == 2
    assert "power of two" in capsys.readouterr().err


def test_speculative_scratch_rows_come_out_of_the_capacity():
    plain = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=288 * GIB,
                          max_num_seqs=16)
    spec = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=288 * GIB,
                         max_num_seqs=16, num_speculative_tokens=3)
    recover = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=288 * GIB,
                            max_num_seqs=16, num_speculative_tokens=3, kda_rollback="recover")
    assert spec.speculative_scratch_rows == 16 * (1 + 3) and recover.speculative_scratch_rows == 0
    assert spec.num_rows == plain.num_rows                                 # same memory, fewer rows for tokens
    assert spec.concurrent_max_len_requests == (plain.num_rows - 64) // plain.rows_per_max_len_request
    assert spec.capacity_tokens == (plain.num_rows - 64 - spec.concurrent_max_len_requests) * 4096
    assert recover.capacity_tokens == plain.capacity_tokens


def test_prefix_caching_reserves_nothing_and_says_what_checkpoints_take():
    plain = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=288 * GIB)
    cached = plan_capacity(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8, gpu_memory_bytes=288 * GIB,
                           prefix_caching=True, kda_checkpoint_interval=4096)
    assert cached.capacity_tokens == plain.capacity_tokens and plain.prefix_checkpoint_rows_per_chunk == 0
    assert cached.prefix_checkpoint_rows_per_chunk >= 2 and any("prefix caching reserves nothing" in n
                                                                for n in cached.notes)


def test_workspace_covers_the_largest_forward_the_scheduler_runs():
    from k3.cache.capacity import activation_bytes_per_token, prefill_token_limit, workspace_bytes

    limit = prefill_token_limit(PRO, 2048, accelerator=True)
    assert limit > 2048                                                    # a lone request prefills larger chunks
    assert workspace_bytes(PRO, 2048) >= limit * activation_bytes_per_token(PRO)


def test_k3_plan_on_a_checkpoint_follows_its_dtype_and_reserves_speculation(capsys, tmp_path):
    from k3.cli.checkpoint import init_checkpoint

    path = init_checkpoint("k3-tiny", tmp_path / "tiny", progress=False)
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert main(["plan", "--model", str(path), "--gpu-memory", "16", "--max-num-seqs", "8",
                 "--speculative-config", spec, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    from k3.config import K3Config

    cfg = K3Config.from_pretrained(path)
    assert out["kv_cache_dtype"] == {"float32": "fp32", "bfloat16": "bf16"}[cfg.dtype]
    assert out["speculative_scratch_rows"] == 8 * 3 and out["capacity_tokens"] > 0
    assert main(["plan", "--model", str(path), "--speculative-config", "{bad"]) == 2
    assert "--speculative-config" in capsys.readouterr().err


def test_weights_count_what_the_engine_folds_at_load():
    """MLA's absorbed decode weights (kv_b_proj's elements once more) and the AttnRes logit
    weights are allocated by K3Model.fold_weights beside the parameters: the plan counts them."""
    from k3.model import K3ForCausalLM

    cfg = K3Config.preset("k3-tiny")
    model = K3ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    params = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    kv_b = sum(t.numel() * t.element_size() for name, t in model.named_parameters() if name.endswith("kv_b_proj"))
    assert kv_b > 0 and weight_bytes_per_gpu(cfg, 1) == params + model.model.folded_weight_bytes()
    assert model.model.folded_weight_bytes() >= kv_b
    real = K3ForCausalLM(cfg, dtype=torch.bfloat16)
    real.model.fold_weights()
    folded = [t for m in real.modules() if getattr(m, "_absorbed", None) for t in m._absorbed[1:]]
    folded += [q for _, _, q in real.model._folded_queries.values()]
    assert sum(t.numel() * t.element_size() for t in folded) == real.model.folded_weight_bytes()


def test_cache_format_resolves_auto_once():
    """"auto" latents follow the activation dtype and the default block is the planner's; the
    platform gives the alignment and KDA state layout."""
    import torch

    from k3.cache.format import CacheFormat

    class Platform:
        cache_alignment, kda_state_layout = 4096, "hvk"

    fmt = CacheFormat.build(PRO, activation_dtype=torch.float32, tensor_parallel_size=8, platform=Platform())
    assert fmt.kv_cache_dtype == "fp32" and fmt.alignment == 4096 and fmt.kda_state_layout == "hvk"
    assert fmt.block_size == default_block_size(PRO, tensor_parallel_size=8, kv_cache_dtype="fp32",
                                                index_cache_dtype="fp8", activation_dtype="float32")
    bf16 = CacheFormat.build(PRO, kv_cache_dtype="fp8", tensor_parallel_size=8)
    assert bf16.activation_dtype == torch.bfloat16 and bf16.kv_cache_dtype == "fp8" and bf16.block_size == 4096
    assert bf16.layout(PRO) == row_layout(PRO, block_size=4096, tensor_parallel_size=8, kv_cache_dtype="fp8",
                                          index_cache_dtype="fp8")
    with pytest.raises(ValueError, match="index cache dtype"):
        CacheFormat.build(PRO, index_cache_dtype="int4")


def test_cache_plan_assigns_every_row_up_front():
    """Token rows first, then the graph scratch row, then the speculative scratch rows; the
    "recover" rollback's record slots beside them; max_model_len fits the token rows."""
    from k3.cache.format import CacheFormat
    from k3.cache.plan import plan_cache

    cfg = K3Config.preset("k3-tiny")
    fmt = CacheFormat.build(cfg, block_size=64)
    row = fmt.layout(cfg).row_bytes
    plan = plan_cache(cfg, fmt, cache_bytes=100 * row + 7, max_num_seqs=4, num_speculative_tokens=3,
                      graph_scratch=True)
    assert plan.num_rows == 100 and plan.spec_rows == range(84, 100) and plan.graph_scratch_row == 83
    assert plan.token_rows == 83 and plan.record_slots == 0
    assert plan.max_model_len == min(cfg.max_position_embeddings, 82 * 64)
    recover = plan_cache(cfg, fmt, cache_bytes=100 * row, max_num_seqs=4, num_speculative_tokens=3,
                         kda_rollback="recover")
    assert recover.token_rows == 100 and not recover.spec_rows
    assert (recover.record_slots, recover.record_tokens) == (4, 4)
    with pytest.raises(ValueError, match="too few for the 16 speculative scratch rows"):
        plan_cache(cfg, fmt, cache_bytes=16 * row, max_num_seqs=4, num_speculative_tokens=3)


def test_one_dtype_vocabulary():
    import torch

    from k3.dtypes import DTYPES, dtype_name, resolve_kv_cache_dtype, torch_dtype

    assert all(dtype_name(torch_dtype(name)) == name for name in DTYPES)
    assert torch_dtype("half") == torch.float16 and torch_dtype("float") == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == "bf16"
    assert resolve_kv_cache_dtype("auto", "float64") == "fp64"
    assert resolve_kv_cache_dtype("fp8", torch.float64) == "fp8"
    with pytest.raises(ValueError, match="expected one of"):
        torch_dtype("bf16")
