"""The Mooncake backend: rows move through the Mooncake transfer engine
(`mooncake-transfer-engine` on PyPI; `mooncake-transfer-engine-non-cuda` on a machine without
CUDA), confirms over k3's control channel.

Each engine initialises a TransferEngine on kv_ip with the configured metadata server
("P2PHANDSHAKE": peers find each other's segments through the RPC port in the handle, no
service to run) and protocol ("tcp", or "rdma" with device_name), and registers its cache's
backing tensor. A consumer pulls each row with one `transfer_sync_read` from the producer's
registered memory ("one transfer per packed cache row"). On a machine without CUDA the
non-CUDA wheel needs libibverbs1 and librdmacm1 (apt; CI installs them: .ci/system_deps.sh) and
then runs TCP on loopback with the P2P handshake; `missing_piece` names what a failed import
lacks (docs/disaggregation.md, "Mooncake status").
"""

from __future__ import annotations

import torch

from .backend import ControlledBackend
from .config import KVTransferConfig
from .wire import TransferError


# shared libraries the wheels load that a bare machine may lack -> what provides them
SYSTEM_LIBRARIES = {
    "libibverbs.so.1": "the Debian/Ubuntu package libibverbs1 (apt-get install libibverbs1 librdmacm1)",
    "librdmacm.so.1": "the Debian/Ubuntu package librdmacm1 (apt-get install libibverbs1 librdmacm1)",
    "libnuma.so.1": "the Debian/Ubuntu package libnuma1",
    "libcudart.so.12": "the CUDA 12 runtime: mooncake-transfer-engine is the CUDA build; without CUDA install "
                       "mooncake-transfer-engine-non-cuda instead",
}


def missing_piece(error: ImportError) -> str:
    """What the import of the transfer engine lacks, in words: the wheel, or the system library
    named in the loader's error and the package that provides it."""
    text = str(error)
    if getattr(error, "name", None) in ("mooncake", "mooncake.engine") or "No module named 'mooncake" in text:
        return ("the Mooncake wheel is not installed: pip install mooncake-transfer-engine (CUDA machines) or "
                "mooncake-transfer-engine-non-cuda (elsewhere; k3[test] installs it on Linux x86_64, Python "
                "3.10-3.13)")
    for library, provider in SYSTEM_LIBRARIES.items():
        if library in text:
            return f"the Mooncake wheel is installed but cannot load {library}: install {provider}"
    return f"the Mooncake wheel is installed but does not import: {text}"


def load_transfer_engine():
    """Mooncake's TransferEngine class; ImportError saying what to install when it is absent."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(f"the MooncakeConnector needs the Mooncake transfer engine: {missing_piece(e)}; "
                          "or use kv_connector TCPConnector") from None
    return TransferEngine


class MooncakeBackend(ControlledBackend):
    name = "mooncake"

    def __init__(self, config: KVTransferConfig):
        engine_cls = load_transfer_engine()
        super().__init__(config)
        self.engine = engine_cls()
        rc = self.engine.initialize(config.kv_ip, config.metadata_server, config.protocol, config.device_name)
        if rc != 0:
            self.server.close()
            raise RuntimeError(f"Mooncake TransferEngine.initialize({config.kv_ip!r}, {config.metadata_server!r}, "
                               f"{config.protocol!r}, {config.device_name!r}) failed with {rc}")
        self._data = f"{config.kv_ip}:{self.engine.get_rpc_port()}"
        self._registered: list[tuple[int, int]] = []

    @property
    def data(self) -> str:
        return self._data

    def register(self, buffer: torch.Tensor) -> int:
        base = super().register(buffer)
        nbytes = buffer.numel() * buffer.element_size()
        rc = self.engine.register_memory(base, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory of {nbytes} bytes failed with {rc}")
        self._registered.append((base, nbytes))
        return base

    def read(self, peer: str, remote_address: int, local_address: int, nbytes: int) -> None:
        self.registrations.view(local_address, nbytes)        # refuse a destination outside our memory
        rc = self.engine.transfer_sync_read(peer, local_address, remote_address, nbytes)
        if rc < 0:
            raise TransferError(f"Mooncake read of {nbytes} bytes from {peer} failed with {rc}")

    def write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> None:
        self.registrations.view(local_address, nbytes)
        rc = self.engine.transfer_sync_write(peer, local_address, remote_address, nbytes)
        if rc < 0:
            raise TransferError(f"Mooncake write of {nbytes} bytes to {peer} failed with {rc}")

    def close(self) -> None:
        for base, _ in self._registered:
            self.engine.unregister_memory(base)
        self._registered.clear()
        super().close()
