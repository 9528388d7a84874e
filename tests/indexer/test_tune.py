"""The tuner (`--spec auto`, `hclip index tune`): it meets its recall target on queries it did
not tune on, or falls back to flat search and says why; every approximate family returns exact
scores; a tuned version verifies, and its rebuilds tune again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from indexer.search.specs import IndexSpec, SpecError
from indexer.store import artifact
from indexer.store.verify import verify
from indexer.store.version import LoadedVersion
from indexer.tune import tuner as tune
from models.checkpoint import load_model
from tests.conftest import DIMS, index_build, make_model_dir, run_cli, vector_records, write_jsonl


def hadamard_workload(n: int, d: int, n_queries: int, seed: int) -> tuple[tune.Workload, ...]:
    """Products of two unit vectors per record (not unit length), queries omega * a unit
    vector: the shape of H-CLIP's stored and query vectors. Returns the tuner's workload and a
    third, fresh set of queries the tuner never sees."""
    rng = np.random.default_rng(seed)

    def unit(m: int) -> np.ndarray:
        x = rng.standard_normal((m, d)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    vectors = unit(n) * unit(n)
    omega = (rng.random(d) + 0.5).astype(np.float32)
    queries = omega * unit(3 * n_queries)
    tune_q, check_q = tune.split_queries({"records": queries[: 2 * n_queries]})
    work = tune.Workload(vectors, tune_q, check_q, lambda pos: vectors[pos])
    return work, queries[2 * n_queries :]


FAST = 0.02  # seconds per timing: the speeds these tests see only need to be in order


def exact_top(xq: np.ndarray, vectors: np.ndarray, k: int = 10) -> np.ndarray:
    return np.argsort(-(xq @ vectors.T), axis=1, kind="stable")[:, :k]


def test_auto_spec_parses_and_keeps_its_target() -> None:
    assert IndexSpec.parse("auto").target_recall == 0.95
    spec = IndexSpec.parse("auto:recall=0.9")
    assert spec.kind == "auto" and spec.tuned and spec.target_recall == 0.9
    picked = IndexSpec.parse("ivf:nlist=64,nprobe=8").with_target(0.9)
    assert IndexSpec.from_dict(picked.to_dict()) == picked and picked.effort == 8
    assert IndexSpec.parse("ivfpq").params["rerank"] == 10
    assert IndexSpec.parse("ivfsq:nprobe=3").effort == 3
    for bad, msg in [
        ("auto:recall=1.0", r"in \[0.5, 1\)"),
        ("auto:recall=x", "must be a number"),
        ("auto:nprobe=3", "auto takes recall=R"),
        ("ivfpq:nbits=6", "4 \\(fast scan\\) or 8"),
    ]:
        with pytest.raises(SpecError, match=msg):
            IndexSpec.parse(bad)


def test_tuner_meets_its_target_on_queries_it_did_not_tune_on() -> None:
    work, fresh = hadamard_workload(n=6000, d=16, n_queries=300, seed=0)
    # min_speedup 0: pick the fastest index that meets the target even where flat search is
    # faster (at this size it may be), so that an approximate pick is what gets tested.
    result = tune.tune(work, 0.9, tune.TuneOptions(min_speedup=0.0, timing_s=FAST))
    assert not result.spec.exact and result.index is not None, result.report
    assert result.spec.target_recall == 0.9
    report = result.report
    assert report["check"]["recall_at_10"] == round(result.recall, 4) and result.recall >= 0.9
    assert report["tune_queries"] == report["check"]["queries"] == 300
    assert {p["family"] for p in report["frontier"]} == set(tune.FAMILIES)
    assert any(p["pareto"] for p in report["frontier"])
    # Independently of the tuner's own measurement: fresh queries, numpy's exact ranking, the
    # picked index searched as the server searches it.
    from indexer.search import ann

    _, got = ann.search(
        result.index,
        result.spec,
        fresh,
        10,
        result.max_norm,
        result.width,
        exact_vectors=work.exact_vectors,
    )
    truth = exact_top(fresh, work.vectors)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, truth, strict=True)])
    # 300 fresh queries: a standard error of about 0.005 around the tuner's estimate
    assert recall >= 0.9 - 0.02, (recall, result.spec)


def test_past_its_time_budget_the_tuner_tries_no_more_structures() -> None:
    work, _ = hadamard_workload(n=6000, d=16, n_queries=200, seed=1)
    opts = tune.TuneOptions(min_speedup=0.0, timing_s=FAST, budget_s=0.0)
    result = tune.tune(work, 0.9, opts)
    structures = result.report["structures"]
    skipped = [n for n, why in structures.items() if why.startswith("not tried")]
    tried = [n for n, why in structures.items() if not why.startswith("not tried")]
    # The first structure that meets the target ends the search once the budget is spent.
    assert tried and skipped and any("hnsw" in n for n in skipped), structures
    assert not result.spec.exact and result.recall >= 0.9
    assert {p["structure"] for p in result.report["frontier"]} <= set(tried)


def test_tuner_falls_back_to_flat_and_says_why() -> None:
    work, _ = hadamard_workload(n=3000, d=16, n_queries=100, seed=1)
    # No index is a million times faster than flat search.
    opts = tune.TuneOptions(families=("ivf",), min_speedup=1e6, timing_s=FAST)
    result = tune.tune(work, 0.95, opts)
    assert result.spec == IndexSpec("flat", {}, 0.95) and result.index is None
    assert result.recall == 1.0 and result.report["met"] is True
    # Either IVF never reached the target before it ran slower than flat search, or it did
    # and was not a million times faster: the report says which, structure by structure.
    notes = result.report["structures"]
    assert set(notes) == {"ivf:nlist=64"}
    if "meets 0.95" in notes["ivf:nlist=64"]:
        assert "served 1000000.0x flat search's queries/s" in result.report["why"]
    else:
        assert "slower than flat search" in notes["ivf:nlist=64"]
        assert result.report["why"] == "no approximate index reached the target"
    # A view this small is not worth measuring.
    few, _ = hadamard_workload(n=200, d=16, n_queries=100, seed=2)
    small = tune.tune(few, 0.95)
    assert small.spec.exact and "flat search is exact and fast" in small.report["why"]


@pytest.mark.parametrize(
    "spec",
    [
        "hnsw:M=16,ef_search=16",
        "ivf:nlist=16,nprobe=2",
        "ivfip:nlist=16,nprobe=2",
        "ivfpq:nlist=16,m=3,nbits=8,nprobe=2,rerank=4",
        "ivfpq:nlist=16,m=9,nbits=4,nprobe=2,rerank=4",
        "ivfsq:nlist=16,nprobe=2,rerank=2",
    ],
)
def test_approximate_scores_are_exact_inner_products(tmp_path: Path, spec: str) -> None:
    rows = vector_records(2000, DIMS, seed=3, k=300)
    write_jsonl(tmp_path / "r.jsonl", rows)
    model_dir = make_model_dir(tmp_path / "m")
    root = tmp_path / "root"
    assert index_build(model_dir, tmp_path / "r.jsonl", root, "--spec", spec) == 0
    version = LoadedVersion(artifact.current_version_dir(root))
    assert verify(version.path) == []
    xq = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32)
    for name, view in version.views.items():
        assert view.spec.kind == spec.split(":")[0]
        everything = view.exact_vectors(np.arange(view.count))  # (count, 8), recomputed
        pos_of = {int(r): i for i, r in enumerate(view.rows)}
        for effort in (None, 1, 16):
            scores, got = view.search(xq, 10, effort=effort)
            assert (got >= 0).all(), (name, effort)
            true = np.array(
                [[xq[i] @ everything[pos_of[r]] for r in row] for i, row in enumerate(got)]
            )
            assert np.allclose(scores, true, atol=1e-5), (name, effort)
            assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
        # at full effort an inverted file of exact vectors probes every list: exact results
        if view.spec.kind in ("ivf", "ivfip"):
            _, got = view.search(xq, 10, effort=16)
            truth = exact_top(xq, everything)
            want = np.asarray(view.rows)[truth]
            assert np.mean([len(set(a) & set(b)) for a, b in zip(got, want, strict=True)]) > 9.5


def test_build_with_an_auto_spec_keeps_the_target_and_verifies(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "r.jsonl", vector_records(300, DIMS, seed=9))
    model_dir = make_model_dir(tmp_path / "m")
    root = tmp_path / "root"
    assert index_build(model_dir, tmp_path / "r.jsonl", root, "--spec", "auto:recall=0.9") == 0
    vdir = artifact.current_version_dir(root)
    m = json.loads((vdir / "manifest.json").read_text())
    for name, entry in m["views"].items():
        # 300 records: below the tuner's floor, every view stays flat and says why
        assert entry["spec"] == {"kind": "flat", "target_recall": 0.9}, name
        assert entry["recall_at_10"] == 1.0 and "exact and fast" in entry["tuning"]["why"]
    assert verify(vdir) == []
    assert LoadedVersion(vdir).views["a"].spec == IndexSpec("flat", {}, 0.9)


def tune_command(*argv: object) -> int:
    """`hclip index tune ...`, parsed by the `hclip` command line itself."""
    return run_cli("index", "tune", *argv)


@pytest.mark.slow
def test_tune_publishes_a_verified_version_with_tuned_views(tmp_path: Path) -> None:
    rows = vector_records(5000, DIMS, seed=5, k=800)
    write_jsonl(tmp_path / "r.jsonl", rows)
    model_dir = make_model_dir(tmp_path / "m")
    root = tmp_path / "root"
    assert index_build(model_dir, tmp_path / "r.jsonl", root, "--views", "a,b+c") == 0
    first = artifact.read_current(root)
    # held-out queries as a request log: raw inputs for b, and c given as embeddings
    model = load_model(model_dir)
    log_rows = vector_records(60, DIMS, seed=6, k=800)
    with torch.no_grad():
        c_emb = model.encode("c", [torch.tensor(r["c"]) for r in log_rows]).numpy()
    lines = [
        {"query": {"b": r["b"]}, "embeddings": {"c": e.tolist()}}
        for r, e in zip(log_rows, c_emb, strict=True)
    ]
    lines.append({"query": {"a": log_rows[0]["a"]}})  # a view not tuned: ignored
    write_jsonl(tmp_path / "log.jsonl", lines)
    args = ["--root", root, "--view", "b+c", "--recall", "0.9", "--min-speedup", "0"]
    args += ["--families", "ivf,ivfsq", "--timing-seconds", FAST]
    assert tune_command(*args, "--queries", tmp_path / "log.jsonl", "--plot", tmp_path / "p") == 0
    second = artifact.read_current(root)
    assert second != first
    vdir = artifact.version_dir(root, second)
    m = json.loads((vdir / "manifest.json").read_text())
    assert m["parent"] == first and m["tune"]["views"] == ["b+c"]
    assert m["views"]["a"]["spec"] == {"kind": "flat"} and "tuning" not in m["views"]["a"]
    tuned = m["views"]["b+c"]
    spec = IndexSpec.from_dict(tuned["spec"])
    assert spec.target_recall == 0.9 and not spec.exact  # min-speedup 0: an index is picked
    assert tuned["tuning"]["query_sources"] == {"records": 2000, "held_out": 60}
    assert tuned["recall_at_10"] == tuned["tuning"]["check"]["recall_at_10"] >= 0.9
    assert (vdir / "views" / "b+c.faiss").is_file() and not (vdir / "views" / "b+c.npy").exists()
    assert verify(vdir) == [] and verify(artifact.version_dir(root, first)) == []
    assert (tmp_path / "p" / "b+c.png").stat().st_size > 10_000
    # the stored embeddings are the old version's, not re-encoded
    old = artifact.version_dir(root, first)
    for f in ("embeddings/a.npy", "embeddings/b.npy", "records/ids.bin"):
        assert (vdir / f).read_bytes() == (old / f).read_bytes()

    # An update rebuilds the views: a tuned one tunes again, for its target. (Deleting most
    # records keeps that quick: the tuner says at once that flat search suits 530 records.)
    write_jsonl(tmp_path / "up.jsonl", vector_records(30, DIMS, seed=7, k=800))
    (tmp_path / "gone.txt").write_text("".join(f"r-{i:05d}\n" for i in range(4500)))
    up = ["index", "update", "--root", root, "--upsert", tmp_path / "up.jsonl", "--quiet"]
    assert run_cli(*up, "--delete", tmp_path / "gone.txt") == 0
    m3 = json.loads((artifact.current_version_dir(root) / "manifest.json").read_text())
    assert m3["parent"] == second and m3["counts"]["records"] == 530
    assert m3["views"]["b+c"]["spec"] == {"kind": "flat", "target_recall": 0.9}
    assert "exact and fast" in m3["views"]["b+c"]["tuning"]["why"]


def test_tune_refuses_unknown_views_and_families(tmp_path: Path, capsys) -> None:
    write_jsonl(tmp_path / "r.jsonl", vector_records(50, DIMS))
    model_dir = make_model_dir(tmp_path / "m")
    root = tmp_path / "root"
    assert index_build(model_dir, tmp_path / "r.jsonl", root) == 0
    capsys.readouterr()
    for argv, message in [
        (("--view", "x"), "no view 'x'"),
        (("--families", "ivf,annoy"), "unknown family 'annoy'"),
        (("--recall", "1.5"), "recall must be in"),
    ]:
        assert tune_command("--root", root, *argv) == 2
        assert message in capsys.readouterr().err
    assert len(artifact.list_versions(root)) == 1
