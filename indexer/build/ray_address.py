"""Checking a --ray-address before Ray is asked to join it.

Ray itself keeps retrying an address that takes no connection: a build pointed at a wrong
host or port would sit for minutes printing reconnection warnings. A TCP
connect to the address's host and port answers in milliseconds when the port is closed, or
within REACH_TIMEOUT_S when the host does not answer, and the job then stops with an error
that names the address. Ray-free, so the command line can name the error without Ray.
"""

from __future__ import annotations

import socket

REACH_TIMEOUT_S = 10.0
CLIENT_SCHEME = "ray://"


class ClusterError(ConnectionError):
    """The Ray cluster named by --ray-address cannot be joined (nothing answers there, or it
    failed to take this job): reported as the command's error, not as a traceback."""


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `ray://host:port` (IPv6 hosts in brackets); None for the
    addresses Ray resolves itself (`auto`, `local`, anything without a port)."""
    rest = address.removeprefix(CLIENT_SCHEME)
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float = REACH_TIMEOUT_S) -> None:
    """Raise ClusterError unless `address` (when it names a host and a port) accepts a
    TCP connection within `timeout` seconds."""
    where = host_port(address)
    if where is None:
        return
    try:
        with socket.create_connection(where, timeout=timeout):
            return
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ClusterError(
            f"--ray-address {address}: no Ray cluster answers at {where[0]}:{where[1]} ({reason})"
        ) from None
