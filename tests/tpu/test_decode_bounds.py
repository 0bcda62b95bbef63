"""Decode graphs at context bounds on the tpu platform (PJRT CPU): the XLA runner sets
`table_width_buckets`, so a bucket's decode graph is also compiled at narrower context bounds
the first time a step needs one, and its MLA decode reads each page's first `bound` slots
(`k3.model.paging.bounded_pages`) instead of max_model_len positions.

One k3-tiny engine (128-token pages, max_model_len 2048: 16 pages), the bounds patched to
24 / 64 tokens / the full width so that a 6-token prompt decoding 30 tokens crosses from the
24-token bound (captured at start-up) to the 64-token one inside the first page. The same
requests are then decoded again with the bounds switched off (the full-width graph, captured on
that run's first step): the greedy tokens must be the same, each run must have compiled exactly
its one late graph, and every decode step must have replayed.
"""

import statistics
import time

PROMPTS = [[5, 17, 3, 99, 41, 8], [250, 7, 7, 7, 12, 64]]
DECODE = 30


def _decode(engine, tag, compiles):
    """(greedy tokens per prompt, median seconds of a step, steps that compiled): the median is
    a decode step's (most steps are), compiles included in the steps that took them."""
    from k3.engine.params import SamplingParams

    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(max_tokens=DECODE, temperature=0, ignore_eos=True))
    done, steps, compiling = {}, [], 0
    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), compiles()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps.append(time.perf_counter() - t0)
        compiling += compiles() > c0
    return [done[f"{tag}{i}"] for i in range(len(PROMPTS))], statistics.median(steps), compiling


def test_bounded_decode_graphs_give_the_full_width_tokens(ckpt, xla_compiles, monkeypatch, capsys):
    import k3.engine.graphs as graphs_module
    import k3.model.paging as paging
    from k3.engine.engine import EngineConfig, LLMEngine

    monkeypatch.setattr(graphs_module, "context_buckets", lambda max_tokens: [24, 64, max_tokens])
    cuts = []
    bounded = paging.bounded_pages

    def recording(pages, table, bound):
        out = bounded(pages, table, bound)
        cuts.append((bound, out[0].shape[1], out[1].shape[1]))
        return out
    monkeypatch.setattr("k3.model.mla.bounded_pages", recording)

    engine = LLMEngine(EngineConfig(model=str(ckpt), platform="tpu", dtype="float32", load_progress=False,
                                    max_num_seqs=2, max_num_batched_tokens=32, max_model_len=2048,
                                    kv_cache_memory_gib=0.05, graph_batch_sizes=(2,), enable_prefix_caching=False))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.bounded and graphs.block_size == 128 and graphs.max_pages == 16
    assert graphs.bounds == [24, 64, 2048]

    replays = graphs.replays
    tokens, bounded_s, compiling = _decode(engine, "bounded", xla_compiles)
    bounded_replays = graphs.replays - replays
    assert graphs.late_captures == 1 and sorted(graphs._replay) == [(2, 24), (2, 64)]
    assert bounded_replays >= DECODE - 2                       # every decode step after the first ran replayed
    assert {(24, 24, 1), (64, 64, 1)} <= set(cuts), cuts       # in-page cuts: one page of 24 / 64 slots
    # compiling steps: the prefill, the first replay, the late capture and the replay after it
    # (its table now a slice of the uploaded one), the last step; a graph re-compiled every step
    # would be ~30
    assert compiling <= 6, f"{compiling} of {DECODE} steps compiled"
    assert graphs.eager_steps == 0

    graphs.bounds = [graphs.max_tokens]                        # the full width only, captured on first use
    replays, cuts[:] = graphs.replays, []
    full, full_s, _ = _decode(engine, "full", xla_compiles)
    with capsys.disabled():
        print(f"\n::: k3-tiny decode graphs on tpu (PJRT CPU), max_model_len 2048, batch 2: median step "
              f"{bounded_s * 1e3:.1f} ms at 24 / 64-token bounds, {full_s * 1e3:.1f} ms at the full width")
    assert graphs.replays - replays >= DECODE - 2 and graphs.late_captures == 2 and (2, 2048) in graphs._replay
    assert cuts and all(cut == (2048, 128, 16) for cut in cuts), cuts   # every page, whole
    assert tokens == full
