"""The TCP stand-in backend: reads and writes served by the producer's control channel.

No dependency beyond the stdlib, so CI tests the transfer layer on loopback with it; the
Mooncake backend has the same interface (k3.engine.kv_transfer.backend.TransferBackend).
Device memory is staged through the host (a `.cpu()` copy per row).
"""

from __future__ import annotations

import torch

from .backend import ControlledBackend
from .config import KVTransferConfig


class TCPBackend(ControlledBackend):
    name = "tcp"

    def __init__(self, config: KVTransferConfig):
        super().__init__(config)
        self.server.on("read", self._serve_read)
        self.server.on("write", self._serve_write)

    def _serve_read(self, header: dict, _: bytes):
        region = self.registrations.view(int(header["address"]), int(header["length"]))
        return {"ok": True}, region.cpu().numpy().tobytes()

    def _serve_write(self, header: dict, payload: bytes):
        region = self.registrations.view(int(header["address"]), len(payload))
        region.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return {"ok": True}, b""

    def read(self, peer: str, remote_address: int, local_address: int, nbytes: int) -> None:
        local = self.registrations.view(local_address, nbytes)
        _, data = self.client.call(peer, {"op": "read", "address": remote_address, "length": nbytes})
        if len(data) != nbytes:
            from .wire import TransferError

            raise TransferError(f"read from {peer} returned {len(data)} bytes, expected {nbytes}")
        local.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> None:
        data = self.registrations.view(local_address, nbytes).cpu().numpy().tobytes()
        self.client.call(peer, {"op": "write", "address": remote_address}, data)
