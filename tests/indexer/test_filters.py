"""Filterable fields: column types chosen from the values, filters evaluated like a plain loop."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import orjson
import pytest

from indexer.store.fields import FieldColumns, FieldsWriter, FieldValueError, FilterError

PAYLOADS = [
    {"cat": "a", "year": 2001, "flag": True},
    {"cat": "b", "year": 2002.5},
    {"cat": 7, "flag": False},
    {"year": 1999},
    {"cat": "a", "year": 2010, "flag": True},
]


@pytest.fixture
def columns(tmp_path: Path) -> FieldColumns:
    w = FieldsWriter(tmp_path, ["cat", "year", "flag"])
    w.append([orjson.dumps(p) for p in PAYLOADS[:2]])
    w.append([orjson.dumps(p) for p in PAYLOADS[2:]])
    info = w.close()
    assert info == {
        "cat": {"type": "categorical", "values": 3},
        "year": {"type": "numeric"},
        "flag": {"type": "categorical", "values": 2},
    }
    assert json.loads((tmp_path / "fields" / "cat.values.json").read_text()) == ["a", "b", 7]
    return FieldColumns(tmp_path, info)


@pytest.mark.parametrize(
    ("flt", "rows"),
    [
        ({"cat": "a"}, [0, 4]),
        ({"cat": 7}, [2]),
        ({"cat": 7.0}, [2]),  # 7 and 7.0 are one value
        ({"cat": {"in": ["b", 7, "zz"]}}, [1, 2]),
        ({"flag": True}, [0, 4]),
        ({"year": {"gte": 2001, "lt": 2010}}, [0, 1]),
        ({"year": 1999}, [3]),
        ({"year": {"in": [2001, 2010]}, "flag": True}, [0, 4]),
        ({}, [0, 1, 2, 3, 4]),
    ],
)
def test_evaluation(columns: FieldColumns, flt: dict, rows: list[int]) -> None:
    assert np.flatnonzero(columns.evaluate(flt, 5)).tolist() == rows


@pytest.mark.parametrize(
    ("flt", "message"),
    [
        ({"nope": 1}, "filter.nope: not a filterable field (declared: cat, year, flag)"),
        ({"cat": {"lt": 3}}, "filter.cat: a range needs a numeric field"),
        ({"year": "2001"}, "filter.year: year is a numeric field"),
        ({"year": {"lt": "x"}}, "filter.year.lt: expected a finite number"),
        ({"year": {"in": []}}, "filter.year.in: expected a non-empty list"),
        ({"cat": ["a"]}, "filter.cat: to match one of several values use"),
        ({"cat": {"lt": 1, "in": [1]}}, "filter.cat: a condition is a value"),
    ],
)
def test_validation(columns: FieldColumns, flt: dict, message: str) -> None:
    with pytest.raises(FilterError, match=re.escape(message)):
        columns.validate(flt)


def test_a_value_that_cannot_be_a_column_is_a_record_error() -> None:
    FieldsWriter.check({"cat": "a", "other": {"x": 1}}, ["cat"])
    with pytest.raises(FieldValueError, match=r"payload\.cat: a filterable field must hold"):
        FieldsWriter.check({"cat": {"x": 1}}, ["cat"])
