"""Payload fields declared filterable at build time (`--filter-fields category,year`), stored as
columns beside the record store, and the filters a search applies to them.

    records/fields/<name>.num.npy      (N,) float64, NaN where a row lacks the field: a field
                                       whose values are all numbers (booleans are not numbers)
    records/fields/<name>.codes.npy    (N,) int32, -1 where a row lacks it: any other field,
    records/fields/<name>.values.json  with the distinct values, code i = values[i]

A filter is an object of conditions on declared fields, all of which must hold (AND):

    {"category": "shoes",                      equality
     "color": {"in": ["red", "blue"]},         one of
     "year": {"gte": 2020, "lt": 2024}}        a numeric range (gt, gte, lt, lte)

A row lacking the field matches no condition on it. Filters are evaluated over the columns in
one vectorised pass: (N,) booleans, which the search then restricts itself to.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from indexer.store.arrays import NpyAppender
from models.limits import string_problem

FIELDS_DIR = "fields"
RANGE_OPS = {"gt": np.greater, "gte": np.greater_equal, "lt": np.less, "lte": np.less_equal}
Scalar = str | int | float | bool


class FilterError(ValueError):
    """A filter names an undeclared field or asks what its column cannot answer; the message
    names the field as `filter.<name>`."""


class FieldValueError(ValueError):
    """A record's value for a filterable field cannot be stored (not a scalar)."""


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _key(v: Scalar) -> str:
    """Canonical JSON of a scalar: 1 and 1.0 are the same value, True is not 1."""
    is_number = isinstance(v, int | float) and not isinstance(v, bool)
    if is_number and float(v).is_integer() and abs(float(v)) < 2**53:
        return str(int(v))
    return orjson.dumps(v).decode()


class FieldsWriter:
    """Collects the declared fields row by row; close() writes each as a numeric or a coded
    column. Memory: 12 bytes per row and field, plus the distinct values."""

    def __init__(
        self, directory: Path, names: Sequence[str], types: Mapping[str, str] | None = None
    ):
        self.dir = directory / FIELDS_DIR
        self.names = list(names)
        # A column's type as the version an update starts from declared it: kept, not inferred.
        self.types = dict(types or {})
        if self.names:
            self.dir.mkdir()
        self._num = {n: NpyAppender(self.dir / f"{n}.num.npy", None, "<f8") for n in self.names}
        self._codes = {n: NpyAppender(self.dir / f"{n}.codes.npy", None, "<i4") for n in self.names}
        self._values: dict[str, dict[str, int]] = {n: {} for n in self.names}
        self._raw: dict[str, list[Scalar]] = {n: [] for n in self.names}
        self._numeric = {n: self.types.get(n, "numeric") == "numeric" for n in self.names}

    @staticmethod
    def check(
        payload: Mapping[str, Any], names: Sequence[str], types: Mapping[str, str] | None = None
    ) -> None:
        """A record's filterable values: scalars, finite, and numbers where `types` (the
        columns an update keeps) says the column is numeric."""
        for n in names:
            v = payload.get(n)
            if v is not None and not isinstance(v, str | int | float | bool):
                raise FieldValueError(
                    f"payload.{n}: a filterable field must hold a string, a number or a "
                    f"boolean, got {type(v).__name__}"
                )
            if isinstance(v, float) and not math.isfinite(v):
                raise FieldValueError(f"payload.{n}: holds NaN or infinity")
            problem = string_problem(v) if isinstance(v, str) else None
            if problem is not None:  # a backend compares it in expressions and stores it
                raise FieldValueError(f"payload.{n}: {problem}")
            if v is not None and types and types.get(n) == "numeric" and not _is_number(v):
                raise FieldValueError(
                    f"payload.{n}: {orjson.dumps(v).decode()} does not fit the column's type: "
                    f"{n!r} is a numeric filter field in the version this update starts from"
                )

    def append(self, payloads: Sequence[bytes]) -> None:
        if not self.names:
            return
        objs = [orjson.loads(p) for p in payloads]
        for n in self.names:
            num = np.full(len(objs), np.nan)
            codes = np.full(len(objs), -1, np.int32)
            table, raw = self._values[n], self._raw[n]
            for i, obj in enumerate(objs):
                v = obj.get(n)
                if v is None:
                    continue
                if _is_number(v):
                    num[i] = float(v)
                elif self.types.get(n) == "numeric":  # FieldsWriter.check keeps these out
                    raise FieldValueError(f"payload.{n}: not a number in a numeric column")
                else:
                    self._numeric[n] = False
                key = _key(v)
                code = table.get(key)
                if code is None:
                    code = table[key] = len(raw)
                    raw.append(v)
                codes[i] = code
            self._num[n].append(num)
            self._codes[n].append(codes)

    def close(self) -> dict[str, dict[str, Any]]:
        """Write the columns; the manifest's description of each field."""
        out: dict[str, dict[str, Any]] = {}
        for n in self.names:
            self._num[n].close()
            self._codes[n].close()
            if self._numeric[n]:
                (self.dir / f"{n}.codes.npy").unlink()
                out[n] = {"type": "numeric"}
            else:
                (self.dir / f"{n}.num.npy").unlink()
                (self.dir / f"{n}.values.json").write_text(json.dumps(self._raw[n]))
                out[n] = {"type": "categorical", "values": len(self._raw[n])}
        return out


class FieldColumns:
    """The declared fields of one version, memory-mapped."""

    def __init__(self, directory: Path, fields: Mapping[str, Mapping[str, Any]]):
        self.types = {n: str(f["type"]) for n, f in fields.items()}
        d = directory / FIELDS_DIR
        self.num: dict[str, np.ndarray] = {}
        self.codes: dict[str, np.ndarray] = {}
        self.values: dict[str, dict[str, int]] = {}
        for n, t in self.types.items():
            if t == "numeric":
                self.num[n] = np.load(d / f"{n}.num.npy", mmap_mode="r")
            else:
                self.codes[n] = np.load(d / f"{n}.codes.npy", mmap_mode="r")
                raw = json.loads((d / f"{n}.values.json").read_text())
                self.values[n] = {_key(v): i for i, v in enumerate(raw)}

    @classmethod
    def declared(cls, fields: Mapping[str, Mapping[str, Any]]) -> FieldColumns:
        """The fields' types without their columns: validate() works, evaluate() does not (a
        version whose rows live elsewhere, indexer.store.milvus)."""
        self = cls.__new__(cls)
        self.types = {n: str(f["type"]) for n, f in fields.items()}
        self.num, self.codes, self.values = {}, {}, {}
        return self

    def __len__(self) -> int:
        cols = [*self.num.values(), *self.codes.values()]
        return len(cols[0]) if cols else 0

    def validate(self, flt: Mapping[str, Any]) -> None:
        """Raise FilterError for anything evaluate() could not answer; reads no column."""
        for name, cond in flt.items():
            if name not in self.types:
                declared = ", ".join(self.types) or "none were declared at build time"
                raise FilterError(f"filter.{name}: not a filterable field (declared: {declared})")
            self._condition(name, cond, evaluate=False)

    def evaluate(self, flt: Mapping[str, Any], n_rows: int) -> np.ndarray:
        """(n_rows,) bool: the rows every condition holds for (one pass over each column)."""
        self.validate(flt)
        mask = np.ones(n_rows, dtype=bool)
        for name, cond in flt.items():
            got = self._condition(name, cond, evaluate=True)
            assert got is not None
            mask &= got
        return mask

    def _condition(self, name: str, cond: Any, evaluate: bool) -> np.ndarray | None:
        field = f"filter.{name}"
        if isinstance(cond, dict):
            ops = set(cond)
            if ops == {"in"}:
                if not isinstance(cond["in"], list) or not cond["in"]:
                    raise FilterError(f"{field}.in: expected a non-empty list of values")
                return self._one_of(name, cond["in"], f"{field}.in", evaluate)
            unknown = ops - set(RANGE_OPS)
            if unknown or not ops:
                raise FilterError(
                    f"{field}: a condition is a value, {{'in': [...]}} or a range of "
                    f"{', '.join(RANGE_OPS)}; got {sorted(ops)}"
                )
            if self.types[name] != "numeric":
                raise FilterError(f"{field}: a range needs a numeric field; {name} is not")
            for op, bound in cond.items():
                if not _is_number(bound) or not math.isfinite(bound):
                    raise FilterError(f"{field}.{op}: expected a finite number, got {bound!r}")
            if not evaluate:
                return None
            col = self.num[name]
            mask = np.ones(len(col), dtype=bool)
            for op, bound in cond.items():
                mask &= RANGE_OPS[op](col, float(bound))  # NaN (missing) compares False
            return mask
        if isinstance(cond, list):
            raise FilterError(f"{field}: to match one of several values use {{'in': [...]}}")
        return self._one_of(name, [cond], field, evaluate)

    def _one_of(
        self, name: str, wanted: list[Any], field: str, evaluate: bool
    ) -> np.ndarray | None:
        for v in wanted:
            if not isinstance(v, str | int | float | bool):
                raise FilterError(f"{field}: expected strings, numbers or booleans, got {v!r}")
        numeric = self.types[name] == "numeric"
        if numeric and not all(_is_number(v) for v in wanted):
            raise FilterError(f"{field}: {name} is a numeric field; compare it to numbers")
        if not evaluate:
            return None
        if numeric:
            return np.isin(self.num[name], [float(v) for v in wanted])
        codes = [self.values[name][_key(v)] for v in wanted if _key(v) in self.values[name]]
        if not codes:
            return np.zeros(len(self.codes[name]), dtype=bool)
        return np.isin(self.codes[name], codes)
