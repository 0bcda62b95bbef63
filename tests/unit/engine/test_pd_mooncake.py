"""Prefill/decode disaggregation through the Mooncake transfer engine on loopback (TCP
transport, peer-to-peer handshake: no metadata service): the same tokens as one instance and
the rows byte for byte. CI installs what it needs (the non-CUDA wheel through k3[test], its
system libraries libibverbs1 and librdmacm1 through .ci/system_deps.sh); where it still cannot
load, skipped with exactly what is missing (`k3.engine.kv_transfer.mooncake.missing_piece`)."""

import pytest
import torch

from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.kv_transfer.mooncake import missing_piece
from k3.engine.params import SamplingParams


def _mooncake_error() -> str | None:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return f"the Mooncake transfer engine does not load here: {missing_piece(e)}"
    return None


needs_mooncake = pytest.mark.skipif(_mooncake_error() is not None, reason=str(_mooncake_error()))


def _engine(ckpt, role=None):
    kv = None if role is None else {"kv_connector": "MooncakeConnector", "kv_role": role,
                                    "kv_connector_extra_config": {"protocol": "tcp",
                                                                  "metadata_server": "P2PHANDSHAKE"}}
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, kv_cache_memory_gib=0.02,
                                  block_size=16, skip_tokenizer_init=True, kv_transfer_config=kv))


def _run(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == rid), last)
    return last


@needs_mooncake
def test_pd_over_mooncake_loopback(tiny_checkpoint):
    ckpt = tiny_checkpoint("k3-tiny")
    producer, consumer = _engine(ckpt, "kv_producer"), _engine(ckpt, "kv_consumer")
    try:
        prompt = torch.randint(1, 400, (45,), generator=torch.Generator().manual_seed(5)).tolist()
        params = SamplingParams(max_tokens=6, temperature=0)
        expected = _run(_engine(ckpt), "r", prompt, params).outputs[0].token_ids
        handle = _run(producer, "p", prompt, SamplingParams(max_tokens=6, temperature=0,
                                                            kv_transfer_params={"do_remote_decode": True})
                      ).kv_transfer_params
        consumer.add_request("c", prompt, SamplingParams(max_tokens=6, temperature=0, kv_transfer_params=handle))
        (pull,) = consumer.kv_consumer.inflight
        consumer.kv_consumer.wait()
        assert pull.future.exception() is None
        for remote, local in pull.pairs:
            assert torch.equal(consumer.cache.backing[local], producer.cache.backing[remote])
        done = None
        while consumer.has_unfinished_requests():
            done = next((o for o in consumer.step() if o.finished), done)
        assert done.outputs[0].token_ids == expected
        assert consumer.kv_transfer_stats()["kv_fallbacks_total"] == 0
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_missing_pieces_are_named():
    """The skip reason (and the connector's error) says what to install."""
    assert "pip install mooncake-transfer-engine" in missing_piece(ModuleNotFoundError("No module named 'mooncake'",
                                                                                       name="mooncake"))
    lib = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    assert "cannot load libibverbs.so.1: install the Debian/Ubuntu package libibverbs1" in missing_piece(lib)
    cuda = ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")
    assert "mooncake-transfer-engine-non-cuda" in missing_piece(cuda)
