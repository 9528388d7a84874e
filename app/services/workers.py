"""The workers of one `hclip serve --workers N` (uvicorn's own process manager) as each of them
sees the others: which serve a version, so that /readyz answers 200 only when every worker can
search; and each worker's tie to the manager, so that none outlives it.

Each worker keeps a file named by its process id in HCLIP_WORKERS_DIR (a directory `hclip serve`
makes and removes) holding the version it serves, or, after FAILING, why it cannot answer (its
version's files or collections gone, its backend not answering). A worker that died (killed,
crashed) leaves its file behind; whoever reads the board next drops it, and its live metrics
with it (`on_gone`). uvicorn restarts a dead worker; its replacement writes a file of its own
once it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
PARENT_CHECK_S = 1.0  # how often a worker looks whether its manager is still there
FAILING = "!"  # a worker's file starting so says why it cannot answer, not what it serves


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process now has that id: not one of ours
        return False
    return True


class WorkerBoard:
    """With no directory (one process serving alone) this process is the only worker."""

    def __init__(
        self, directory: Path | None, expected: int, on_gone: Callable[[int], None] | None = None
    ):
        self.directory = directory
        self.expected = expected if directory is not None else 1
        self.on_gone = on_gone
        self.pid = os.getpid()

    def serving(self, version: str) -> None:
        """This worker serves `version` now."""
        self._write(version)

    def failing(self, reason: str) -> None:
        """This worker cannot answer, for `reason`, until it says `serving` again."""
        self._write(FAILING + reason)

    def _write(self, text: str) -> None:
        """Written whole: readers never see half a file."""
        if self.directory is None:
            return
        tmp = self.directory / f".{self.pid}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.directory / str(self.pid))

    def leave(self) -> None:
        if self.directory is not None:
            with contextlib.suppress(OSError):
                (self.directory / str(self.pid)).unlink()

    def versions(self) -> dict[int, str]:
        """Live worker -> the version it serves."""
        return {pid: t for pid, t in self._states().items() if not t.startswith(FAILING)}

    def _states(self) -> dict[int, str]:
        """Live worker -> what its file says; the files of dead workers are dropped."""
        if self.directory is None:
            return {}
        out: dict[int, str] = {}
        for path in self.directory.iterdir():
            if not path.name.isdigit():
                continue
            pid = int(path.name)
            if pid != self.pid and not _alive(pid):
                with contextlib.suppress(OSError):
                    path.unlink()
                    if self.on_gone is not None:
                        self.on_gone(pid)
                continue
            with contextlib.suppress(OSError):
                out[pid] = path.read_text()
        return out

    def not_ready(self) -> str | None:
        """Why not every worker can search yet (None when they all can)."""
        if self.directory is None:
            return None
        states = self._states()
        failing = {p: t for p, t in states.items() if t.startswith(FAILING) and p != self.pid}
        if failing:
            pid, why = min(failing.items())
            return f"worker {pid} cannot answer: {why[len(FAILING) :]}"
        serving = sum(not t.startswith(FAILING) for t in states.values())
        if serving >= self.expected:
            return None
        return f"{serving} of {self.expected} workers serve a version; the others are starting"


async def exit_with_parent() -> None:
    """Run in a worker: SIGTERM to itself (uvicorn's graceful stop) once the process that
    started it is gone, however it went (SIGKILL, the OOM killer): an orphaned worker would go
    on serving the port with nothing to restart or stop it."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)
    log.error("the serving process %d is gone: this worker stops", parent)
    os.kill(os.getpid(), signal.SIGTERM)
