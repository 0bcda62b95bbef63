"""`k3 serve --host`: vLLM's default (all interfaces) and the warning for a server that anyone
on the network can use.

With no --host the server listens on every IPv4 interface, as `vllm serve` does. A server that
listens beyond loopback without --api-key (or $K3_API_KEY / $VLLM_API_KEY) answers anyone who
reaches the port; `k3 serve` logs one warning saying so once the model is loaded, before it
starts serving (a startup refusal stays its one line).
"""

from __future__ import annotations

import ipaddress
import socket

ALL_INTERFACES = "0.0.0.0"


def listen_host(host: str | None) -> str:
    """The address to bind: `host`, or all IPv4 interfaces for None / "" (vLLM's default)."""
    return host or ALL_INTERFACES


def is_loopback(host: str | None) -> bool:
    """Whether `host` reaches only this machine: a loopback address, or a name every address of
    which is one (None / "" / 0.0.0.0 / :: are every interface: False)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False            # cannot tell: binding will report the name
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def exposure_warning(host: str | None, api_keys) -> str | None:
    """The warning for serving `host` without a key (None when there is a key or the host is
    loopback)."""
    if api_keys or is_loopback(host):
        return None
    where = "every interface" if not host or host in (ALL_INTERFACES, "::") else host
    return (f"listening on {where} without --api-key: anyone who can reach this port can use the model; "
            "pass --api-key (or set $K3_API_KEY / $VLLM_API_KEY), or --host 127.0.0.1 for this machine only")
