"""Decode graphs (k3.engine.graphs): buckets, padding onto a scratch row, and what is covered.
A stand-in capturer re-runs the recorded function into the captured output tensor on every
replay, which is what a graph does with its static buffers; the CUDA-graph capturer itself is
checked on the GPU by the `model.graph_decode` conformance cases. Token equality in float64."""

import pytest
import torch

from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.graphs import DecodeGraphs, context_buckets, default_buckets
from k3.engine.params import SamplingParams
from k3.platform.facade import Platform

PROMPTS = [[(11 * i + 5 * j) % 380 + 1 for j in range(n)] for i, n in enumerate((23, 4, 37, 9, 15))]


class ReplayingCapturer:
    """capture(fn): run fn once; each replay runs it again into the same output tensor."""

    def __init__(self):
        self.captured: list[int] = []
        self.replays = 0

    def capture(self, fn):
        out = fn()
        self.captured.append(out.shape[0])

        def replay():
            self.replays += 1
            out.copy_(fn())
        return replay, out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3.1-pro-tiny", tmp_path_factory.mktemp("graphs-k3.1-pro-tiny"), progress=False)


def _generate(ckpt, monkeypatch, capturer, **kw):
    monkeypatch.setattr(Platform, "graph_runner", property(lambda self: capturer))
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, kv_cache_memory_gib=0.02,
                                    max_num_seqs=8, **kw))
    for i, p in enumerate(PROMPTS):
        # staggered lengths: the batch shrinks 5 -> 1 while decoding, through buckets 8, 4, 2, 1
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return engine, [done[f"r{i}"] for i in range(len(PROMPTS))]


def test_replayed_decode_gives_the_eager_tokens(ckpt, monkeypatch):
    _, eager = _generate(ckpt, monkeypatch, None)
    capturer = ReplayingCapturer()
    engine, replayed = _generate(ckpt, monkeypatch, capturer)
    assert replayed == eager
    assert capturer.captured == [8, 4, 2, 1]                 # largest bucket first
    assert capturer.replays > 0                              # decode steps of 5 (bucket 8) down to 1 ran replayed
    assert engine.plan.graph_scratch_row is not None and engine.pool.num_rows == engine.cache.num_rows - 1


def test_enforce_eager_and_explicit_sizes(ckpt, monkeypatch):
    capturer = ReplayingCapturer()
    engine, _ = _generate(ckpt, monkeypatch, capturer, enforce_eager=True)
    assert capturer.captured == [] and engine.runner.graphs is None and engine.plan.graph_scratch_row is None
    capturer = ReplayingCapturer()
    engine, tokens = _generate(ckpt, monkeypatch, capturer, graph_batch_sizes=(3,))
    assert capturer.captured == [3] and engine.runner.graphs.buckets == [3]
    _, eager = _generate(ckpt, monkeypatch, None)
    assert tokens == eager                                   # batches of 4 and 5 ran eagerly, 1 to 3 replayed


def test_asynchronous_scheduling_is_the_default_where_decode_is_captured(ckpt, monkeypatch):
    engine, tokens = _generate(ckpt, monkeypatch, ReplayingCapturer())
    assert engine.async_scheduling and engine.num_lookahead_steps > 0
    engine, synchronous = _generate(ckpt, monkeypatch, ReplayingCapturer(), async_scheduling=False)
    assert not engine.async_scheduling and engine.num_lookahead_steps == 0 and synchronous == tokens
    for kw in ({"enforce_eager": True}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}):
        engine, _ = _generate(ckpt, monkeypatch, ReplayingCapturer(), **kw)
        assert not engine.async_scheduling, kw
    engine, _ = _generate(ckpt, monkeypatch, None)          # a platform that does not capture
    assert not engine.async_scheduling


def test_rows_past_the_batch_return_to_padding():
    """A smaller batch after a larger one in the same bucket must not replay the old rows
    (they would step real requests' states twice)."""
    from types import SimpleNamespace

    from k3.model.metadata import ForwardMetadata

    def model(meta, views, tap_layers):
        return SimpleNamespace(logits=meta.state_indices.double()[:, None].repeat(1, 3))

    graphs = DecodeGraphs(model, None, ReplayingCapturer(), buckets=[4], scratch_row=9,
                          block_size=16, max_pages=3, device="cpu", progress=False)
    for rows in ([5, 6, 7, 8], [1, 2, 3]):
        n = len(rows)
        meta = ForwardMetadata.build([[1]] * n, context_lens=[4] * n, state_indices=rows,
                                     block_table=torch.tensor([[r, r] for r in rows], dtype=torch.int32), page_size=16)
        assert graphs.covers(meta)
        assert graphs.run(meta)[:, 0].tolist() == rows
    static = graphs._static[4, 48]                           # 3 pages of 16 tokens
    assert static.state_indices.tolist() == [1, 2, 3, 9] and static.context_lens.tolist() == [4, 4, 4, 0]
    assert static.block_table[3].tolist() == [9, 9, 9] and static.block_table[0].tolist() == [1, 1, 9]
    assert static.slot_mapping[3] == 9 * 16
    prefill = ForwardMetadata.build([[1, 2]], context_lens=[0], state_indices=[0],
                                    block_table=torch.tensor([[0]], dtype=torch.int32), page_size=16)
    assert not graphs.covers(prefill)


class WidthBucketCapturer(ReplayingCapturer):
    """A runner whose decode attention costs the block table's width (ppu's torch kernels)."""

    table_width_buckets = True


def test_context_buckets():
    assert context_buckets(48) == [48]                                 # 256 tokens >= the widest table's
    assert context_buckets(4096) == [256, 1024, 4096]
    assert context_buckets(132 * 64) == [256, 1024, 4096, 132 * 64]
    assert context_buckets(640, first_tokens=64, factor=2) == [64, 128, 256, 512, 640]


def _bucket_model(meta, views, tap_layers):
    """Logits [N, 2]: the row's block-table sum plus its state row, and the graph's context bound."""
    from types import SimpleNamespace

    first = meta.block_table.double().sum(1, keepdim=True) + meta.state_indices[:, None]
    return SimpleNamespace(logits=torch.cat([first, torch.full_like(first, float(meta.context_bound or -1))], 1))


def test_short_contexts_replay_narrower_graphs_captured_when_first_needed():
    """With `table_width_buckets` a step replays the narrowest context bound that holds its
    longest sequence, with the table of the pages that hold the bound; the narrowest bound is
    captured at start-up, the wider ones (the full width too) on first use, and a graph sees
    exactly its table (a replay never reads a stale wider one)."""
    from k3.model.metadata import ForwardMetadata

    capturer = WidthBucketCapturer()
    graphs = DecodeGraphs(_bucket_model, None, capturer, buckets=[2, 4], scratch_row=9, block_size=16,
                          max_pages=100, device="cpu", progress=False)
    assert graphs.bounds == [256, 1024, 1600] and sorted(graphs._replay) == [(2, 256), (4, 256)]
    for table, key in (([[1, 2], [3, 4], [5, 6]], (4, 256)), ([[7] * 20], (2, 1024)), ([[8] * 100], (2, 1600)),
                       ([[2, 3]], (2, 256))):
        n, pages = len(table), len(table[0])
        meta = ForwardMetadata.build([[1]] * n, context_lens=[16 * pages - 1] * n, state_indices=list(range(n)),
                                     block_table=torch.tensor(table, dtype=torch.int32), page_size=16)
        assert graphs.covers(meta) and meta.max_seq_len == 16 * pages
        meta.max_seq_len = None                     # unknown on the host (a TP follower): the table's pages
        got = graphs.run(meta)
        width = graphs.table_pages(key[1])
        want = [sum(row) + 9 * (width - pages) + i for i, row in enumerate(table)]   # padded with the scratch row
        assert got[:, 0].tolist() == want, (table, key)
        assert (got[:, 1] == key[1]).all() and graphs._static[key].block_table.shape == (key[0], width)
    assert sorted(graphs._replay) == [(2, 256), (2, 1024), (2, 1600), (4, 256)]
    assert graphs.late_captures == 2 and graphs.replays == 4 and graphs.eager_steps == 0
    too_wide = ForwardMetadata.build([[1]], context_lens=[16 * 101 - 1], state_indices=[0],
                                     block_table=torch.ones(1, 101, dtype=torch.int32), page_size=16)
    assert not graphs.covers(too_wide)


def test_precompiled_bounds_are_all_captured_at_start_up():
    """precompile_bounds (--precompile-context-bounds): every (bucket, bound) at start-up, and a
    step at any bound replays without a capture."""
    from k3.model.metadata import ForwardMetadata

    capturer = WidthBucketCapturer()
    graphs = DecodeGraphs(_bucket_model, None, capturer, buckets=[2, 4], scratch_row=9, block_size=16,
                          max_pages=100, device="cpu", progress=False, precompile_bounds=True)
    assert sorted(graphs._replay) == [(b, bound) for b in (2, 4) for bound in (256, 1024, 1600)]
    for pages in (2, 20, 100):
        meta = ForwardMetadata.build([[1]], context_lens=[16 * pages - 1], state_indices=[0],
                                     block_table=torch.ones(1, pages, dtype=torch.int32), page_size=16)
        assert graphs.run(meta)[0, 1].item() == graphs.bounds[[2, 20, 100].index(pages)]
    assert graphs.late_captures == 0 and graphs.replays == 3


def test_the_builders_longest_sequence_picks_the_bound_and_cuts_the_table():
    """A step whose builder knows its longest sequence (`max_seq_len`, the engine's batches) takes
    the bound that holds it even when its table has more pages (rows allocated ahead): the pages
    past the bound's hold no position the step reads and are not copied."""
    from k3.model.metadata import ForwardMetadata

    graphs = DecodeGraphs(_bucket_model, None, WidthBucketCapturer(), buckets=[2], scratch_row=9, block_size=16,
                          max_pages=100, device="cpu", progress=False)
    table = [list(range(1, 41)), list(range(41, 81))]                     # 40 pages each
    meta = ForwardMetadata.build([[1], [1]], context_lens=[99, 57], state_indices=[0, 1],
                                 block_table=torch.tensor(table, dtype=torch.int32), page_size=16)
    meta.max_seq_len = 100
    got = graphs.run(meta)
    assert got[:, 1].tolist() == [256, 256]
    assert got[:, 0].tolist() == [sum(table[0][:16]), sum(table[1][:16]) + 1]
    plain = DecodeGraphs(_bucket_model, None, ReplayingCapturer(), buckets=[2], scratch_row=9, block_size=16,
                         max_pages=100, device="cpu", progress=False)
    assert plain.bounds == [1600] and plain.run(meta)[:, 1].tolist() == [-1, -1]   # no bound: the whole table


def test_a_failing_late_capture_runs_that_bound_eagerly():
    """A wider bound whose capture fails on first use (the device's memory taken since start-up)
    runs eagerly from then on, without another capture attempt; the other graphs keep replaying."""
    from types import SimpleNamespace

    from k3.model.metadata import ForwardMetadata

    class FailingWide(WidthBucketCapturer):
        attempts = 0

        def capture(self, fn):
            self.attempts += 1
            out = fn()
            if out.shape[1] == 100:
                raise RuntimeError("out of memory")
            return super().capture(fn)

    def model(meta, views, tap_layers):
        """Logits [N, W]: each row's block-table sum, W the table's width."""
        return SimpleNamespace(logits=meta.block_table.double().sum(1, keepdim=True).repeat(1, meta.block_table.shape[1]))

    capturer = FailingWide()
    graphs = DecodeGraphs(model, None, capturer, buckets=[1], scratch_row=9, block_size=16, max_pages=100,
                          device="cpu", progress=False)
    assert sorted(graphs._replay) == [(1, 256)] and capturer.attempts == 1
    long = ForwardMetadata.build([[1]], context_lens=[16 * 90], state_indices=[0],
                                 block_table=torch.arange(1, 92, dtype=torch.int32)[None], page_size=16)
    for _ in range(2):
        got = graphs.run(long)
        assert got.shape == (1, 91) and got[0, 0].item() == sum(range(1, 92))   # eager: the step's own table
    assert graphs.eager == {(1, 1600)} and graphs.eager_steps == 2 and capturer.attempts == 2
    short = ForwardMetadata.build([[1]], context_lens=[20], state_indices=[0],
                                  block_table=torch.tensor([[3, 4]], dtype=torch.int32), page_size=16)
    assert graphs.run(short)[0, 0].item() == 3 + 4 + 9 * 14                 # replayed at 256 tokens: 16 pages
    assert graphs.replays == 1 and graphs.late_captures == 0


def test_context_bounds_give_the_eager_tokens(ckpt, monkeypatch):
    """The engine end to end with a bounding runner on k3.1-pro-tiny (DSA indexer on, 64-token
    pages): bounds under one page make the MLA decode and the indexer read each page's first
    `bound` slots (`bounded_pages`), and the tokens equal eager decode's."""
    import k3.engine.graphs as graphs_module
    import k3.model.paging as paging

    _, eager = _generate(ckpt, monkeypatch, None, max_model_len=2048)
    monkeypatch.setattr(graphs_module, "context_buckets", lambda max_tokens: [24, 40, 56, 256, max_tokens])
    cuts = []
    bounded = paging.bounded_pages

    def recording(pages, table, bound):
        out = bounded(pages, table, bound)
        cuts.append((bound, out[0].shape[1], out[1].shape[1]))
        return out
    for module in ("k3.model.mla", "k3.model.indexer"):
        monkeypatch.setattr(f"{module}.bounded_pages", recording)
    capturer = WidthBucketCapturer()
    engine, replayed = _generate(ckpt, monkeypatch, capturer, max_model_len=2048)
    graphs = engine.runner.graphs
    assert replayed == eager
    assert graphs.late_captures > 0 and capturer.replays > 0
    assert {bound for _, bound in graphs._replay} >= {24, 40, 56}          # 24 at start-up; prompts of 4-37 tokens plus 4-16 new
    in_page = [cut for cut in cuts if cut[0] is not None and cut[0] < 64]
    assert in_page and all(slots == bound and pages == 1 for bound, slots, pages in in_page)   # first `bound` slots


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    with pytest.raises(ValueError, match="positive"):
        DecodeGraphs(None, None, ReplayingCapturer(), buckets=[0], scratch_row=0, block_size=16, max_pages=1,
                     device="cpu")


def test_dummy_weights_without_a_tokenizer(tmp_path):
    """What the k3-slice benchmark runs: config.json only, random weights drawn on the device,
    token-id prompts, no text."""
    import json

    from k3.config import K3Config

    (tmp_path / "config.json").write_text(json.dumps(K3Config.preset("k3-tiny").to_dict()))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                                    dtype="float32", load_progress=False, kv_cache_memory_gib=0.02))
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 6 and outs[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("b", "text needs a tokenizer")
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request("c", [1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="load_format"):
        LLMEngine(EngineConfig(model=str(tmp_path), load_format="pt", skip_tokenizer_init=True))


def test_a_failing_capture_falls_back_to_eager_decoding(ckpt, monkeypatch, capsys):
    class Broken:
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    engine, tokens = _generate(ckpt, monkeypatch, Broken())
    _, eager = _generate(ckpt, monkeypatch, None)
    assert tokens == eager and engine.runner.graphs is None
    assert "not permitted" in engine.graph_capture_error and "decoding eagerly" in capsys.readouterr().err


def test_sampler_inputs_are_on_the_device_before_the_forward_launches(ckpt, monkeypatch):
    """A host-to-device copy after the forward waits for it to finish (pageable memory), which
    serialised the sampler's launches behind every decode step: the runner builds them first."""
    import k3.engine.runner as runner_module

    events = []
    build = runner_module.build_sampling

    def recording_build(*args, **kw):
        batch = build(*args, **kw)
        events.append(("sampling", batch.all_greedy, batch.filters_off))
        return batch

    monkeypatch.setattr(runner_module, "build_sampling", recording_build)
    forward = runner_module.ModelRunner.forward
    monkeypatch.setattr(runner_module.ModelRunner, "forward",
                        lambda self, *a, **kw: (events.append(("forward",)), forward(self, *a, **kw))[1])
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, kv_cache_memory_gib=0.02))
    engine.add_request("greedy", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine.add_request("sampled", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0.8, seed=3, min_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert events and all(a[0] == "sampling" and b == ("forward",) for a, b in zip(events[::2], events[1::2]))
    assert ("sampling", False, True) in events


def test_host_padding_fills_the_bucket_as_the_device_copy_does():
    """A tracing runner (`pads_on_host`, the tpu platform's XLA runner) gets the bucket's metadata
    padded on the host: the same static tensors as the device-side row copies."""
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.scratch_row, graphs.block_size, graphs.max_pages, graphs.device = 9, 4, 3, torch.device("cpu")
    graphs.max_tokens, graphs.bounded = 12, False
    n, b = 3, 8
    meta = graphs._padding_metadata(n)
    for name in DecodeGraphs._ROWS:
        getattr(meta, name).copy_(torch.arange(n) + 100 + len(name))
    meta.block_table = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    pad = graphs._padding_metadata(b)
    host, device = graphs._padding_metadata(b), graphs._padding_metadata(b)
    for name in DecodeGraphs._ROWS:          # stale rows from a bigger batch must return to padding
        getattr(host, name).fill_(-7)
        getattr(device, name).fill_(-7)
    DecodeGraphs._fill_on_host(host, pad, meta, n)
    for name in DecodeGraphs._ROWS:
        want = getattr(pad, name).clone()
        want[:n] = getattr(meta, name)
        assert torch.equal(getattr(host, name), want), name
    want = pad.block_table.clone()
    want[:n, :2] = meta.block_table
    assert torch.equal(host.block_table, want)
    assert (host.slot_mapping[n:] == 9 * 4).all() and (host.state_indices[n:] == 9).all()

