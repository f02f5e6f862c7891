"""Free loopback ports for the servers the benchmarks and tests start, picked below the ephemeral range.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range every outgoing
connection takes its local port from. Between picking a port and the server binding it (for vLLM the
engine core binds its KV event socket tens of seconds later), any client connection on the machine can
take it, and the server then dies with "Address already in use" (CI saw vLLM's "Engine core
initialization failed" this way). So ports are drawn at random from below that range, where no connection
lands by chance, checked bindable on every interface (vLLM binds ``tcp://*``), and never handed out twice
by one process.
"""

from __future__ import annotations

import random
import socket
import threading

_LOW = 10000
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair(offset: int = 0) -> int:
    """A port ``p`` free now, with ``p + offset`` free too (the simulator's PUB and replay ports, a Redis
    Cluster node's client and bus ports); ``offset=0`` is a single port. Falls back to the kernel's pick
    when the ephemeral range leaves no room below it."""
    high = _ephemeral_low() - offset
    with _lock:
        for _ in range(500 if high - _LOW > 1000 else 0):
            p = _rng.randrange(_LOW, high)
            pair = {p, p + offset}
            if pair & _given or not all(_bindable(q) for q in pair):
                continue
            _given.update(pair)
            return p
        for _ in range(200):
            p = _kernel_port()
            if p + offset <= 65535 and p not in _given and _bindable(p + offset):
                _given.update({p, p + offset})
                return p
    raise RuntimeError(f"no free pair of ports {offset} apart")


def free_port() -> int:
    """A free port, below the ephemeral range (see the module docstring)."""
    return free_port_pair(0)
