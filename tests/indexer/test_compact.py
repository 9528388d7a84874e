"""Compact versions (--compact): float16 embeddings, product views as codes re-ranked exactly,
against full versions of the same records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from indexer.search import ann
from indexer.search import view as view_module
from indexer.store import artifact
from indexer.store.rows import factor_chunks
from indexer.store.verify import verify
from indexer.store.version import LoadedVersion
from models.checkpoint import load_model
from tests.conftest import DIMS, index_build, make_model_dir, run_cli, vector_records, write_jsonl

N = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model, records, tmp): N records, each its own symbol (no near ties), with a field."""
    tmp = tmp_path_factory.mktemp("compact")
    rows = vector_records(N, DIMS, seed=3, k=N)
    for i, r in enumerate(rows):
        r["payload"]["year"] = 2000 + i % 7
    write_jsonl(tmp / "r.jsonl", rows)
    return make_model_dir(tmp / "m"), tmp / "r.jsonl", tmp


def _built(corpus, name: str, *extra: str) -> LoadedVersion:
    model, records, tmp = corpus
    root = tmp / name
    if not root.exists():
        assert index_build(model, records, root, "--filter-fields", "year", *extra) == 0
    return LoadedVersion(artifact.current_version_dir(root))


def _queries(version: LoadedVersion, model_dir: Path, view: str, n: int = 25) -> np.ndarray:
    """Query factors (omega included) of the first n records' query modalities."""
    head = load_model(model_dir).head
    rows = np.arange(n)
    return np.concatenate(list(factor_chunks(head, version.stored, rows, view.split("+"), "query")))


def _same_top(full: LoadedVersion, view: str, xq, r_full, s_full, r_comp) -> bool:
    """The same ids in each query's top k as the full version's, but where float16 rounding
    (about 1e-3 of a score) crosses two neighbours tied that closely at the k-th place: an id
    in one top k only scores, in float32, within 2e-3 of the full version's k-th score."""
    target = full.views[view].target
    tol = 2e-3 * float(np.abs(s_full).max())
    for q in range(len(xq)):
        odd = np.array(sorted(set(r_full[q].tolist()) ^ set(r_comp[q].tolist())), np.int64)
        if len(odd) == 0:
            continue
        factors = np.concatenate(list(factor_chunks(full.head, full.stored, odd, target, "record")))
        exact = factors @ xq[q]  # the head's record factors of the full version's float32 rows
        if np.abs(exact - s_full[q, -1]).max() > tol:
            return False
    return True


def _exact_top(version: LoadedVersion, view: str, xq: np.ndarray, k: int) -> np.ndarray:
    """Each query's best k rows by brute force over the stored embeddings (numpy, float64)."""
    rows = np.asarray(version.views[view].rows)
    scores = _float16_scores(version, version.views[view].target, xq, rows)
    return rows[np.argsort(-scores, axis=1, kind="stable")[:, :k]]


def _float16_scores(version: LoadedVersion, target: tuple[str, ...], xq: np.ndarray, rows):
    """omega . q . prod g_t, from the stored float16 embeddings, in float64 by numpy."""
    prod = np.ones((len(rows), xq.shape[1]))
    for m in target:
        prod = prod * np.asarray(version.stored.embeddings[m][rows], np.float64)
    return xq.astype(np.float64) @ prod.T


def test_compact_answers_the_full_versions_top_10_with_exact_float16_scores(corpus) -> None:
    full = _built(corpus, "full")
    # rerank 30: every query's candidates are all N records, so only scores can differ
    comp = _built(corpus, "compact", "--compact", "--spec", "sq8:rerank=30")
    assert comp.manifest["compact"] == {"embeddings": "float16", "codes": "sq8:rerank=30",
                                        "rerank": 30}  # fmt: skip
    for n in comp.names:
        assert comp.stored.embeddings[n].dtype == np.float16
        assert np.array_equal(comp.stored.embeddings[n], full.stored.embeddings[n].astype("<f2"))
    stores = {name: v["stores"] for name, v in comp.manifest["views"].items()}
    assert stores == {"a": "codes:SQ8", "b": "codes:SQ8", "c": "codes:SQ8",
                      "b+c": "float16", "a+c": "float16", "a+b": "float16"}  # fmt: skip
    floats = [p.name for p in (comp.path / "views").glob("*.npy") if ".rows." not in p.name]
    assert floats == [] and not list((comp.path / "embeddings").glob("*.npy"))
    for name in full.views:
        xq = _queries(full, corpus[0], name)
        s_full, r_full = full.views[name].search(xq, 10)
        s_comp, r_comp = comp.views[name].search(xq, 10)
        want = _exact_top(comp, name, xq, 10)
        assert all(set(a) == set(b) for a, b in zip(want.tolist(), r_comp.tolist(), strict=True))
        assert _same_top(full, name, xq, r_full, s_full, r_comp), name
        assert np.allclose(s_comp, s_full, rtol=1e-2, atol=1e-3 * np.abs(s_full).max()), name
        for q in range(len(xq)):
            want = _float16_scores(comp, comp.views[name].target, xq[q : q + 1], r_comp[q])[0]
            assert np.allclose(s_comp[q], want, rtol=1e-5, atol=1e-6), name


def test_a_compact_version_is_under_half_the_bytes(corpus) -> None:
    full = _built(corpus, "full")
    comp = _built(corpus, "compact", "--compact", "--spec", "sq8:rerank=30")

    def vectors(v: LoadedVersion) -> int:
        files = v.manifest["files"]
        seen = {}  # a hard link counts once
        for rel in files:
            if rel.startswith(("embeddings/", "views/")) and not rel.endswith(".rows.npy"):
                st = (v.path / rel).stat()
                seen[st.st_ino] = st.st_size
        return sum(seen.values())

    # d = 8 here: FAISS's headers weigh; at d = 128 the ratio is 0.375 (docs/guide.md)
    assert vectors(comp) < 0.5 * vectors(full)


@pytest.mark.parametrize("selective", [True, False])
def test_filters_on_compact_views(corpus, monkeypatch, selective: bool) -> None:
    full = _built(corpus, "full")
    comp = _built(corpus, "compact", "--compact", "--spec", "sq8:rerank=30")
    if not selective:  # through FAISS's selector on the codes, not the exact path for few rows
        monkeypatch.setattr(view_module, "EXACT_FILTERED_ROWS", 0)
        monkeypatch.setattr(view_module, "SUBSET_FRACTION", 0.0)
    flt = {"year": {"gte": 2003, "lt": 2005}}
    for name in full.views:
        xq = _queries(full, corpus[0], name)
        s_full, r_full = full.views[name].search(xq, 10, full.mask_of(full.views[name], flt))
        s_comp, r_comp = comp.views[name].search(xq, 10, comp.mask_of(comp.views[name], flt))
        years = {comp.records[int(r)]["payload"]["year"] for r in r_comp.ravel()}
        assert years <= {2003, 2004}, name
        assert _same_top(full, name, xq, r_full, s_full, r_comp), name
        assert np.allclose(s_comp, s_full, rtol=1e-2, atol=1e-3 * np.abs(s_full).max())


def test_rerank_factor_sets_the_candidates_and_scores_stay_exact(corpus, monkeypatch) -> None:
    from indexer.search import flat_codes

    comp = _built(corpus, "compact", "--compact", "--spec", "sq8:rerank=30")
    view = comp.views["a"]
    xq = _queries(comp, corpus[0], "a")
    calls: list[int] = []
    search, batch_search = view.index.search, flat_codes.batch_search

    def counting(x, k, params=None):
        calls.append(k)
        return search(x, k, params=params)

    def counting_batch(index, x, k):
        calls.append(k)
        return batch_search(index, x, k)

    view.index.search = counting
    monkeypatch.setattr(flat_codes, "batch_search", counting_batch)
    try:
        ann.use_rerank_factor(2)
        scores, rows = view.search(xq, 5)
    finally:
        ann.use_rerank_factor(0)
        del view.index.search
    assert calls == [10]
    for q in range(len(xq)):
        want = _float16_scores(comp, view.target, xq[q : q + 1], rows[q])[0]
        assert np.allclose(scores[q], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rerank factor"):
        ann.use_rerank_factor(-1)


def test_a_depth_of_one_still_rescores_every_result(corpus) -> None:
    """rerank=1 fetches k candidates and re-scores them all: the codes' own approximate
    scores never come back (the tuner's depth choice may pick 1)."""
    comp = _built(corpus, "compact-depth-1", "--compact", "--spec", "sq8:rerank=1")
    view = comp.views["a"]
    xq = _queries(comp, corpus[0], "a")
    scores, rows = view.search(xq, 10)
    for q in range(len(xq)):
        want = _float16_scores(comp, view.target, xq[q : q + 1], rows[q])[0]
        assert np.allclose(scores[q], want, rtol=1e-5, atol=1e-6)
        assert np.all(np.diff(scores[q]) <= 0)  # ordered by the exact scores


def test_update_and_rollback_across_full_and_compact(corpus, tmp_path: Path) -> None:
    model, records, _ = corpus
    root = tmp_path / "root"
    assert index_build(model, records, root) == 0
    first = artifact.read_current(root)
    upsert = write_jsonl(
        tmp_path / "u.jsonl",
        [dict(r, id=f"new-{i}") for i, r in enumerate(vector_records(5, DIMS, seed=9, k=5))],
    )
    (tmp_path / "gone.txt").write_text("r-00001\n")

    def update(*extra: object) -> str:
        argv = ["index", "update", "--root", root, "--upsert", upsert, "--quiet", *extra]
        assert run_cli(*argv) == 0
        return str(artifact.read_current(root))

    to_compact = update("--compact")
    v = LoadedVersion(artifact.version_dir(root, to_compact))
    assert v.manifest["compact"]["codes"] == "sq8:rerank=10" and len(v.records) == N + 5
    assert verify(v.path) == []
    stays = update("--delete", tmp_path / "gone.txt")  # no flag: it stays compact
    v2 = LoadedVersion(artifact.version_dir(root, stays))
    assert v2.manifest["compact"] and len(v2.records) == N + 4
    assert all(e.dtype == np.float16 for e in v2.stored.embeddings.values())
    back = update("--no-compact")
    v3 = LoadedVersion(artifact.version_dir(root, back))
    assert "compact" not in v3.manifest and verify(v3.path) == []
    assert all(e.dtype == np.float32 for e in v3.stored.embeddings.values())
    assert {v["spec"]["kind"] for v in v3.manifest["views"].values()} == {"flat"}
    # the float16 values went back to float32 exactly
    for rid in ("r-00000", "r-00150", "r-00299"):  # kept, not upserted again
        a, b = v2.records.row_of(rid), v3.records.row_of(rid)
        assert a is not None and b is not None
        for n in v3.names:
            assert np.array_equal(v3.stored.embeddings[n][b], v2.stored.embeddings[n][a])
    assert [r["compact"] for r in artifact.list_versions(root)] == [False, True, True, False]
    assert run_cli("index", "rollback", "--root", root) == 0
    assert artifact.read_current(root) == stays
    rolled = LoadedVersion(artifact.current_version_dir(root))
    xq = _queries(rolled, model, "a")
    scores, rows = rolled.views["a"].search(xq, 10)
    assert (rows >= 0).all() and np.isfinite(scores).all()
    assert run_cli("index", "rollback", "--root", root, "--to", first) == 0
    assert run_cli("index", "gc", "--root", root, "--keep", "2") == 0
    kept = {r["version"] for r in artifact.list_versions(root)}
    assert kept == {first, stays, back}  # the 2 published last and the published one
    assert run_cli("index", "verify", "--root", root) == 0


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last code of the last row
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("rel", ["views/a.faiss", "embeddings/b.faiss"])
def test_verify_catches_a_flipped_byte_in_codes(corpus, tmp_path: Path, capsys, rel) -> None:
    model, records, _ = corpus
    root = tmp_path / "root"
    assert index_build(model, records, root, "--compact") == 0
    vdir = artifact.current_version_dir(root)
    assert run_cli("index", "verify", "--root", root) == 0
    _flip_last_byte(vdir / rel)
    capsys.readouterr()
    assert run_cli("index", "verify", "--root", root) == 1
    assert f"{rel}: checksum mismatch" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "stores"),
    [("ivfsq:nlist=4,nprobe=4,rerank=30", "codes:IVF-SQ8"),
     ("ivfpq:nlist=4,m=3,nbits=4,nprobe=4,rerank=30", "codes:IVF-PQ")],
)  # fmt: skip
def test_inverted_file_codes_as_compact_product_views(corpus, spec: str, stores: str) -> None:
    full = _built(corpus, "full")
    comp = _built(corpus, f"compact-{stores[6:]}", "--compact", "--spec", spec)
    assert comp.manifest["compact"]["codes"] == spec
    for name in full.views:
        entry = comp.manifest["views"][name]
        assert entry["stores"] == (stores if len(entry["target"]) > 1 else "float16")
        xq = _queries(full, corpus[0], name)
        s_full, r_full = full.views[name].search(xq, 10)
        s_comp, r_comp = comp.views[name].search(xq, 10)
        assert _same_top(full, name, xq, r_full, s_full, r_comp), name  # every list probed
        assert np.allclose(s_comp, s_full, rtol=1e-2, atol=1e-3 * np.abs(s_full).max())
    assert verify(comp.path) == []


def test_auto_picks_each_views_smallest_rerank_depth_for_the_target(corpus, tmp_path) -> None:
    from indexer.tune.rerank_depth import DEPTHS

    model, records, _ = corpus
    root = tmp_path / "root"
    assert index_build(model, records, root, "--compact", "--spec", "auto:recall=0.999") == 0
    v = LoadedVersion(artifact.current_version_dir(root))
    assert v.manifest["compact"] == {"embeddings": "float16", "codes": "auto:recall=0.999",
                                     "rerank": None}  # fmt: skip
    for name, entry in v.manifest["views"].items():
        if entry["stores"] == "float16":
            continue
        spec, tuning = entry["spec"], entry["tuning"]
        assert spec["kind"] == "sq8" and spec["target_recall"] == 0.999
        depth = spec["rerank"]
        tried = {int(d): r for d, r in tuning["tried"].items()}
        se = {int(d): e for d, e in tuning["tried_se"].items()}
        assert list(tried) == [d for d in DEPTHS if d <= depth]
        # the first depth whose recall clears the target by one standard error
        assert tried[depth] - se[depth] >= 0.999 - 1e-4
        assert all(r - se[d] < 0.999 for d, r in tried.items() if d < depth)
        assert entry["recall_at_10"] == tuning["check"]["recall"]
        full_scan = _exact_top(v, name, _queries(v, model, name), 10)
        _, found = v.views[name].search(_queries(v, model, name), 10)
        assert np.mean([len(set(a) & set(b)) for a, b in zip(full_scan, found, strict=True)]) >= 9
    # an update measures again for the same target
    (tmp_path / "none.txt").write_text("nobody\n")
    assert run_cli("index", "update", "--root", root, "--delete", tmp_path / "none.txt",
                   "--views", "a,b+c", "--quiet") == 0  # fmt: skip
    again = artifact.read_manifest(artifact.current_version_dir(root))
    assert again["views"]["a"]["spec"]["target_recall"] == 0.999 and "tuning" in again["views"]["a"]


def test_auto_keeps_the_tuners_inverted_file_of_codes_and_no_float32(tmp_path, monkeypatch) -> None:
    """`--compact --spec auto`: the tuner measures inverted files of codes (IVF-SQ8, IVF-PQ) as
    for a full version; its pick is stored as codes only, re-ranked from the float16
    embeddings, at the target on queries the tuner did not see. Where none is fast enough, the
    view is sq8 at its measured depth, and its tuning says why no inverted file was kept."""
    from dataclasses import replace

    from indexer.build import compact

    write_jsonl(tmp_path / "r.jsonl", vector_records(3000, DIMS, seed=4, k=400))
    model = make_model_dir(tmp_path / "m")
    # min_speedup 0: the fastest codes that meet the target, even where flat search is faster
    # at this size, so that an inverted file is what gets tested
    monkeypatch.setattr(compact, "TUNING", replace(compact.TUNING, min_speedup=0.0, timing_s=0.02))
    root = tmp_path / "ivf"
    spec = ("--compact", "--spec", "auto:recall=0.9,batch=8", "--views", "a,b+c")
    assert index_build(model, tmp_path / "r.jsonl", root, *spec) == 0
    v = LoadedVersion(artifact.current_version_dir(root))
    entry = v.manifest["views"]["a"]
    assert entry["spec"]["kind"] in ("ivfsq", "ivfpq") and entry["spec"]["target_recall"] == 0.9
    assert (
        entry["stores"]
        == {"ivfsq": "codes:IVF-SQ8", "ivfpq": "codes:IVF-PQ"}[entry["spec"]["kind"]]
    )
    assert {p["family"] for p in entry["tuning"]["frontier"]} <= {"flat", "ivfsq", "ivfpq"}
    assert entry["tuning"]["served_batch"] == 8
    assert not list((v.path / "views").glob("*.npy")) or all(
        f.name.endswith(".rows.npy") for f in (v.path / "views").glob("*.npy")
    )  # no float32 vectors
    queries = np.concatenate(
        list(factor_chunks(v.head, v.stored, np.arange(2000, 2100), ["a"], "query"))
    )
    truth = _exact_top(v, "a", queries, 10)
    _, found = v.views["a"].search(queries, 10)
    assert np.mean([len(set(a) & set(b)) for a, b in zip(truth, found, strict=True)]) >= 9.0
    # the view over a's embeddings: PQ codes of its own, re-ranked from the float16 embeddings
    entry = v.manifest["views"]["b+c"]
    assert entry["spec"]["kind"] == "ivfpq" and entry["stores"] == "codes:IVF-PQ"
    assert {p["family"] for p in entry["tuning"]["frontier"]} <= {"flat", "ivfpq"}
    assert not (v.path / "views" / "b+c.faiss").samefile(v.path / "embeddings" / "a.faiss")
    queries = np.concatenate(
        list(factor_chunks(v.head, v.stored, np.arange(2000, 2100), ["b", "c"], "query"))
    )
    truth = _exact_top(v, "b+c", queries, 10)
    scores, found = v.views["b+c"].search(queries, 10)
    assert np.mean([len(set(a) & set(b)) for a, b in zip(truth, found, strict=True)]) >= 9.0
    a = np.asarray(v.stored.embeddings["a"][found[:, 0]], np.float32)
    assert np.allclose(scores[:, 0], np.einsum("qd,qd->q", queries, a), rtol=1e-5, atol=1e-6)
    assert verify(v.path) == []

    # nothing fast enough: sq8 at the depth measured for the target
    monkeypatch.setattr(compact, "TUNING", replace(compact.TUNING, min_speedup=1e6))
    (tmp_path / "none.txt").write_text("nobody\n")
    # deleting nobody publishes nothing; naming the views makes a new version
    assert run_cli("index", "update", "--root", root, "--delete", tmp_path / "none.txt",
                   "--views", "a,b+c", "--quiet") == 0  # fmt: skip
    again = LoadedVersion(artifact.current_version_dir(root))
    entry = again.manifest["views"]["a"]
    assert entry["spec"]["kind"] == "sq8" and entry["spec"]["target_recall"] == 0.9
    assert entry["stores"] == "codes:SQ8" and "why" in entry["tuning"]["inverted_files"]
    entry = again.manifest["views"]["b+c"]  # the exact float16 scan of a's embeddings
    assert entry["spec"]["kind"] == "fp16" and entry["stores"] == "float16"
    assert "why" in entry["tuning"]["inverted_files"]
    assert (again.path / "views" / "b+c.faiss").samefile(again.path / "embeddings" / "a.faiss")
    assert verify(again.path) == []


def test_sum_of_pairs_compact_views_are_all_codes(tmp_path: Path) -> None:
    """A head whose one-modality factor is not the embedding keeps no float view at all."""
    write_jsonl(tmp_path / "r.jsonl", vector_records(200, DIMS, seed=1, k=200))
    model = make_model_dir(tmp_path / "m", head="sum_of_pairs")
    for root, extra in (("full", ()), ("comp", ("--compact", "--spec", "sq8:rerank=20"))):
        assert index_build(model, tmp_path / "r.jsonl", tmp_path / root, *extra) == 0
    full = LoadedVersion(artifact.current_version_dir(tmp_path / "full"))
    comp = LoadedVersion(artifact.current_version_dir(tmp_path / "comp"))
    assert {v["stores"] for v in comp.manifest["views"].values()} == {"codes:SQ8"}
    for name in full.views:
        xq = _queries(full, model, name)
        s_full, r_full = full.views[name].search(xq, 10)
        s_comp, r_comp = comp.views[name].search(xq, 10)
        assert _same_top(full, name, xq, r_full, s_full, r_comp), name
        assert np.allclose(s_comp, s_full, rtol=1e-2, atol=1e-3 * np.abs(s_full).max())
    assert verify(comp.path) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--compact", "--spec", "hnsw"), "--compact: --spec hnsw is not supported"),
        (("--compact", "--spec", "ivf"), "--compact: --spec ivf is not supported"),
        (("--compact", "--spec", "sq8:rerank=0"), "--compact: --spec sq8:rerank=0 must re-rank"),
        (("--compact", "--backend", "milvus"), "--compact: not supported with --backend milvus"),
        (("--spec", "fp16"), "--spec: unknown index kind 'fp16'"),
    ],
)
def test_bad_compact_options_are_one_line_and_write_nothing(
    corpus, tmp_path: Path, capsys, extra, message
) -> None:
    model, records, _ = corpus
    root = tmp_path / "root"
    assert index_build(model, records, root, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (root / "versions").exists() and not list((root / ".staging").glob("*"))


def test_tune_refuses_a_compact_version(corpus, tmp_path: Path, capsys) -> None:
    model, records, _ = corpus
    root = tmp_path / "root"
    assert index_build(model, records, root, "--compact") == 0
    before = artifact.read_current(root)
    capsys.readouterr()
    assert run_cli("index", "tune", "--root", root) == 2
    err = capsys.readouterr().err.strip()
    assert "is compact" in err and len(err.splitlines()) == 1
    assert artifact.read_current(root) == before


def test_every_compact_view_says_what_it_stores_and_its_recall(corpus) -> None:
    comp = _built(corpus, "compact", "--compact", "--spec", "sq8:rerank=30")
    manifest = json.loads((comp.path / "manifest.json").read_text())
    for entry in manifest["views"].values():
        assert entry["stores"] in ("float16", "codes:SQ8")
        assert entry["recall_at_10"] >= 0.95


def test_each_float16_file_is_mapped_once_per_version(corpus) -> None:
    """The embeddings numpy reads and the float16 views FAISS scans (hard links to them) are one
    mapping of each file: a second would count the same pages twice in the worker's RSS."""
    import gc
    import os

    comp = _built(corpus, "compact", "--compact", "--spec", "sq8:rerank=30")
    gc.collect()
    fresh = LoadedVersion(comp.path)
    embeddings = sorted((comp.path / "embeddings").glob("*.faiss"))
    inodes = {os.stat(p).st_ino for p in embeddings}
    linked = [p for p in (comp.path / "views").glob("*.faiss") if os.stat(p).st_ino in inodes]
    assert linked  # the all-but-one views are those files
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    mine = [m for m in maps if len(m) >= 6 and str(comp.path) in m[5]]
    for inode in inodes:
        assert sum(int(m[4]) == inode for m in mine) == 2, inode  # comp's and fresh's: one each
    xq = _queries(fresh, corpus[0], "b+c")
    _, rows = fresh.views["b+c"].search(xq, 10)
    assert (rows >= 0).all() and fresh.stored.embeddings["a"].dtype == np.float16


def test_a_batch_over_flat_codes_is_faiss_scan_of_each_query(corpus, monkeypatch) -> None:
    """A batch over float16 rows or 8-bit codes reads them a block at a time for all its
    queries (indexer.search.flat_codes); it finds what FAISS's scan finds query by query, with
    the same scores, block edges included; the views then answer the same."""
    from indexer.search import exact, flat_codes

    comp = _built(corpus, "comp", "--compact")
    model, _, _ = corpus
    kinds = {name: v.spec.kind for name, v in comp.views.items()}
    assert set(kinds.values()) == {"fp16", "sq8"}, kinds
    for name, view in comp.views.items():
        monkeypatch.setattr(flat_codes, "WIDEN_BYTES", 4 * view.dim * 37)  # blocks of 37 rows
        xq = _queries(comp, model, name, n=20)
        assert len(xq) >= exact.blas_from()
        batched = flat_codes.batch_search(view.index, xq, 50)
        assert batched is not None
        s_scan, p_scan = view.index.search(xq, 50)
        assert np.allclose(batched[0], s_scan, rtol=1e-5, atol=1e-5 * np.abs(s_scan).max())
        overlap = np.mean([len(set(a) & set(b)) for a, b in zip(batched[1], p_scan, strict=True)])
        assert overlap >= 49.5, (name, overlap)  # but where two codes score the same
        s_batch, r_batch = view.search(xq, 10)
        for q in range(len(xq)):
            s_one, r_one = view.search(xq[q : q + 1], 10)  # FAISS's scan
            assert np.allclose(s_one[0], s_batch[q], rtol=1e-5, atol=1e-6)
            assert len(set(r_one[0].tolist()) & set(r_batch[q].tolist())) >= 9, (name, q)
        truth = _exact_top(comp, name, xq, 10)
        pairs = zip(truth.tolist(), r_batch.tolist(), strict=True)
        hits = np.mean([len(set(t) & set(r)) for t, r in pairs])
        assert hits >= 9.9, (name, hits)


def test_a_compact_versions_rows_files_are_int32(corpus) -> None:
    comp = _built(corpus, "comp", "--compact")
    for name, view in comp.views.items():
        rows = np.load(comp.path / "views" / f"{name}.rows.npy")
        assert rows.dtype == np.int32 and np.array_equal(rows, np.asarray(view.rows)), name
    assert verify(comp.path) == []
