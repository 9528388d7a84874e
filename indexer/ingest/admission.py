"""Which checked records enter the version, decided in input order: duplicate ids and bad
records.

Both engines check chunks out of order (a reader thread, Ray workers) but admit them here in
input order, so that "duplicate id, first seen on line N" names the first valid occurrence.
Without --skip-bad, the first bad record ends the version (nothing more is written) but checking
goes on, so that one run names every bad record (up to models.records.MAX_REPORTED) in input
order; `finish` raises them.
A record rejected after its id was read (indexer.ingest.checks.FINISH) is reported as a duplicate
when its id was already taken, as the Validator checks the id first.
"""

from __future__ import annotations

import logging

import numpy as np

from indexer.ingest.checks import FINISH, Checked, Reject, first_seen
from indexer.ingest.sources import RecordFiles, unpack
from indexer.ingest.validate import Rejected
from models.records import BadLines, RecordError, display_path, ignored_line

log = logging.getLogger(__name__)


class Admission:
    """The ids admitted so far (id -> location) and every record left out."""

    def __init__(self, files: RecordFiles, skip_bad: bool):
        self.files = files
        self.skip_bad = skip_bad
        self.seen: dict[str, int] = {}
        self.rejected: list[Rejected] = []
        one_file = display_path(files.files[0]) if len(files.files) == 1 else None
        self.bad = BadLines(one_file, skip="--skip-bad")  # without skip_bad: what `finish` raises
        self.ignored: dict[str, int] = {}  # fields that are no modality -> first location

    def admit(self, checked: Checked) -> np.ndarray:
        """(n,) bool over checked.rows: the rows that enter the version; none once a bad record
        was found without skip_bad (ids are still taken, to name later duplicates)."""
        rows = checked.rows
        if checked.ignored:
            first_seen(self.ignored, checked.ignored)
        if not checked.rejects:
            fresh = dict(zip(rows.ids, rows.locs.tolist(), strict=True))
            if len(fresh) == len(rows) and self.seen.keys().isdisjoint(fresh):
                self.seen.update(fresh)  # the common case: no duplicate, nothing to name
                return np.full(len(rows), not self.bad, dtype=bool)
        keep = np.ones(len(rows), dtype=bool)
        events: list[tuple[int, int, Reject | None]]
        events = [(int(loc), i, None) for i, loc in enumerate(rows.locs.tolist())]
        events += [(r.loc, -1, r) for r in checked.rejects]
        for loc, i, reject in sorted(events, key=lambda e: e[0]):
            rid = rows.ids[i] if reject is None else reject.id
            first = self.seen.get(rid) if rid is not None else None
            if reject is not None and (reject.stage != FINISH or first is None):
                self._reject(loc, reject.id, reject.reason)
            elif first is not None:
                if reject is None:
                    keep[i] = False
                self._reject(loc, rid, f"duplicate id, first seen on {self._where(first, loc)}")
            else:
                self.seen[rows.ids[i]] = loc
        return keep & (not self.bad)

    def finish(self, names: list[str]) -> None:
        """Says which fields were left out (the model's modalities are `names`), then raises
        every bad record found, unless skip_bad left them out."""
        if self.ignored:
            where = {k: self.files.where(loc) for k, loc in sorted(self.ignored.items())}
            log.warning("%s", ignored_line(where, names))
        self.bad.raise_any()

    def _where(self, first: int, loc: int) -> str:
        same_file = unpack(first)[0] == unpack(loc)[0]
        return f"line {unpack(first)[1]}" if same_file else self.files.where(first)

    def _reject(self, loc: int, rid: str | None, reason: str) -> None:
        line = unpack(loc)[1]
        rejected = Rejected(line, rid, reason, self.files.file_name(loc))
        if not self.skip_bad:  # the error names the file even when it is the only one
            exc = RecordError(reason, line, rid)
            if rejected.file is not None:
                exc.args = (f"{rejected.where()}: {reason}",)  # `line 3 of part-1.jsonl, id ...`
            self.bad.add(exc)  # raises once MAX_REPORTED are kept
            return
        self.rejected.append(rejected)
        log.warning("skipped: %s: %s", rejected.where(), reason)
