"""Which versions have passed their checksums on this machine: a server checks every file of a
version before it first serves it, and remembers that here, so that a restart (or another
worker) does not read the whole version again unless one of its files changed.

A version's signature is a hash of its manifest and of each file's size, modification time and
inode: rewriting or replacing any file changes it. A marker file per passed signature lives in
the directory given (a per-machine cache directory, not the index root, which may be shared or
read-only). Workers of one machine that load the same version at once take a lock per version,
so that one of them reads the files and the others find its marker.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from indexer.store import artifact

log = logging.getLogger(__name__)


def default_directory() -> Path:
    """$XDG_CACHE_HOME/hclip/checked, else ~/.cache/hclip/checked."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hclip" / "checked"


def signature(vdir: Path) -> str:
    """A hash of the manifest's bytes and of every file's size, mtime and inode (stat only)."""
    h = hashlib.sha256((vdir / artifact.MANIFEST).read_bytes())
    for rel in artifact.list_files(vdir):
        st = (vdir / rel).stat()
        h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode())
    return h.hexdigest()[:32]


class CheckedVersions:
    def __init__(self, directory: Path):
        self.dir = directory
        self._usable: bool | None = None

    def _ready(self) -> bool:
        """The directory exists and takes files; else (said once) every load checks again."""
        if self._usable is None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                probe = self.dir / f".probe-{os.getpid()}"
                probe.touch()
                probe.unlink()
                self._usable = True
            except OSError as exc:
                log.warning(
                    "cannot remember checked versions in %s (%s): every start checks the "
                    "version it serves in full (HCLIP_CHECKED_DIR sets another directory)",
                    self.dir,
                    exc.strerror or exc,
                )
                self._usable = False
        return self._usable

    def _marker(self, vdir: Path, sig: str) -> Path:
        return self.dir / f"{vdir.name}.{sig}"

    def check(self, vdir: Path, problems_of: Callable[[Path], list[str]]) -> list[str]:
        """`problems_of(vdir)` unless this machine saw the same files pass before; the
        problems found (none: remembered as passed)."""
        if not self._ready():
            return problems_of(vdir)
        with FileLock(self.dir / f"{vdir.name}.lock"):  # waits for a worker checking it
            sig = signature(vdir)
            if self._marker(vdir, sig).exists():
                return []
            problems = problems_of(vdir)
            if not problems and signature(vdir) == sig:  # unchanged while it was read
                for old in self.dir.glob(f"{vdir.name}.*"):
                    if old.suffix != ".lock":
                        old.unlink(missing_ok=True)  # an earlier signature of this version
                self._marker(vdir, sig).touch()
            return problems
