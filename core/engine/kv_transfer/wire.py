"""The control channel (and the TCP stand-in's data plane): framed messages over TCP.

A message is a 4-byte big-endian header length, a JSON header, then `header["nbytes"]` bytes
of payload (0 when absent). A `WireServer` answers each request message with one reply
message from the handler registered for its "op"; a `WireClient` keeps one connection per
peer and thread. Stdlib only (socketserver).
"""

from __future__ import annotations

import json
import socket
import socketserver
import struct
import threading
from collections.abc import Callable

Handler = Callable[[dict, bytes], "tuple[dict, bytes]"]


class TransferError(RuntimeError):
    """A transfer or control call failed (peer gone, refused, timed out); the consumer falls
    back to local prefill."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    view = bytearray(n)
    got = 0
    while got < n:
        k = sock.recv_into(memoryview(view)[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return bytes(view)


def send_message(sock: socket.socket, header: dict, payload: bytes | memoryview = b"") -> None:
    header = {**header, "nbytes": len(payload)}
    raw = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(raw)) + raw)
    if len(payload):
        sock.sendall(payload)


def recv_message(sock: socket.socket) -> tuple[dict, bytes]:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4))
    header = json.loads(_recv_exact(sock, size))
    return header, _recv_exact(sock, int(header.get("nbytes", 0)))


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                header, payload = recv_message(self.request)
            except (ConnectionError, OSError, ValueError):
                return
            handler = self.server.handlers.get(header.get("op"))
            try:
                if handler is None:
                    raise ValueError(f"unknown op {header.get('op')!r}")
                reply, data = handler(header, payload)
            except Exception as e:  # noqa: BLE001 - reported to the caller, the server goes on
                reply, data = {"ok": False, "error": f"{type(e).__name__}: {e}"}, b""
            try:
                send_message(self.request, reply, data)
            except OSError:
                return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class WireServer:
    """A threaded TCP server on (host, port) (port 0: any free one) dispatching on "op"."""

    def __init__(self, host: str, port: int):
        self._server = _Server((host, port), _Handler)
        self._server.handlers = {}
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="k3-kv-wire", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def on(self, op: str, handler: Handler) -> None:
        self._server.handlers[op] = handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class WireClient:
    """Request/reply calls to WireServers, one cached connection per (thread, peer)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._local = threading.local()

    def call(self, peer: str, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        """The reply to one message; TransferError when the peer cannot be reached or says not ok."""
        conns = self._local.__dict__.setdefault("conns", {})
        try:
            sock = conns.get(peer)
            if sock is None:
                host, _, port = peer.rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[peer] = sock
            send_message(sock, header, payload)
            reply, data = recv_message(sock)
        except (OSError, ConnectionError, ValueError) as e:
            sock = conns.pop(peer, None)
            if sock is not None:
                sock.close()
            raise TransferError(f"{header.get('op')} to {peer} failed: {type(e).__name__}: {e}") from None
        if not reply.get("ok", False):
            raise TransferError(f"{header.get('op')} to {peer} refused: {reply.get('error', 'no reason given')}")
        return reply, data

    def close(self) -> None:
        for sock in self._local.__dict__.get("conns", {}).values():
            sock.close()
