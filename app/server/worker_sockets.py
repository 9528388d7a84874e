"""One listening socket per worker, on the same address (SO_REUSEPORT), under uvicorn's own
process manager: the kernel then spreads new connections over the workers evenly.

Why: on the one socket uvicorn's workers share, the worker that wakes first accepts every
connection waiting, so long-lived connections (a load balancer's pool, a benchmark's) pile up
on some workers while others idle; measured with 2 workers on 2 cores, served queries/s fell
by 16-31% on the realistic workloads (docs/benchmarks/serving.md, "Workers").

How: `hclip serve` binds a ReservedSocket (SO_REUSEPORT, never listening: it holds the port
and takes no connection) and hands it to uvicorn's Multiprocess, which passes it to each worker
it starts, restarts included. Passing it pickles it, and a ReservedSocket unpickles as a fresh
socket bound to the same address: each worker listens on its own once its app has started, so
the kernel only hands connections to workers that can answer them. Linux spreads connections
this way; where SO_REUSEPORT does not exist the workers share one socket, as uvicorn's do.
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
    """The parent's socket: the address's reservation, and each worker's own socket once it
    reaches the worker (see the module's docstring)."""

    @classmethod
    def bind_to(cls, host: str, port: int) -> ReservedSocket:
        plain = reuse_port_socket(host, port)
        sock = cls(plain.family, plain.type, plain.proto, fileno=plain.detach())
        return sock

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        host, port = self.getsockname()[:2]
        return reuse_port_socket, (host, port)
