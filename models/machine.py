"""What the machine offers this process: every default thread or worker count derives from it."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's CPU set), at least one."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
