"""Prefill/decode disaggregation with tensor and data parallelism (float64 k3-tiny, gloo CPU
ranks, TCP stand-in on loopback). A `k3 serve --tensor-parallel-size 2 --data-parallel-size 2`
producer hands its rows to a TP 2 consumer (k3.LLM): the same tokens as one instance with
requests prefilled on both DP ranks (each handle names its own DP rank's TP ranks), each TP
rank's rows byte for byte from the producer rank of the same index (KDA heads differ between
ranks, the replicated latents do not). Mismatched TP sizes re-shard the KDA state by heads
(TP 2 -> TP 1 with speculative decoding on the consumer, TP 1 -> TP 2). A read that fails on
one TP rank falls back to local prefill, with the same tokens."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

import k3
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.kv_transfer.wire import WireClient
from k3.engine.params import SamplingParams

from serving import Serve

BLOCK = 16
GREEDY = {"max_tokens": 5, "temperature": 0}
SEEDED = {"max_tokens": 5, "temperature": 0.9, "top_k": 20, "seed": 11}


def _kv(role: str) -> dict:
    return {"kv_connector": "TCPConnector", "kv_role": role, "kv_connector_extra_config": {"transfer_timeout_s": 20}}


def _engine(ckpt, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, kv_cache_memory_gib=0.02,
                                  block_size=BLOCK, **kw))


@pytest.fixture(scope="module")
def cluster(checkpoint):
    # single-rank engines first: one built after this process joined a process group would join it
    ref = _engine(checkpoint)
    producer1 = _engine(checkpoint, kv_transfer_config=_kv("kv_producer"))
    consumer1 = _engine(checkpoint, kv_transfer_config=_kv("kv_consumer"),
                        speculative_config={"method": "draft_model", "model": str(checkpoint),
                                            "num_speculative_tokens": 3})
    producer2 = Serve(checkpoint, "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--block-size",
                      str(BLOCK), "--kv-transfer-config", json.dumps(_kv("kv_producer")))
    consumer2 = None
    try:
        url = producer2.url()
        consumer2 = k3.LLM(str(checkpoint), dtype="float64", kv_cache_memory_gib=0.02, load_progress=False,
                           block_size=BLOCK, tensor_parallel_size=2, kv_transfer_config=_kv("kv_consumer"))
        yield {"ref": ref, "producer1": producer1, "consumer1": consumer1, "url": url, "consumer2": consumer2}
    finally:
        if consumer2 is not None:
            consumer2.shutdown()
        producer2.stop()
        for e in (producer1, consumer1):
            e.shutdown()


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(1, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tp2_prefill(url: str, prompt: list[int], params: dict) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, **params, "kv_transfer_params": {"do_remote_decode": True}})
    request = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        handle = json.loads(response.read())["kv_transfer_params"]
    assert handle["do_remote_prefill"] and len(handle["ranks"]) == 2
    return handle


def _run(engine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, params)
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == rid), last)
    return last.outputs[0].token_ids


def _expected(cluster, prompt, params: dict) -> list[int]:
    return _run(cluster["ref"], f"ref-{len(prompt)}-{params.get('seed')}", prompt, SamplingParams(**params))


def _read(data: str, address: int, nbytes: int) -> torch.Tensor:
    client = WireClient(10)
    try:
        _, raw = client.call(data, {"op": "read", "address": address, "length": nbytes})
    finally:
        client.close()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def test_tp2_dp2_producer_to_tp2_consumer(cluster):
    llm = cluster["consumer2"]
    prompts = [_prompt(n, n) for n in (5, BLOCK, 3 * BLOCK + 7)]
    params = [GREEDY, SEEDED, GREEDY]
    handles = [_tp2_prefill(cluster["url"], p, q) for p, q in zip(prompts, params)]
    # the second prefill went to DP rank 1 (the first's pinned rows left DP rank 0 fewer free)
    assert len({h["remote_control"] for h in handles}) == 2
    assert len({tuple(map(tuple, h["ranks"])) for h in handles}) == 2
    before = llm.engine.snapshot()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(**q, kv_transfer_params=h) for q, h in zip(params, handles)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_expected(cluster, p, q) for p, q in zip(prompts, params)]
    after = llm.engine.snapshot()
    assert after["kv_pulls_total"] - before["kv_pulls_total"] == 3
    assert after["kv_fallbacks_total"] == before["kv_fallbacks_total"]
    assert after["cache_rows_free"] == after["cache_rows"]


def test_each_tp_rank_pulls_its_own_rows(cluster):
    llm = cluster["consumer2"]
    front, inner = llm.engine, llm.engine.engine                      # the TP leader's engine
    prompt, params = _prompt(77, 2 * BLOCK + 9), SamplingParams(**GREEDY)
    handle = _tp2_prefill(cluster["url"], prompt, GREEDY)
    front.add_request("bytes", prompt, SamplingParams(**GREEDY, kv_transfer_params=handle))
    (pull,) = inner.kv_consumer.inflight
    inner.kv_consumer.wait()
    assert pull.future.exception() is None
    row_bytes = handle["row_bytes"]
    assert [r for r, _ in pull.pairs] == handle["rows"] + [handle["state_row"]]
    mine = inner.kv_consumer.ranks
    got = {}
    for rank in (0, 1):
        data, base = handle["ranks"][rank]
        for remote, local in pull.pairs:
            theirs = _read(data, base + remote * row_bytes, row_bytes)
            ours = (inner.cache.backing[local] if rank == 0
                    else _read(mine[1].data, mine[1].base + local * row_bytes, row_bytes))
            assert torch.equal(ours, theirs), (rank, remote, local)
            got[rank, remote] = ours
    state = handle["state_row"]
    assert not torch.equal(got[0, state], got[1, state])             # each rank's KDA heads
    assert all(torch.equal(got[0, r], got[1, r]) for r in handle["rows"])     # replicated latents
    done = None
    while front.has_unfinished_requests():
        done = next((o for o in front.step() if o.request_id == "bytes" and o.finished), done)
    assert done.outputs[0].token_ids == _expected(cluster, prompt, GREEDY)


def test_tp2_to_tp1_reshards_and_speculates(cluster):
    """The TP 1 consumer takes every KDA head from both producer ranks, and decodes on with a
    draft model that catches up on the prompt itself."""
    consumer = cluster["consumer1"]
    prompt, params = _prompt(535, 2 * BLOCK + 3), {**GREEDY, "max_tokens": 8}
    handle = _tp2_prefill(cluster["url"], prompt, params)
    before = consumer.snapshot()
    assert _run(consumer, "c1", prompt, SamplingParams(**params, kv_transfer_params=handle)) == \
        _expected(cluster, prompt, params)
    after = consumer.snapshot()
    assert after["kv_pulls_total"] == before["kv_pulls_total"] + 1
    assert after["kv_fallbacks_total"] == before["kv_fallbacks_total"]
    assert after["spec_accepted_tokens_total"] > before["spec_accepted_tokens_total"]


def test_tp1_to_tp2_reshards(cluster):
    llm = cluster["consumer2"]
    prompt = _prompt(601, 3 * BLOCK + 1)
    handle = _run_handle(cluster["producer1"], prompt, GREEDY)
    assert handle["ranks"] == []                                      # one producer rank
    before = llm.engine.snapshot()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**GREEDY, kv_transfer_params=handle),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == _expected(cluster, prompt, GREEDY)
    after = llm.engine.snapshot()
    assert (after["kv_pulls_total"], after["kv_fallbacks_total"]) == (before["kv_pulls_total"] + 1,
                                                                       before["kv_fallbacks_total"])


def _run_handle(producer: LLMEngine, prompt, params: dict) -> dict:
    producer.add_request(f"p-{len(prompt)}", prompt, SamplingParams(**params, kv_transfer_params={"do_remote_decode": True}))
    last = None
    while producer.has_unfinished_requests():
        last = next((o for o in producer.step() if o.finished), last)
    return last.kv_transfer_params


def test_a_failed_rank_falls_back_to_local_prefill(cluster, capsys):
    llm, consumer = cluster["consumer2"], cluster["consumer1"]
    prompt = _prompt(702, 2 * BLOCK + 5)
    handle = _tp2_prefill(cluster["url"], prompt, GREEDY)
    dead = dict(handle, ranks=[handle["ranks"][0], ["127.0.0.1:1", handle["ranks"][1][1]]])   # rank 1's reads fail
    expected = _expected(cluster, prompt, GREEDY)
    before = llm.engine.snapshot()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**GREEDY, kv_transfer_params=dead),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected
    after = llm.engine.snapshot()
    assert after["kv_fallbacks_total"] == before["kv_fallbacks_total"] + 1
    assert after["cache_rows_free"] == after["cache_rows"]
    # a TP 1 consumer re-sharding from the same handle hits the dead rank too
    before = consumer.snapshot()["kv_fallbacks_total"]
    assert _run(consumer, "dead1", prompt, SamplingParams(**GREEDY, kv_transfer_params=dead)) == expected
    assert consumer.snapshot()["kv_fallbacks_total"] == before + 1
    # another block size is refused up front, naming both: the request waits for local prefill
    capsys.readouterr()
    consumer.add_request("block", prompt, SamplingParams(**GREEDY, kv_transfer_params=dict(handle, block_size=2 * BLOCK)))
    assert f"the producer's rows hold {2 * BLOCK} tokens, this engine's {BLOCK}" in capsys.readouterr().err
    assert not consumer.kv_consumer.inflight and [r.request_id for r in consumer.scheduler.waiting] == ["block"]
    consumer.abort_request("block")
    assert not consumer.has_unfinished_requests()
