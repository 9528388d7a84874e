"""The exact search's kernel crossover: measured once per machine and shape, kept in a file
that every later caller (another worker, a restart) reads instead of measuring again."""

from __future__ import annotations

import json
import threading

import numpy as np

from indexer.search import crossover, exact


def test_measured_once_and_shared(tmp_path, monkeypatch) -> None:
    calls = []
    real = crossover.measure

    def counted(dim: int):
        calls.append(dim)
        return real(dim)

    monkeypatch.setattr(crossover, "measure", counted)
    monkeypatch.setattr(crossover, "SYNTHETIC_BYTES", 1 << 20)  # a small matrix: a quick test
    monkeypatch.setattr(crossover, "ROUND_S", 0.005)
    found: list[int] = []
    workers = [
        threading.Thread(target=lambda: found.append(crossover.products_from(16, 1, tmp_path)))
        for _ in range(3)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert calls == [16]  # three callers at once, one measurement
    assert len(set(found)) == 1 and found[0] in (*crossover.SIZES, crossover.NEVER)
    (record,) = tmp_path.glob("exact-*.json")
    saved = json.loads(record.read_text())
    assert saved["products_from"] == found[0] and saved["dim"] == 16
    assert set(saved["rates"]) == {str(b) for b in crossover.SIZES}
    assert crossover.products_from(16, 1, tmp_path) == found[0] and calls == [16]
    crossover.products_from(32, 1, tmp_path)  # another width is another choice
    assert calls == [16, 32]


def test_a_damaged_record_is_measured_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(crossover, "measure", lambda dim: (16, {}))
    path = tmp_path / f"exact-{crossover.signature(8, 1)}.json"
    path.write_text("{not json")
    assert crossover.products_from(8, 1, tmp_path) == 16
    assert json.loads(path.read_text())["products_from"] == 16


def test_a_directory_that_cannot_hold_the_record_costs_a_measurement_not_a_failure(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(crossover, "measure", lambda dim: (32, {}))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert crossover.products_from(8, 1, blocked / "kernels") == 32


def test_every_crossover_gives_the_same_results() -> None:
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((30_000, 24)).astype(np.float32)
    xq = rng.standard_normal((12, 24)).astype(np.float32)
    scores = [exact.search(xq, xb, 10, products_from=p)[0] for p in (1, 8, crossover.NEVER)]
    for s in scores[1:]:
        np.testing.assert_allclose(s, scores[0], rtol=1e-5, atol=1e-5)
