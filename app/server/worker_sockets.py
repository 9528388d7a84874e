"""One listening socket per worker, on the same address (SO_REUSEPORT), under uvicorn's own
process manager: the kernel spreads new connections over the workers by a hash of each
connection's addresses.

Why: on the one socket uvicorn's workers share, the worker that wakes first accepts every
connection waiting. A burst of new connections (a load balancer's pool, a benchmark's) can then
land wholly on one worker while the others idle: with raw text or image queries through their
towers, 2 workers on 2 cores, all 32 of wrk's connections went to one worker in 2 of 8 tries,
which served 0.34-0.49 of the towers' limit against 0.8-0.97 when they were spread
(docs/benchmarks/tower_serving.md, "Connections over workers").

How: `hclip serve` binds a ReservedSocket (SO_REUSEPORT, never listening: it holds the port
and takes no connection) and hands it to uvicorn's Multiprocess, which passes it to each worker
it starts, restarts included. Passing it pickles it, and a ReservedSocket unpickles as a fresh
socket bound to the same address: each worker listens on its own once its app has started, so
the kernel only hands connections to workers that can answer them. Where SO_REUSEPORT does not
exist the workers share one socket, as uvicorn's do.
"""

from __future__ import annotations

import socket
from typing import Any

SPREADS = hasattr(socket, "SO_REUSEPORT")


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, not listening."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class ReservedSocket(socket.socket):
    """The manager's socket: the address's reservation, and each worker's own socket once it
    reaches the worker (see the module's docstring)."""

    @classmethod
    def bind_to(cls, host: str, port: int) -> ReservedSocket:
        plain = reuse_port_socket(host, port)
        return cls(plain.family, plain.type, plain.proto, fileno=plain.detach())

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        host, port = self.getsockname()[:2]
        return reuse_port_socket, (host, port)
