"""--kv-transfer-config: vLLM's JSON shape parsed into KVTransferConfig; every malformed value
is refused with an error naming the key, by the engine config and by `k3 serve` (exit 2); TP,
DP and speculation are accepted with it, DCP refused; each rank of a deployment listens on
kv_port + its rank."""

import json

import pytest

from k3.engine.engine import EngineConfig
from k3.engine.kv_transfer.config import KVTransferConfig, KVTransferConfigError, for_rank


def test_parses_vllm_shape():
    c = KVTransferConfig.parse('{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_port": 7000, '
                               '"kv_connector_extra_config": {"protocol": "rdma", "device_name": "mlx5_0", '
                               '"transfer_timeout_s": 5}}')
    assert (c.backend, c.kv_role, c.kv_port, c.protocol, c.device_name, c.transfer_timeout_s) == \
        ("mooncake", "kv_consumer", 7000, "rdma", "mlx5_0", 5.0)
    assert c.is_consumer and not c.is_producer
    both = KVTransferConfig.parse({"kv_connector": "TCPConnector", "kv_role": "kv_both"})
    assert both.is_consumer and both.is_producer and both.backend == "tcp"
    assert KVTransferConfig.parse(None) is None


@pytest.mark.parametrize("value, names", [
    ('{"kv_connector": "MooncakeConnector", "kv_role": ', "not valid JSON"),
    ('["kv_producer"]', "must be a JSON object"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "kv_connector must be one of"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "producer"}, "kv_role must be one of"),
    ({"kv_connector": "MooncakeConnector"}, "kv_role must be one of"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_rank": 0}, "unknown key(s) 'kv_rank'"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_port": 70000}, "kv_port must be"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_port": "80"}, "kv_port must be"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"protocol": "udp"}},
     "protocol must be"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"pin_timeout_s": 0}}, "pin_timeout_s must be a positive number"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"speed": 1}},
     "unknown kv_connector_extra_config key(s) 'speed'"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_connector_extra_config": []},
     "kv_connector_extra_config must be an object"),
])
def test_malformed_config_is_named(value, names):
    with pytest.raises(KVTransferConfigError, match=None) as e:
        KVTransferConfig.parse(value)
    assert names in str(e.value) and "--kv-transfer-config" in str(e.value)
    with pytest.raises(KVTransferConfigError):
        EngineConfig(model="unused", kv_transfer_config=value).validate()


def test_tensor_data_parallel_and_speculation_accepted_dcp_refused():
    kv = {"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}
    EngineConfig(model="unused", tensor_parallel_size=2, data_parallel_size=2, kv_transfer_config=kv).validate()
    EngineConfig(model="unused", kv_transfer_config=kv,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2}).validate()
    with pytest.raises(ValueError, match="does not combine with decode_context_parallel_size 2"):
        EngineConfig(model="unused", tensor_parallel_size=2, decode_context_parallel_size=2,
                     kv_transfer_config=kv).validate()


def test_each_rank_listens_on_its_own_port():
    kv = {"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_port": 7100}
    assert for_rank(kv, 0) is kv and for_rank(kv, 3)["kv_port"] == 7103
    assert json.loads(json.dumps(for_rank(json.dumps(kv), 2)))["kv_port"] == 7102
    assert for_rank({**kv, "kv_port": 0}, 5)["kv_port"] == 0            # any free port on every rank
    assert for_rank(KVTransferConfig.parse(kv), 1).kv_port == 7101
    assert for_rank(None, 4) is None


def test_serve_refuses_malformed_config(capsys, tiny_checkpoint):
    from k3.cli.main import main

    code = main(["serve", "--model", str(tiny_checkpoint("k3-tiny")), "--kv-transfer-config",
                 json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "decoder"})])
    err = capsys.readouterr().err
    assert code == 2 and "kv_role must be one of kv_producer, kv_consumer, kv_both, got 'decoder'" in err
