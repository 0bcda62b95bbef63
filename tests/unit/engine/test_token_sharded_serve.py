"""Token-sharded prefill through the runtime (k3.LLM with TP 2, as `k3 serve
--token-sharded-prefill-min-tokens` builds it): a long prompt's prefill runs through
TokenShardedPrefill over the TP group inside the scheduler's step, and the engine gives the
plain TP 2 engine's greedy tokens and leaves the same cache rows (float64, K3.1 Pro's tiny
preset: KDA, MLA and the DSA indexer with index_topk 16 below the prompt); the scheduler gives
such a prompt a step of its own, alternating with decode steps; bad layouts are refused."""

import pytest
import torch

import k3
from k3.cache.block_pool import BlockPool
from k3.engine.config import EngineConfig
from k3.engine.request import Request
from k3.engine.scheduler import Scheduler, SchedulerConfig

MIN_TOKENS = 32


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One intra-op thread here and in rank 1's process (tiny float64 ops run many times faster
    on one thread than on two on a shared 2-core box); restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tokenized_checkpoint):
    return tokenized_checkpoint("k3.1-pro-tiny")


def _prompt(n: int, a: int = 7) -> dict:
    return {"prompt_token_ids": [(a * i) % 300 + 1 for i in range(n)]}


def _engine(llm):
    return getattr(llm.engine, "engine", llm.engine)      # TP: the DistributedEngine's rank-0 LLMEngine


def _caches(llm, rows: list[int], state_row: int, n: int) -> dict[str, torch.Tensor]:
    """Rank 0's (the TP leader's) cache records of a sequence's first n tokens (attention rows
    `rows`, KDA state row `state_row`): latents, DSA index keys (fp8 values as floats, scales),
    KDA recurrent and conv states; one process's states cut to rank 0's heads under TP 2 (the
    first half of the heads of q, k and v)."""
    parts = _engine(llm)
    views, tp = parts.cache.views, parts.model.parallel.world_size
    pos = torch.arange(n)
    page, at = torch.tensor(rows)[pos // 8], pos % 8
    out = {}
    for j, v in enumerate(views.latent):
        out[f"latent{j}"] = v.pages[page, at].clone()
    for j, v in enumerate(views.index_keys or ()):
        out[f"keys{j}"], out[f"scales{j}"] = v.values[page, at].float(), v.scales[page, at].clone()
    for j, v in enumerate(views.kda):
        rec, conv = v.recurrent[state_row], v.conv[state_row]
        if tp == 1:
            rec, ch = rec[: rec.shape[0] // 2], conv.shape[0] // 6
            conv = conv.reshape(3, 2 * ch, -1)[:, :ch].reshape(3 * ch, -1)
        out[f"recurrent{j}"], out[f"conv{j}"] = rec.clone(), conv.clone()
    return out


def _run(llm) -> tuple[list, dict[str, torch.Tensor], list]:
    """A lone 40-token prompt (its token, rank 0's cache records of it after the prefill step),
    then long prompts beside a short one and their decodes (their tokens)."""
    sched, seen = _engine(llm).scheduler, []
    schedule = sched.schedule

    def spy():                                   # the lone prompt's rows, once its prefill is scheduled
        out = schedule()
        seen.extend((list(s.request.rows), s.request.state_row) for s in out.scheduled if not seen)
        return out

    sched.schedule = spy
    one = k3.SamplingParams(max_tokens=1, temperature=0)
    first = [o.outputs[0].token_ids for o in llm.generate([_prompt(40)], one, use_tqdm=False)]
    caches = _caches(llm, *seen[0], 40)
    prompts = [_prompt(37, 11), _prompt(5), _prompt(48, 3)]
    params = k3.SamplingParams(max_tokens=6, temperature=0)
    return first, caches, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_tp2_token_sharded_prefill_equals_unsharded(ckpt):
    """Against the unsharded engine in one process: the same greedy tokens, and rank 0's rows
    equal (latents replicated under TP, KDA states of its heads) to 1e-9, fp8 key bytes within
    one fp8 step (the TP all-reduce rounds the activations differently, ~1e-15)."""
    kw = dict(dtype="float64", kv_cache_memory_gib=0.02, load_progress=False, block_size=8)
    first, caches, tokens = _run(k3.LLM(str(ckpt), **kw))
    sharded = k3.LLM(str(ckpt), tensor_parallel_size=2, token_sharded_prefill_min_tokens=MIN_TOKENS, **kw)
    try:
        s_first, s_caches, s_tokens = _run(sharded)
        prefills = sharded.engine.engine.runner.sharded_prefill.prefills
    finally:
        sharded.shutdown()
    assert prefills == 3                             # the 40-, 37- and 48-token prompts; not the 5-token one
    assert s_first == first and s_tokens == tokens
    assert caches.keys() == s_caches.keys() and any(k.startswith("keys") for k in caches)
    for name, want in caches.items():
        tol = dict(rtol=0.125, atol=0) if name.startswith("keys") else dict(rtol=0, atol=1e-9)
        assert want.isfinite().all(), name           # written (the pool's fill is NaN)
        torch.testing.assert_close(s_caches[name], want, **tol, msg=name)


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), k3.SamplingParams(max_tokens=4), seed=0)


def test_scheduler_gives_long_prompts_a_step_of_their_own():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, block_size=8,
                                      token_sharded_min_tokens=MIN_TOKENS), BlockPool(64))
    for rid, n in (("short", 5), ("long1", 40), ("long2", 33), ("short2", 6)):
        sched.add(_request(rid, n))
    plan = []
    for _ in range(4):
        out = sched.schedule()
        plan.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        done = [s.request for s in out.scheduled if s.completes]
        sched.commit(out)
        for r in done:
            r.output_token_ids.append(9)                          # the sampled token
    # short prompt, then long1 alone, then short's decode (long2 waits: steps alternate), then long2 alone
    assert plan == [[("short", 5)], [("long1", 40)], [("short", 1), ("long1", 1)], [("long2", 33)]]


def test_refused_layouts(ckpt):
    with pytest.raises(ValueError, match="needs tensor_parallel_size 2, 4 or 8, got 1"):
        EngineConfig(model=str(ckpt), token_sharded_prefill_min_tokens=64).validate()
    with pytest.raises(ValueError, match="does not combine with decode_context_parallel_size, enable_prefix_caching"):
        EngineConfig(model=str(ckpt), tensor_parallel_size=2, decode_context_parallel_size=2, enable_prefix_caching=True,
                     token_sharded_prefill_min_tokens=64)._validate_token_sharded()
    with pytest.raises(ValueError, match="non-negative integer"):
        EngineConfig(model=str(ckpt), tensor_parallel_size=2, token_sharded_prefill_min_tokens=-1).validate()


def test_serve_flag_reaches_the_engine_config(ckpt):
    """`k3 serve --token-sharded-prefill-min-tokens N -tp 2` sets the engine's threshold and
    turns prefix caching's default off (it does not run with it yet)."""
    import shlex

    from k3.cli.main import build_parser
    from k3.cli.serve import engine_config, resolve_arguments

    def config(line: str):
        argv = shlex.split(f"serve {ckpt} --platform reference {line}")
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        resolve_arguments(args, parser._commands[("command", "serve")])
        return engine_config(args)[0]

    c = config("-tp 2 --token-sharded-prefill-min-tokens 4096")
    assert c.token_sharded_prefill_min_tokens == 4096 and c.enable_prefix_caching is False
    c = config("-tp 2")
    assert c.token_sharded_prefill_min_tokens == 0 and c.enable_prefix_caching is True
