"""The transfer layer's one interface: `TransferBackend` (register, read, write, confirm).

A backend moves byte ranges between registered memory of two engines, addressed as the
engines see them (a registered tensor's data_ptr() plus an offset: what Mooncake's transfer
engine takes, and what the TCP stand-in resolves against its registrations). The engines
above it move one packed cache row per call (`row_bytes` at `base + row * row_bytes`: a
request's attention rows and its KDA state row alike). `confirm` is the consumer's last word
on a transfer: the producer answers whether its rows were still pinned, so rows read before a
confirmed "yes" were the request's (k3.engine.kv_transfer.producer).

Every backend runs a control channel (`k3.engine.kv_transfer.wire`) for confirm; the TCP
stand-in moves the data over it too, Mooncake over its own transport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .config import KVTransferConfig
from .wire import TransferError, WireClient, WireServer


@runtime_checkable
class TransferBackend(Protocol):
    """What the producer and consumer engines call. `control` and `data` are the addresses a
    peer passes back: the control channel ("host:port") and the data plane's endpoint."""

    name: str
    control: str
    data: str

    def register(self, buffer: torch.Tensor) -> int:
        """Make `buffer` (contiguous) readable and writable by peers; returns its base address."""

    def read(self, peer: str, remote_address: int, local_address: int, nbytes: int) -> None:
        """Copy `nbytes` at the peer's `remote_address` into local registered memory (a pull).
        TransferError on failure."""

    def write(self, peer: str, local_address: int, remote_address: int, nbytes: int) -> None:
        """Copy `nbytes` of local registered memory to the peer's `remote_address` (a push).
        TransferError on failure."""

    def confirm(self, peer_control: str, transfer_id: str) -> bool:
        """Tell the producer at `peer_control` the transfer is complete; True when its rows
        were still pinned (the data read is the request's), False when the pin had expired.
        TransferError when the producer cannot be reached."""

    def on_confirm(self, handler: Callable[[str], bool]) -> None:
        """Answer peers' confirms with `handler(transfer_id)` (the producer's pin registry)."""

    def serve(self, op: str, handler: Callable[[dict, bytes], tuple[dict, bytes]]) -> None:
        """Answer control-channel messages of `op` with `handler(header, payload)` (a TP
        follower's `pull`: k3.engine.kv_transfer.ranks)."""

    def close(self) -> None:
        """Stop serving and release the registrations."""


class Registrations:
    """Registered tensors by address range: resolves (address, nbytes) to a byte view."""

    def __init__(self):
        self._regions: list[tuple[int, int, torch.Tensor]] = []    # (base, nbytes, flat uint8 view)
        self._lock = threading.Lock()

    def add(self, buffer: torch.Tensor) -> int:
        if not buffer.is_contiguous():
            raise ValueError("a registered buffer must be contiguous")
        flat = buffer.view(-1).view(torch.uint8)
        base = flat.data_ptr()
        with self._lock:
            self._regions.append((base, flat.numel(), flat))
        return base

    def view(self, address: int, nbytes: int) -> torch.Tensor:
        """The registered bytes [address, address + nbytes) as a uint8 tensor (no copy);
        ValueError for a range outside every registration."""
        with self._lock:
            for base, size, flat in self._regions:
                if base <= address and address + nbytes <= base + size:
                    return flat[address - base: address - base + nbytes]
        raise ValueError(f"[{address:#x}, +{nbytes}) is outside the registered memory")


class ControlledBackend:
    """The part every backend shares: registrations and the control channel (confirm)."""

    name = "base"

    def __init__(self, config: KVTransferConfig):
        self.config = config
        self.registrations = Registrations()
        self.server = WireServer(config.kv_ip, config.kv_port)
        self.client = WireClient(config.transfer_timeout_s)
        self._confirm: Callable[[str], bool] = lambda transfer_id: False
        self.server.on("confirm", lambda h, _: ({"ok": True, "pinned": bool(self._confirm(h["transfer_id"]))}, b""))
        self.server.on("ping", lambda h, _: ({"ok": True}, b""))

    @property
    def control(self) -> str:
        return self.server.address

    @property
    def data(self) -> str:
        return self.server.address

    def register(self, buffer: torch.Tensor) -> int:
        return self.registrations.add(buffer)

    def on_confirm(self, handler: Callable[[str], bool]) -> None:
        self._confirm = handler

    def serve(self, op: str, handler) -> None:
        self.server.on(op, handler)

    def confirm(self, peer_control: str, transfer_id: str) -> bool:
        reply, _ = self.client.call(peer_control, {"op": "confirm", "transfer_id": transfer_id})
        return bool(reply.get("pinned"))

    def close(self) -> None:
        self.server.close()
        self.client.close()


def make_backend(config: KVTransferConfig) -> TransferBackend:
    """The backend of `config.kv_connector` (Mooncake imports its wheel only here)."""
    if config.backend == "tcp":
        from .tcp import TCPBackend

        return TCPBackend(config)
    from .mooncake import MooncakeBackend

    return MooncakeBackend(config)


__all__ = ["ControlledBackend", "Registrations", "TransferBackend", "TransferError", "make_backend"]
