"""The whole k3-tiny engine on the tpu platform (PJRT CPU): XLA compilations counted over 50
steady-state decode steps whose batch shrinks 8 -> 5 inside one bucket (requests finishing at
different steps): none may compile (torch-xla's `CompileTime` metric: one sample per XLA
compilation). The engine pads every step to the plugin's buckets (`k3_shape_buckets`), replays
the bucket's decode graph (`k3_graph_runner`) and samples at the bucket, so a batch size inside
a bucket never reaches a graph."""

import time

MAX_TOKENS = [60, 60, 60, 60, 60, 22, 30, 38]       # the batch: 8 until step ~22, then 7, 6, 5
WARMUP, STEADY = 4, 50                               # steps: prefill, first decodes; then counted


def test_steady_state_decode_compiles_nothing(ckpt, xla_compiles, capsys):
    from k3.engine.engine import EngineConfig, LLMEngine
    from k3.engine.params import SamplingParams

    t0, c0 = time.monotonic(), xla_compiles()
    engine = LLMEngine(EngineConfig(model=str(ckpt), platform="tpu", dtype="float32", load_progress=False,
                                    max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                                    kv_cache_memory_gib=0.05, graph_batch_sizes=(8,)))
    assert engine.runner.graphs is not None and engine.runner.padding is not None
    built, c_build = time.monotonic() - t0, xla_compiles() - c0
    for i, n in enumerate(MAX_TOKENS):
        engine.add_request(f"r{i}", [(37 * i + 5 * j) % 300 + 1 for j in range(4)],
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    t1, c1 = time.monotonic(), xla_compiles()
    for _ in range(WARMUP):
        engine.step()
    warm, c_warm = time.monotonic() - t1, xla_compiles() - c1
    running, c2, t2 = [], xla_compiles(), time.monotonic()
    replays = engine.runner.graphs.replays
    for _ in range(STEADY):
        running.append(sum(not r.finished for r in engine.requests.values()))
        engine.step()
    steady_s, c_steady = time.monotonic() - t2, xla_compiles() - c2
    with capsys.disabled():
        print(f"\n::: k3-tiny on tpu (PJRT CPU): build + capture {built:.1f} s, {c_build} compiles; prefill and "
              f"first decodes {warm:.1f} s, {c_warm} compiles; {STEADY} decode steps (batch {max(running)} -> "
              f"{min(running)}) {steady_s:.2f} s, {c_steady} compiles")
    assert {8, 7, 6, 5} <= set(running), running                   # the batch changed inside bucket 8
    assert c_steady == 0, f"{c_steady} XLA compilation(s) in {STEADY} steady-state decode steps"
    assert engine.runner.graphs.replays - replays >= STEADY - 2     # replayed (not eager) decode steps
