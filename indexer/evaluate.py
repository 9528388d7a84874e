"""`hclip eval --model MODEL --records FILE [--root ROOT] [--k 10] [--views a,a+b] [--json]`.

Each record's own tuple is the positive. Without `--root`, the file's records are ranked
against each other by the model's exact scores (models.evaluation). With `--root`, each
record's query modalities are encoded by the model and searched through the published
version's views as the service searches them (approximate ones included), against every
record the version holds; for an approximate view the exact search over the same records is
reported beside it, so the cost of the index's recall shows. The file's records must then be
records of that version, matched by id.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from indexer.search import exact
from indexer.search.own_rank import found_ranks
from indexer.search.view import View
from indexer.store import artifact
from indexer.store.version import LoadedVersion, built_by
from models.evaluation import all_views, retrieval
from models.heads import split_modalities, view_name
from models.metrics import summarize
from models.model import MultimodalModel
from models.progress import Progress
from models.records import RecordError
from models.train.records_file import RecordsFile

log = logging.getLogger(__name__)

ENCODE_BATCH = 256
SEARCH_BATCH = 256
# Results fetched per query from an index: a record's own past this depth counts as not found
# (its MRR term as 0, a median rank past it as None).
SEARCH_DEPTH = 1000

Search = Callable[[np.ndarray], np.ndarray]  # (nq, D) query factors -> (nq, depth) record rows


class EvalError(ValueError):
    """A bad `hclip eval` option: one line naming it."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="model directory")
    p.add_argument("--records", required=True, type=Path, help="held-out records (JSON Lines)")
    p.add_argument("--root", type=Path, help="evaluate through this root's published version")
    p.add_argument("--k", type=int, default=10, help="recall@k (default 10)")
    p.add_argument("--views", help="query sets, e.g. a,a+b (default: every view)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def parse_views(text: str | None, names: Sequence[str]) -> list[tuple[str, ...]]:
    if text is None:
        return all_views(names)
    views = []
    for name in text.split(","):
        try:
            q, _ = split_modalities(names, [m for m in name.split("+") if m])
        except ValueError as exc:
            raise EvalError(f"--views: view {name!r}: {exc}") from None
        views.append(q)
    return views


@torch.no_grad()
def embed(model: MultimodalModel, source: RecordsFile, progress: bool) -> dict[str, torch.Tensor]:
    """(N, d) embeddings per modality of every record of the file, in file order."""
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in model.names}
    bar = Progress(total=len(source), desc="eval: encoding", unit="rec", disable=not progress)
    with bar:
        for start in range(0, len(source), ENCODE_BATCH):
            items, _ = source.batch(range(start, min(start + ENCODE_BATCH, len(source))))
            for n in model.names:
                parts[n].append(model.encode(n, items[n]))
            bar.update(len(items[model.names[0]]))
    return {n: torch.cat(p) for n, p in parts.items()}


def _own_rows(version: LoadedVersion, source: RecordsFile, root: Path) -> np.ndarray:
    """(N,) the version's row of each record of the file, matched by id."""
    own = np.empty(len(source), dtype=np.int64)
    for i in range(len(source)):
        rid = source.id_of(i)
        row = version.records.row_of(rid)
        if row is None:
            raise RecordError(
                f"not in version {version.version} of {root}: --root needs records that "
                "version indexed",
                source.line_of(i),
                rid,
                str(source.path),
            )
        own[i] = row
    return own


def _ranks(search: Search, xq: np.ndarray, own: np.ndarray, label: str, progress: bool) -> Any:
    """(N,) where each query's own row came in its search's results (models.metrics ranks)."""
    found = []
    with Progress(total=len(xq), desc=label, unit="q", disable=not progress) as bar:
        for lo in range(0, len(xq), SEARCH_BATCH):
            rows = search(xq[lo : lo + SEARCH_BATCH])
            found.append(found_ranks(rows, own[lo : lo + SEARCH_BATCH]))
            bar.update(len(rows))
    return np.concatenate(found)


def _exact_search(view: View, depth: int) -> Search:
    """Exact search over an approximate view's records: the reference its recall is judged by."""
    assert view.exact_vectors is not None
    xb = view.exact_vectors(np.arange(view.count))  # (count, D)
    rows = np.asarray(view.rows)

    def search(xq: np.ndarray) -> np.ndarray:
        _, pos = exact.search(xq, xb, depth)
        return np.where(pos >= 0, rows[np.clip(pos, 0, None)], -1)

    return search


def through_index(
    model: MultimodalModel,
    embs: dict[str, torch.Tensor],
    source: RecordsFile,
    args: argparse.Namespace,
    views: list[tuple[str, ...]] | None,
) -> dict[str, Any]:
    """Per view: the figures of the version's own search, and for an approximate view those of
    exact search over the same records with the difference."""
    root, k, progress = args.root, args.k, not args.quiet
    version_id = artifact.published(root)
    if version_id is None:
        raise EvalError(f"--root {root}: no published version")
    version = LoadedVersion(artifact.version_dir(root, version_id))
    built_by(version.manifest, args.model)
    own = _own_rows(version, source, root)
    out: dict[str, Any] = {"version": version_id, "depth": SEARCH_DEPTH, "views": {}}
    for query in views or [tuple(v.query) for v in version.views.values()]:
        name = view_name(query)
        if name not in version.views:
            raise EvalError(
                f"--views: view {name!r} is not in version {version_id} (its views: "
                f"{', '.join(version.views)})"
            )
        view = version.views[name]
        with torch.no_grad():
            xq = model.head.query_factor(embs, view.query).numpy().astype(np.float32)  # (N, D)
        depth = min(SEARCH_DEPTH, view.count)

        def by_index(x: np.ndarray, view: View = view, depth: int = depth) -> np.ndarray:
            return view.search(x, depth)[1]

        figures = summarize(_ranks(by_index, xq, own, f"eval: {name}", progress), view.count, (k,))
        entry = {**figures, "index": str(view.spec), "candidates": view.count}
        if not view.spec.exact:
            ranks = _ranks(_exact_search(view, depth), xq, own, f"eval: {name} exact", progress)
            entry["exact"] = summarize(ranks, view.count, (k,))
            entry["difference"] = {
                m: figures[m] - entry["exact"][m] for m in ("hit@1", f"recall@{k}", "mrr")
            }
        out["views"][name] = entry
    return out


def run(args: argparse.Namespace) -> int:
    from models.checkpoint import load_model

    if args.k < 1:
        raise EvalError(f"--k: must be >= 1, got {args.k}")
    model = load_model(args.model)
    views = parse_views(args.views, model.names) if args.views or not args.root else None
    try:
        source = RecordsFile.scan(args.records, model.cfg)
    except RecordError as exc:
        raise exc.in_file(str(args.records)) from None
    embs = embed(model, source, progress=not args.quiet)
    report: dict[str, Any] = {"model": str(args.model), "records": str(args.records), "k": args.k}
    if args.root is None:
        assert views is not None
        report["views"] = retrieval(model.head, embs, views, ks=(args.k,))
    else:
        report["root"] = str(args.root)
        report |= through_index(model, embs, source, args, views)
    print(json.dumps(report) if args.json else table(report))
    return 0


def _cell(x: Any, metric: str) -> str:
    if x is None:
        return "-"
    return f"{x:g}" if metric in ("median_rank", "n") else f"{x:.3f}"


def table(report: dict[str, Any]) -> str:
    """The report as a terminal table: one row per view (and per exact reference)."""
    k = report["k"]
    cols = ["hit@1", f"recall@{k}", "mrr", "median_rank", "chance@1", f"chance@{k}", "n"]
    head = ["view", *cols]
    rows = []
    for name, f in report["views"].items():
        label = f"{name} ({f['index']})" if "index" in f else name
        rows.append([label, *(_cell(f[c], c) for c in cols)])
        if "exact" in f:
            rows.append([f"{name} (exact)", *(_cell(f["exact"][c], c) for c in cols)])
            diff = f["difference"]
            rows.append(
                ["  index - exact", *(f"{diff[c]:+.3f}" if c in diff else "" for c in cols)]
            )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    where = f"version {report['version']} of {report['root']}" if "root" in report else "exact"
    return "\n".join([f"{report['records']} by {report['model']} ({where}):", *lines])
