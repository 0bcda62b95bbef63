"""KVTransferConfig: vLLM's `--kv-transfer-config` JSON, validated with errors naming the key."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# connector name -> transfer backend (k3.engine.kv_transfer.backend.make_backend)
CONNECTORS = {"MooncakeConnector": "mooncake", "TCPConnector": "tcp"}
KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "engine_id", "kv_connector_extra_config")
EXTRA_KEYS = ("protocol", "metadata_server", "device_name", "pin_timeout_s", "transfer_timeout_s",
              "max_inflight")


class KVTransferConfigError(ValueError):
    """A malformed --kv-transfer-config; the message names the key and what it takes."""


@dataclass(frozen=True)
class KVTransferConfig:
    """One engine's place in a disaggregated deployment.

    kv_connector: "MooncakeConnector" (the Mooncake transfer engine) or "TCPConnector" (k3's
    TCP stand-in, no dependency); kv_role: kv_producer (prefill instance: publishes rows),
    kv_consumer (decode instance: pulls them), kv_both; kv_ip / kv_port: where this engine's
    control channel (and the TCP data plane) listens (port 0: any free port); engine_id: a
    name reported in handles. Extra config: protocol ("tcp" / "rdma", Mooncake),
    metadata_server ("P2PHANDSHAKE" or a metadata service URL, Mooncake), device_name (RDMA
    device, Mooncake), pin_timeout_s (a producer frees unconfirmed rows after it),
    transfer_timeout_s (a consumer gives up a pull after it and prefills locally),
    max_inflight (concurrent pulls on a consumer).
    """

    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    engine_id: str = "k3"
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    device_name: str = ""
    pin_timeout_s: float = 120.0
    transfer_timeout_s: float = 30.0
    max_inflight: int = 4
    extra: dict = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return CONNECTORS[self.kv_connector]

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        """The config of a JSON string or dict (None: no disaggregation); KVTransferConfigError
        naming the offending key for anything else."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise KVTransferConfigError(f"--kv-transfer-config is not valid JSON ({e.msg} at character "
                                            f"{e.pos}): {value!r}") from None
        if not isinstance(value, dict):
            raise KVTransferConfigError(f"--kv-transfer-config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise KVTransferConfigError(f"--kv-transfer-config: unknown key(s) {', '.join(map(repr, unknown))} "
                                        f"(known: {', '.join(KEYS)})")
        connector, role = value.get("kv_connector"), value.get("kv_role")
        if connector not in CONNECTORS:
            raise KVTransferConfigError(f"--kv-transfer-config: kv_connector must be one of "
                                        f"{', '.join(CONNECTORS)}, got {connector!r}")
        if role not in ROLES:
            raise KVTransferConfigError(f"--kv-transfer-config: kv_role must be one of {', '.join(ROLES)}, "
                                        f"got {role!r}")
        extra = value.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise KVTransferConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
        bad = sorted(set(extra) - set(EXTRA_KEYS))
        if bad:
            raise KVTransferConfigError(f"--kv-transfer-config: unknown kv_connector_extra_config key(s) "
                                        f"{', '.join(map(repr, bad))} (known: {', '.join(EXTRA_KEYS)})")
        ip, port, engine_id = value.get("kv_ip", "127.0.0.1"), value.get("kv_port", 0), value.get("engine_id", "k3")
        _need(isinstance(ip, str) and ip, "kv_ip", "a host name or address", ip)
        _need(isinstance(port, int) and not isinstance(port, bool) and 0 <= port < 65536, "kv_port",
              "an integer port in [0, 65535]", port)
        _need(isinstance(engine_id, str) and engine_id, "engine_id", "a non-empty string", engine_id)
        protocol = extra.get("protocol", "tcp")
        _need(protocol in ("tcp", "rdma"), "kv_connector_extra_config.protocol", '"tcp" or "rdma"', protocol)
        metadata = extra.get("metadata_server", "P2PHANDSHAKE")
        _need(isinstance(metadata, str) and metadata, "kv_connector_extra_config.metadata_server",
              '"P2PHANDSHAKE" or a metadata service URL', metadata)
        device = extra.get("device_name", "")
        _need(isinstance(device, str), "kv_connector_extra_config.device_name", "a string", device)
        timeouts = {}
        for key, default in (("pin_timeout_s", 120.0), ("transfer_timeout_s", 30.0)):
            t = extra.get(key, default)
            _need(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0,
                  f"kv_connector_extra_config.{key}", "a positive number of seconds", t)
            timeouts[key] = float(t)
        inflight = extra.get("max_inflight", 4)
        _need(isinstance(inflight, int) and not isinstance(inflight, bool) and inflight >= 1,
              "kv_connector_extra_config.max_inflight", "a positive integer", inflight)
        return cls(kv_connector=connector, kv_role=role, kv_ip=ip, kv_port=port, engine_id=engine_id,
                   protocol=protocol, metadata_server=metadata, device_name=device, max_inflight=inflight,
                   extra=dict(extra), **timeouts)


def for_rank(value: "str | dict | KVTransferConfig | None", rank: int):
    """The --kv-transfer-config of global rank `rank` of a deployment: every rank runs its own
    control channel, on kv_port + rank (kv_port 0 stays 0: any free port). Other keys as given."""
    config = KVTransferConfig.parse(value)
    if config is None or not config.kv_port or not rank:
        return value
    if isinstance(value, KVTransferConfig):
        return dataclasses.replace(value, kv_port=value.kv_port + rank)
    data = json.loads(value) if isinstance(value, str) else dict(value)
    data["kv_port"] = config.kv_port + rank
    return data


def _need(ok: bool, key: str, what: str, got) -> None:
    if not ok:
        raise KVTransferConfigError(f"--kv-transfer-config: {key} must be {what}, got {got!r}")
