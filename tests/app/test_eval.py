"""`hclip eval`: exact, through a root's flat and approximate views, and against `/v1/search`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.app.conftest import build_index, running, settings_for
from tests.conftest import DIMS, run_cli, vector_records, write_jsonl

FIGURES = ("hit@1", "recall@10", "mrr", "median_rank", "chance@1", "chance@10", "n")


def latent_records(n: int) -> list[dict]:
    """Each modality a fixed linear map of one latent per record (its own), plus noise."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((n, 4))
    maps = {m: rng.standard_normal((4, d)) for m, d in DIMS.items()}
    rows: list[dict] = [{"id": f"r-{i:03d}", "payload": {}} for i in range(n)]
    for m, w in maps.items():
        x = z @ w + 0.05 * rng.standard_normal((n, w.shape[1]))
        for row, v in zip(rows, np.round(x, 5).tolist(), strict=True):
            row[m] = v
    return rows


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> tuple[Path, Path, Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("eval")
    rows = latent_records(200)
    records = write_jsonl(tmp / "records.jsonl", rows)
    config = {
        "modalities": {m: {"kind": "vector", "dim": d, "hidden": 16} for m, d in DIMS.items()},
        "latent_dim": 8,
        "train": {"records": "records.jsonl", "epochs": 8, "batch_size": 50, "lr": 0.01},
    }
    write_jsonl(tmp / "config.json", [config])
    model = tmp / "model"
    assert run_cli("train", "--config", tmp / "config.json", "--out", model, "--quiet") == 0
    build_index(tmp / "root", model, rows, tmp)
    return tmp, model, records, rows


def _eval(capsys, *argv: object) -> dict:
    capsys.readouterr()
    assert run_cli("eval", *argv, "--json", "--quiet") == 0
    return json.loads(capsys.readouterr().out)


def test_flat_root_gives_the_exact_figures_and_the_service_agrees(indexed, capsys) -> None:
    tmp, model, records, rows = indexed
    exact = _eval(capsys, "--model", model, "--records", records)
    served = _eval(capsys, "--model", model, "--records", records, "--root", tmp / "root")
    assert exact["views"].keys() == served["views"].keys() == {"a", "b", "c", "a+b", "a+c", "b+c"}
    for view, f in exact["views"].items():
        # Scores computed apart (here, and by the build) may swap two records that all but tie
        # deep in a ranking: MRR may move in its fifth digit, never the top of a ranking.
        assert {m: served["views"][view][m] for m in FIGURES} == pytest.approx(
            {m: f[m] for m in FIGURES}, rel=1e-4
        )
        assert served["views"][view]["hit@1"] == f["hit@1"]
        assert served["views"][view]["index"] == "flat" and "difference" not in f
    assert 0.05 < exact["views"]["a+b"]["hit@1"] < 1.0  # neither chance nor trivial
    # hit@1 is what the service's top result says, query by query, over HTTP.
    with running(settings_for(tmp / "root")) as client:
        for view in ("a+b", "c"):
            query = view.split("+")
            top = [
                client.post("/v1/search", json={"query": {m: r[m] for m in query}, "k": 1}).json()[
                    "results"
                ][0]["id"]
                for r in rows
            ]
            hits = sum(t == r["id"] for t, r in zip(top, rows, strict=True)) / len(rows)
            assert hits == served["views"][view]["hit@1"]


def test_an_approximate_view_reports_its_cost(indexed, capsys, tmp_path: Path) -> None:
    _, model, records, rows = indexed
    build_index(tmp_path / "root", model, rows, tmp_path, "--spec", "ivf:nlist=16,nprobe=1")
    report = _eval(
        capsys, "--model", model, "--records", records, "--root", tmp_path / "root", "--views", "c"
    )
    f = report["views"]["c"]
    assert f["index"].startswith("ivf")
    for m in ("hit@1", "recall@10", "mrr"):
        assert f["difference"][m] == pytest.approx(f[m] - f["exact"][m])
    assert f["recall@10"] < f["exact"]["recall@10"]  # one list of 16 misses records
    capsys.readouterr()
    run_cli("eval", "--model", model, "--records", records, "--root", tmp_path / "root")
    assert "index - exact" in capsys.readouterr().out


def test_errors_are_one_line(indexed, capsys, tmp_path: Path) -> None:
    tmp, model, records, rows = indexed
    other = write_jsonl(tmp_path / "other.jsonl", vector_records(3, {"a": 6, "b": 5, "x": 4}))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    stranger = write_jsonl(tmp_path / "stranger.jsonl", [{**rows[0], "id": "nobody"}])
    cases = [
        (  # a file for another model: its mistake said once, its other fields left out
            ["--records", other],
            "other.jsonl: lines 1, 2, 3: modality 'c' is missing (the model needs all of a, b, c)",
        ),
        (["--records", empty], "empty.jsonl: no records"),
        (["--records", records, "--views", "a,a+z"], "--views: view 'a+z': unknown modality 'z'"),
        (["--records", records, "--views", "a+b+c"], "--views: view 'a+b+c': a query cannot"),
        (["--records", stranger, "--root", tmp / "root"], "stranger.jsonl, line 1, id 'nobody'"),
        (["--records", records, "--k", "0"], "--k: must be >= 1"),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        assert run_cli("eval", "--model", model, *argv, "--quiet") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("hclip eval: error: "), err
        assert expected in err, err
