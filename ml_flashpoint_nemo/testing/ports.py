"""A port for a rendezvous server (torch.distributed's TCPStore) that a test or an example starts.

Asking the kernel for port 0 returns a port from its ephemeral range, the same range every
outgoing connection takes its local port from. Between closing the probe and the store's
listen() another connection may take that port (EADDRINUSE), which happens in suites that open
hundreds of connections, as the transfer service's flood tests do. Ports just below the
ephemeral range are never handed out to connections, so one that is free now stays free.
"""

from __future__ import annotations

import random
import socket

_SPAN = 12_000  # how far below the ephemeral range to look
_TRIES = 100


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on host that nothing listens on, chosen outside the ephemeral range when it can be."""
    low, _ = _ephemeral_range()
    first = max(1024, low - _SPAN)
    for _ in range(_TRIES if low - first > 1 else 0):
        port = random.randrange(first, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the range: the kernel's choice
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
