"""k3.LLM in vLLM's shape, and tensor parallelism through it."""

import pytest

import k3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3-tiny", tmp_path_factory.mktemp("llm-k3-tiny"), progress=False)


def test_generate_strings_and_token_ids(ckpt):
    llm = k3.LLM(str(ckpt), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False)
    params = k3.SamplingParams(max_tokens=5, temperature=0)
    outs = llm.generate(["Hello", {"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert outs[0].prompt == "Hello" and outs[1].prompt_token_ids == [5, 6, 7]
    assert isinstance(outs[0].outputs[0].text, str)
    chat = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"tokens": [1]}, params, use_tqdm=False)


def test_tensor_parallel_two_ranks_equal_one(ckpt):
    prompts = [{"prompt_token_ids": [(7 * i) % 300 + 1 for i in range(n)]} for n in (12, 3, 25)]
    params = k3.SamplingParams(max_tokens=8, temperature=0)
    one = k3.LLM(str(ckpt), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = k3.LLM(str(ckpt), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        two.shutdown()


def test_stats_report_prefix_cache_and_speculation(ckpt):
    llm = k3.LLM(str(ckpt), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False, max_num_seqs=4,
                 enable_prefix_caching=True, block_size=64, prefix_match_unit=16,
                 speculative_config={"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 2})
    shared = [(7 * i) % 300 + 1 for i in range(80)]
    params = k3.SamplingParams(max_tokens=6, temperature=0)
    llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": shared + [3, 4, 5]}], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["requests_total"] == 2 and stats["generation_tokens_total"] == 12
    assert stats["prefix_cache_queries_total"] == 2 and stats["prefix_cache_hits_total"] == 1
    assert stats["prefix_cache_reused_tokens_total"] == 64 and stats["prefix_cache_checkpoint_rows"] >= 1
    assert stats["spec_verify_steps_total"] > 0
    # an identical draft: every drafted token accepted
    assert stats["spec_accepted_tokens_total"] == stats["spec_draft_tokens_total"] > 0
    assert stats["spec_acceptance_per_position"] == [1.0, 1.0]
