"""The tuner behind `--spec auto[:recall=R]` and `hclip index tune`: it measures candidate
indexes on one view's vectors and picks the one that serves the most queries per second under
the load the server runs, as long as it keeps recall@10 >= R.

Why measure instead of trusting defaults: stored H-CLIP vectors are Hadamard products, not unit
vectors, and their inner-product geometry is not the cosine geometry ANN defaults are tuned
for. A query's best records are often spread over several tight clusters (every (b, c) that
fits the query's a), which a graph walk reaches one at a time while an inverted file probes
them together. Which family wins, and at what effort, depends on the model and the data.

How:
- queries: sampled from records' query modalities (and a held-out file when given), split in
  two disjoint halves: the *tune* half chooses, the *check* half confirms the choice;
- ground truth: exact top-10 by inner product (faiss.contrib.exhaustive_search);
- candidates (see `grid`): HNSW over the norm-augmented vectors (M), IVF-Flat over them and
  over the raw products with inner-product lists (nlist), IVF-PQ with 4-bit fast-scan codes
  and IVF-SQ8, both re-ranked exactly (indexer.search.ann); each structure is built once and its
  effort (ef_search or nprobe) swept upward, doubling, until the tune recall clears the
  target by one standard error, then bisected; a sweep stops early once a structure runs
  slower than flat search, since more effort only makes it slower;
- timing: one thread, as the server runs; single queries (a lone request) and batches of the
  size the server forms under load (`served_batch`: concurrent requests on one worker are
  searched together, and batched exact search gains more from batching than an inverted
  file probing many lists does); flat search is timed the way the server runs it
  (indexer.search.exact), on the same memory-mapped vectors, in turn with every point's own
  timing, so that each speed-up is a ratio of timings taken side by side (see paired_rates);
- pick: of the points that met the target on the tune half, the one that serves the most
  queries per second in batches of `served_batch`, if its recall on the check half also meets
  the target (else the next, and so on); it must serve MIN_SPEEDUP times what flat search
  does at that batch size and be no slower for a lone query; flat search is always a
  candidate (recall 1): when no index reaches the target, or none is fast enough, the view
  stays flat and the report says why, structure by structure, and what it compared.

Every measured point goes into the report (the view's `tuning` entry in the manifest), with
Pareto-optimal points marked by faiss.contrib.evaluation.OperatingPoints.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import faiss
import numpy as np
import torch
from faiss.contrib.evaluation import OperatingPoints, knn_intersection_measure
from faiss.contrib.exhaustive_search import knn_ground_truth

from indexer.search import ann, exact, mips
from indexer.search.specs import (
    EFFORT_PARAM,
    IndexSpec,
    augmented_width,
    new_index,
    set_search_params,
)
from indexer.tune.defaults import BUDGET_S, FAMILIES, MIN_SPEEDUP, MIN_TIMING_S, SERVED_BATCH

log = logging.getLogger(__name__)

K = 10
PLATEAU = 0.002  # a sweep stops once two doublings of effort gained less recall than this
MAX_EFFORT = 4096  # the server's default HCLIP_MAX_EFFORT
MIN_ROWS = 1000  # below this, flat search is both exact and fast: nothing to tune
ADD_CHUNK = 65536
KEPT = 3  # structures held (for the pick) beyond their own sweep
Search = Callable[[np.ndarray], object]  # queries -> results; only its speed is of interest


# ---------------------------------------------------------------------------------------------
# What is measured


@dataclass
class Point:
    """One operating point: an index structure searched at one effort, its speeds paired with
    flat search's measured alongside (see paired_rates)."""

    family: str
    spec: IndexSpec  # with the effort applied
    structure: str  # the built structure it searches (its build-time spec, no effort)
    recall: float  # on the tune queries
    recall_se: float  # standard error of that mean, over queries
    qps_single: float
    qps_batch: float
    flat_single: float  # flat search's speeds, timed in turn with this point's
    flat_batch: float
    bytes_per_record: float
    build_s: float
    meets: bool = False  # recall - target >= one standard error (on the tune queries)
    pareto: bool = False
    check_recall: float | None = None  # measured only for points the pick considered

    @property
    def speedup_single(self) -> float:
        return self.qps_single / self.flat_single

    @property
    def speedup_batch(self) -> float:
        return self.qps_batch / self.flat_batch

    def to_dict(self) -> dict[str, Any]:
        out = {
            "family": self.family,
            "structure": self.structure,
            "spec": str(self.spec),
            "effort": self.spec.effort,
            "recall_at_10": round(self.recall, 4),
            "recall_se": round(self.recall_se, 4),
            "qps_single": round(self.qps_single, 1),
            "qps_batch": round(self.qps_batch, 1),
            "speedup_single": round(self.speedup_single, 2),
            "speedup_batch": round(self.speedup_batch, 2),
            "flat_qps_single": round(self.flat_single, 1),
            "flat_qps_batch": round(self.flat_batch, 1),
            "bytes_per_record": round(self.bytes_per_record, 1),
            "build_s": round(self.build_s, 1),
            "meets_target": self.meets,
            "pareto": self.pareto,
        }
        if self.check_recall is not None:
            out["check_recall_at_10"] = round(self.check_recall, 4)
        return out


@dataclass
class FlatBaseline:
    """Flat search as the server runs it, for one query and for a batch, and the speeds first
    measured."""

    single: Search
    batch: Search
    batch_kernel: str
    qps_single: float
    qps_batch: float
    bytes_per_record: float

    def to_dict(self, points: Sequence[Point]) -> dict[str, Any]:
        # Medians of the timings paired with the points: the load seen while the points ran.
        single = float(np.median([p.flat_single for p in points])) if points else self.qps_single
        batch = float(np.median([p.flat_batch for p in points])) if points else self.qps_batch
        return {
            "qps_single": round(single, 1),
            "qps_batch": round(batch, 1),
            "batch_kernel": self.batch_kernel,
            "bytes_per_record": round(self.bytes_per_record, 1),
        }


@dataclass
class TuneResult:
    spec: IndexSpec  # the pick, with the target kept (flat when nothing better met it)
    index: Any  # the picked FAISS index, None for flat
    max_norm: float
    width: int
    recall: float  # the pick's recall@10 on the check queries (1.0 for flat)
    report: dict[str, Any] = field(default_factory=dict)


@dataclass
class TuneOptions:
    """How to tune (the defaults are what `--spec auto` does)."""

    families: Sequence[str] = FAMILIES
    explore_to: float | None = None  # see Tuner
    min_speedup: float = MIN_SPEEDUP
    served_batch: int = SERVED_BATCH  # queries per search call the server forms under load
    held_out: dict[str, np.ndarray] = field(default_factory=dict)  # view name -> query vectors
    timing_s: float = MIN_TIMING_S  # each speed measurement runs at least this long, twice
    # Once this long has passed and some structure meets the target, the structures not yet
    # tried are skipped (and named in the report): a large view's HNSW build alone can take
    # many minutes on a few cores. None: try them all.
    budget_s: float | None = BUDGET_S


@dataclass
class Workload:
    """The tuner's inputs for one view."""

    vectors: np.ndarray  # (N, d) float32 record vectors, as flat search reads them
    tune_q: np.ndarray  # (nt, d) query vectors the choice is made on
    check_q: np.ndarray  # (nc, d) disjoint queries the choice is confirmed on
    exact_vectors: ann.ExactVectors  # positions -> exact vectors, as the server recomputes them
    sources: dict[str, int] = field(default_factory=dict)  # where the queries came from


# ---------------------------------------------------------------------------------------------
# Timing


@contextmanager
def one_thread() -> Iterator[None]:
    """The server searches on one FAISS thread and one torch thread (HCLIP_FAISS_THREADS,
    HCLIP_TORCH_THREADS): time it that way, whatever the build process uses."""
    before = faiss.omp_get_max_threads(), torch.get_num_threads()
    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before[0])
        torch.set_num_threads(before[1])


def rate(search: Search, xq: np.ndarray, per_call: int, seconds: float) -> float:
    """Queries per second of `search` given `per_call` queries at a time, cycling through xq,
    for at least `seconds` and three calls."""
    if len(xq) < per_call:
        xq = np.resize(xq, (per_call, xq.shape[1]))
    starts = range(0, len(xq) - per_call + 1, per_call)
    done = calls = 0
    t0 = time.perf_counter()
    while True:
        for s in starts:
            search(xq[s : s + per_call])
            done, calls = done + per_call, calls + 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds and calls >= 3:
                return done / elapsed


def paired_rates(
    index: Search, flat_search: Search, xq: np.ndarray, per_call: int, seconds: float
) -> tuple[float, float]:
    """(index q/s, flat q/s), timed in turn twice (flat, index, flat, index), the faster of
    each pair kept. On a shared machine the load changes within minutes, so a ratio is only
    meaningful between timings taken side by side; the faster timing is the one least
    disturbed."""
    best_index = best_flat = 0.0
    for _ in range(2):
        best_flat = max(best_flat, rate(flat_search, xq, per_call, seconds))
        best_index = max(best_index, rate(index, xq, per_call, seconds))
    return best_index, best_flat


def measure_flat(
    vectors: np.ndarray, xq: np.ndarray, seconds: float, batch_size: int
) -> FlatBaseline:
    """Flat search as the server runs it (indexer.search.exact): one query, and a batch."""
    search = partial(_exact, vectors)
    single, batch = rate(search, xq, 1, seconds), rate(search, xq, batch_size, seconds)
    return FlatBaseline(search, search, "exact", single, batch, 4.0 * vectors.shape[1])


def _exact(vectors: np.ndarray, xq: np.ndarray) -> object:
    return exact.search(xq, vectors, K)


# ---------------------------------------------------------------------------------------------
# Recall


def ground_truth(xq: np.ndarray, vectors: np.ndarray, k: int) -> np.ndarray:
    """Exact top-k positions by inner product, streamed over the vectors in chunks."""
    chunks = (
        np.ascontiguousarray(vectors[s : s + ADD_CHUNK]) for s in range(0, len(vectors), ADD_CHUNK)
    )
    _, idx = knn_ground_truth(xq, chunks, k, metric_type=faiss.METRIC_INNER_PRODUCT)
    return np.asarray(idx)


def recall_of(found: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """(recall@k, its standard error over queries): the share of the exact top-k found."""
    recall = float(knn_intersection_measure(found, truth))
    per_query = np.array([np.intersect1d(f, t).size for f, t in zip(found, truth, strict=True)])
    per_query = per_query / truth.shape[1]
    se = float(per_query.std(ddof=1) / math.sqrt(len(per_query))) if len(per_query) > 1 else 0.0
    return recall, se


# ---------------------------------------------------------------------------------------------
# Candidates


def _pow2(x: float) -> int:
    return 1 << max(0, round(math.log2(max(x, 1.0))))


def nlists(n: int) -> list[int]:
    """Inverted-file sizes to try: about 2 and 4 sqrt(N) lists (powers of two), with at least
    39 training points per list (FAISS's minimum)."""
    cap = 1 << int(math.log2(max(n // 39, 1)))
    return sorted({min(_pow2(f * math.sqrt(n)), cap) for f in (2, 4)})


def grid(n: int, dim: int, families: Sequence[str]) -> list[IndexSpec]:
    """The index structures measured for a view of n records of dimension dim.

    HNSW: M 16 and 32 (32 alone past 250k records, where each build takes minutes), ef
    construction 200. IVF-Flat, over the augmented vectors (L2) and over the raw products
    (inner product, `ivfip`): the nlists above. IVF-PQ: 4-bit fast-scan codes over pairs of
    dimensions (m = dim / 2), re-ranked from 16 x k and 64 x k candidates; IVF-SQ8 (one byte per
    dimension) re-ranked from 4 x k. Compressed codes cannot order the near-ties of a tight
    cluster, hence the re-ranking depths."""
    out: list[IndexSpec] = []
    lists = nlists(n)
    for kind in ("ivf", "ivfip"):
        if kind in families:
            out += [IndexSpec(kind, {"nlist": nl, "nprobe": 1}) for nl in lists]
    if "ivfpq" in families:
        m = max(1, dim // 2)
        for rerank in (16, 64):
            params = {"nlist": lists[-1], "m": m, "nbits": 4, "nprobe": 1, "rerank": rerank}
            out.append(IndexSpec("ivfpq", params))
    if "ivfsq" in families:
        out.append(IndexSpec("ivfsq", {"nlist": lists[-1], "nprobe": 1, "rerank": 4}))
    # HNSW last: its builds take the longest, and a time budget (TuneOptions) cuts the tail.
    if "hnsw" in families:
        for m in (16, 32) if n <= 250_000 else (32,):
            out.append(IndexSpec("hnsw", {"M": m, "ef_construction": 200, "ef_search": 16}))
    return out


def efforts(spec: IndexSpec) -> list[int]:
    """The effort ladder of a structure: doubling, up to MAX_EFFORT (and nlist for IVF)."""
    top = MAX_EFFORT if spec.kind == "hnsw" else min(MAX_EFFORT, spec.params["nlist"])
    start = 16 if spec.kind == "hnsw" else 1
    out = []
    e = start
    while e <= top:
        out.append(e)
        e *= 2
    return out or [top]


def structure_of(spec: IndexSpec) -> str:
    """A structure's name: its spec without the effort, which is swept, not built."""
    effort_key = EFFORT_PARAM.get(spec.kind)
    opts = ",".join(f"{k}={v}" for k, v in spec.params.items() if k != effort_key)
    return spec.kind + (f":{opts}" if opts else "")


def with_effort(spec: IndexSpec, effort: int) -> IndexSpec:
    key = "ef_search" if spec.kind == "hnsw" else "nprobe"
    return IndexSpec(spec.kind, {**spec.params, key: effort})


@dataclass
class Built:
    spec: IndexSpec  # build-time parameters; effort set per point
    index: Any
    width: int
    build_s: float
    bytes_per_record: float


def build_index(spec: IndexSpec, vectors: np.ndarray, max_norm: float) -> Built:
    """Train (on a sample) and fill one candidate from the record vectors, norm-augmented."""
    n, dim = vectors.shape
    width = augmented_width(dim, spec)
    t0 = time.perf_counter()
    index = new_index(spec, width, n)
    if not index.is_trained:
        nlist = int(spec.params.get("nlist") or 1)
        size = min(n, max(50_000, 64 * nlist))
        pick = np.sort(np.random.default_rng(0).choice(n, size=size, replace=False))
        index.train(ann.stored_form(spec, np.asarray(vectors[pick]), max_norm, width))
    for s in range(0, n, ADD_CHUNK):
        index.add(ann.stored_form(spec, np.asarray(vectors[s : s + ADD_CHUNK]), max_norm, width))
    build_s = time.perf_counter() - t0
    size = int(faiss.serialize_index(index).nbytes)
    return Built(spec, index, width, build_s, size / max(n, 1))


# ---------------------------------------------------------------------------------------------
# The tuner


class Tuner:
    def __init__(self, work: Workload, target: float, opts: TuneOptions):
        """Options (TuneOptions): `explore_to` keeps sweeping each structure up to that recall
        (a benchmark's full frontier) instead of stopping once the target is met;
        `min_speedup` (see MIN_SPEEDUP; 0 picks the fastest index that meets the target even
        where flat search is faster)."""
        self.work = work
        self.target = target
        self.families = tuple(opts.families)
        self.explore_to = opts.explore_to
        self.min_speedup = opts.min_speedup
        self.batch = max(1, opts.served_batch)
        self.timing_s = opts.timing_s
        self.budget_s = opts.budget_s
        self.n, self.dim = work.vectors.shape
        self.max_norm = mips.max_norm(work.vectors)
        self.points: list[Point] = []
        self.notes: dict[str, str] = {}
        self.indexes: dict[str, Built] = {}  # every structure built, by its codes
        self.built: dict[str, Built] = {}  # structures with a point that met the target

    def run(self) -> TuneResult:
        t0 = time.perf_counter()
        w = self.work
        if self.n < MIN_ROWS or len(w.tune_q) < 10 or len(w.check_q) < 10:
            why = (
                f"{self.n} records: flat search is exact and fast at this size"
                if self.n < MIN_ROWS
                else "too few queries to measure recall (records lack the query modalities)"
            )
            return self._flat_result(None, why, t0)
        k = min(K, self.n)
        self.tune_gt = ground_truth(w.tune_q, w.vectors, k)
        self.check_gt = ground_truth(w.check_q, w.vectors, k)
        with one_thread():
            self.flat = measure_flat(w.vectors, w.tune_q, self.timing_s, self.batch)
        log.info(
            "flat: %.0f q/s single, %.0f q/s in batches of %d (%s)",
            self.flat.qps_single,
            self.flat.qps_batch,
            self.batch,
            self.flat.batch_kernel,
        )
        for spec in grid(self.n, self.dim, self.families):
            spent = time.perf_counter() - t0
            if self.budget_s is not None and spent > self.budget_s and self.built:
                self.notes[structure_of(spec)] = (
                    f"not tried: {spent:.0f} s spent, past the time budget of {self.budget_s:g} s"
                )
                continue
            self._sweep(spec)
        self._mark_pareto()
        return self._pick(t0)

    # -- one structure ------------------------------------------------------------------------

    def _search(self, b: Built, spec: IndexSpec, xq: np.ndarray, k: int = K) -> np.ndarray:
        """Positions found, searched as the server searches (re-ranking included), in slices
        so that re-ranking many queries at once never recomputes a huge block of vectors."""
        parts = [
            ann.search(
                b.index,
                spec,
                xq[s : s + 256],
                k,
                self.max_norm,
                b.width,
                exact_vectors=self.work.exact_vectors,
            )[1]
            for s in range(0, len(xq), 256)
        ]
        return np.concatenate(parts)

    def _measure(self, b: Built, effort: int) -> Point:
        spec = with_effort(b.spec, effort)
        set_search_params(b.index, spec)
        k = self.tune_gt.shape[1]
        recall, se = recall_of(self._search(b, spec, self.work.tune_q, k), self.tune_gt)
        search = partial(self._search, b, spec, k=k)
        xq, secs, fl = self.work.tune_q, self.timing_s, self.flat
        with one_thread():
            single, flat_single = paired_rates(search, fl.single, xq, 1, secs)
            batch, flat_batch = paired_rates(search, fl.batch, xq, self.batch, secs)
        point = Point(
            spec.kind,
            spec,
            structure_of(b.spec),
            recall,
            se,
            single,
            batch,
            flat_single,
            flat_batch,
            b.bytes_per_record,
            b.build_s,
        )
        point.meets = recall - se >= self.target
        self.points.append(point)
        log.info(
            "  %s: recall@10 %.3f (+-%.3f); %.0f q/s single (%.1fx flat), %.0f batched (%.1fx)",
            spec,
            recall,
            se,
            single,
            point.speedup_single,
            batch,
            point.speedup_batch,
        )
        return point

    def _sweep(self, spec: IndexSpec) -> None:
        """Build one structure (or re-use one that differs only in its re-ranking depth, a
        search-time setting) and climb its effort ladder (then bisect the last step)."""
        codes = structure_of(IndexSpec(spec.kind, {**spec.params, "rerank": 0}))
        if codes in self.indexes:
            b = replace(self.indexes[codes], spec=spec)
        else:
            try:
                b = build_index(spec, self.work.vectors, self.max_norm)
            except RuntimeError as exc:  # FAISS refuses e.g. too few training points
                self.notes[structure_of(spec)] = f"not built: {exc}"
                return
            self.indexes[codes] = b
            log.info("%s: built in %.1f s, %.0f B/record", spec, b.build_s, b.bytes_per_record)
        stop = max(self.target, self.explore_to or 0.0)
        last_fail: int | None = None
        first_meet: Point | None = None
        best: Point | None = None
        why = f"reached the largest effort ({efforts(spec)[-1]})"
        recalls: list[float] = []
        for e in efforts(spec):
            p = self._measure(b, e)
            best = p if best is None or p.recall > best.recall else best
            if p.meets and first_meet is None:
                first_meet = p
            if p.recall - p.recall_se >= stop:
                break
            # (min_speedup 0 keeps a structure slower than flat search: a test's small view)
            if max(p.speedup_single, p.speedup_batch) < min(1.0, self.min_speedup):
                why = f"slower than flat search, alone and in batches, from effort {e} on"
                break
            recalls.append(p.recall)
            if len(recalls) >= 3 and recalls[-1] - recalls[-3] < PLATEAU:
                # e.g. compressed codes whose re-ranking depth, not the lists probed, limits
                why = f"recall stopped improving by effort {e}"
                break
            if not p.meets:
                last_fail = e
        if first_meet is not None and last_fail is not None:
            first_meet = self._bisect(b, last_fail, first_meet)
        assert best is not None
        if first_meet is None and "rerank" not in spec.params:
            del self.indexes[codes]  # never picked, never re-used: free its memory now
        if first_meet is not None:
            self.built[structure_of(b.spec)] = b
            self._keep_the_best()
            self.notes[structure_of(b.spec)] = (
                f"meets {self.target} at effort {first_meet.spec.effort}: recall@10 "
                f"{first_meet.recall:.3f}, {first_meet.speedup_batch:.1f}x flat search's "
                f"queries/s in batches of {self.batch}, {first_meet.speedup_single:.1f}x alone"
            )
        else:
            self.notes[structure_of(b.spec)] = (
                f"cannot reach {self.target}: best recall@10 {best.recall:.3f} at effort "
                f"{best.spec.effort}; {why}"
            )

    def _keep_the_best(self) -> None:
        """Hold on to the KEPT structures whose points met the target fastest and free the
        others: an uncompressed one holds every vector again (0.5 to 0.8 GB at 1M x 128)."""
        best: dict[str, float] = {}
        for p in self.points:
            if p.meets and p.structure in self.built:
                best[p.structure] = max(best.get(p.structure, 0.0), p.speedup_batch)
        for name in sorted(best, key=lambda n: -best[n])[KEPT:]:
            dropped = self.built.pop(name)
            if not any(b.index is dropped.index for b in self.built.values()):
                for key in [k for k, b in self.indexes.items() if b.index is dropped.index]:
                    del self.indexes[key]

    def _bisect(self, b: Built, lo: int, hi: Point) -> Point:
        """Narrow the effort between a failing and a meeting one (three steps at most)."""
        hi_e = hi.spec.effort
        assert hi_e is not None
        for _ in range(3):
            if hi_e <= lo * 1.25:
                break
            mid = round(math.sqrt(lo * hi_e))
            if mid in (lo, hi_e):
                break
            p = self._measure(b, mid)
            if p.meets:
                hi, hi_e = p, mid
            else:
                lo = mid
        return hi

    # -- the choice ----------------------------------------------------------------------------

    def _mark_pareto(self) -> None:
        """Pareto-optimal points of recall against single-query time, relative to flat search
        (faiss.contrib)."""
        ops = OperatingPoints()
        for i, p in enumerate(self.points):
            ops.add_operating_point(i, p.recall, 1.0 / p.speedup_single)
        for i, _, _ in ops.operating_points:
            self.points[i].pareto = True

    def _pick(self, t0: float) -> TuneResult:
        k = self.check_gt.shape[1]
        faster = sorted(
            (
                p
                for p in self.points
                # as fast alone as flat search too, unless no speed-up is asked for at all
                if p.meets
                and p.speedup_batch >= self.min_speedup
                and p.speedup_single >= min(1.0, self.min_speedup)
            ),
            key=lambda p: -p.speedup_batch,
        )
        for p in (p for p in faster if p.structure in self.built):
            b = self.built[p.structure]
            set_search_params(b.index, p.spec)
            found = self._search(b, p.spec, self.work.check_q, k)
            p.check_recall, _ = recall_of(found, self.check_gt)
            if p.check_recall >= self.target:
                spec = p.spec.with_target(self.target)
                report = self._report(spec, p.check_recall, t0)
                return TuneResult(spec, b.index, self.max_norm, b.width, p.check_recall, report)
            log.info("%s: recall@10 %.3f on the check queries: rejected", p.spec, p.check_recall)
        met = [p for p in self.points if p.meets]
        why = (
            "no approximate index reached the target"
            if not met
            else f"no index that reached the target served {self.min_speedup}x flat search's "
            f"queries/s in batches of {self.batch} (and as fast alone)"
            if not faster
            else "no index that reached the target on the tune queries kept it on the check ones"
        )
        return self._flat_result(why, None, t0)

    def _flat_result(self, why: str | None, skipped: str | None, t0: float) -> TuneResult:
        spec = IndexSpec("flat", {}, self.target)
        if skipped is not None:
            report = {"target_recall": self.target, "met": True, "picked": "flat", "why": skipped}
            return TuneResult(spec, None, self.max_norm, self.dim + 1, 1.0, report)
        report = self._report(spec, 1.0, t0, why)
        return TuneResult(spec, None, self.max_norm, self.dim + 1, 1.0, report)

    def _report(
        self, spec: IndexSpec, check: float, t0: float, why: str | None = None
    ) -> dict[str, Any]:
        picked = next((p for p in self.points if p.spec == spec.with_target(None)), None)
        flat = self.flat.to_dict(self.points)
        single = picked.qps_single if picked else flat["qps_single"]
        batch = picked.qps_batch if picked else flat["qps_batch"]
        out: dict[str, Any] = {
            "target_recall": self.target,
            "met": True,  # flat search always meets it
            "picked": str(spec),
            "check": {
                "queries": len(self.work.check_q),
                "recall_at_10": round(check, 4),
                "qps_single": round(single, 1),
                "qps_batch": round(batch, 1),
                "speedup_single": round(picked.speedup_single, 2) if picked else 1.0,
                "speedup_batch": round(picked.speedup_batch, 2) if picked else 1.0,
            },
            "tune_queries": len(self.work.tune_q),
            "query_sources": self.work.sources,
            "flat": flat,
            "structures": self.notes,
            "frontier": [p.to_dict() for p in self.points],
            "min_speedup": self.min_speedup,
            "served_batch": self.batch,
            "rule": (
                "the most queries/s in batches of served_batch among the indexes that keep the "
                "target on the check queries, if at least min_speedup times flat search's "
                "there and as fast alone; else flat"
            ),
            "timing": {
                "faiss_threads": 1,
                "batch": self.batch,
                "k": K,
                "min_seconds": self.timing_s,
                "paired_with_flat": True,
            },
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if why is not None:
            out["why"] = why
        return out


def tune(work: Workload, target: float, opts: TuneOptions | None = None) -> TuneResult:
    return Tuner(work, target, opts or TuneOptions()).run()


def split_queries(sources: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint tune and check halves, each source dealt alternately into both."""
    tune_parts = [q[0::2] for q in sources.values()]
    check_parts = [q[1::2] for q in sources.values()]
    dim = next(iter(sources.values())).shape[1] if sources else 0
    empty = np.zeros((0, dim), np.float32)
    return (
        np.concatenate([empty, *tune_parts]).astype(np.float32),
        np.concatenate([empty, *check_parts]).astype(np.float32),
    )
