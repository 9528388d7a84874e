"""Index specs (`--spec`) and the FAISS indexes they describe. Approximate indexes work on the
norm-augmented vectors of indexer.mips.

Spec strings: `flat` | `hnsw[:M=32,ef_construction=200,ef_search=128]` |
`ivf[:nlist=1024,nprobe=32]` | `ivfpq[:nlist=1024,m=16,nbits=8,nprobe=32]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

DEFAULTS: dict[str, dict[str, int]] = {
    "flat": {},
    "hnsw": {"M": 32, "ef_construction": 200, "ef_search": 128},
    "ivf": {"nlist": 0, "nprobe": 32},  # nlist 0: about 4 sqrt(N), chosen at build time
    "ivfpq": {"nlist": 0, "m": 16, "nbits": 8, "nprobe": 32},
}


class SpecError(ValueError):
    """An index spec string is malformed."""


@dataclass(frozen=True)
class IndexSpec:
    kind: str
    params: dict[str, int] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.kind == "flat"

    @staticmethod
    def parse(text: str) -> IndexSpec:
        kind, _, rest = text.strip().partition(":")
        kind = kind.strip().lower()
        if kind not in DEFAULTS:
            raise SpecError(f"--spec: unknown index kind {kind!r} (known: {', '.join(DEFAULTS)})")
        params = dict(DEFAULTS[kind])
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in params:
                raise SpecError(
                    f"--spec: {kind} takes {', '.join(f'{k}=N' for k in params) or 'no options'}"
                    f", got {item!r}"
                )
            try:
                params[key] = int(value)
            except ValueError:
                raise SpecError(f"--spec: {key} must be an integer, got {value!r}") from None
            if params[key] < (0 if key == "nlist" else 1):
                raise SpecError(f"--spec: {key} must be positive, got {params[key]}")
        return IndexSpec(kind, params)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.params}

    @staticmethod
    def from_dict(obj: dict[str, Any]) -> IndexSpec:
        params = {k: int(v) for k, v in obj.items() if k != "kind"}
        return IndexSpec(str(obj["kind"]), params)


def augmented_width(dim: int, spec: IndexSpec) -> int:
    """dim + 1, rounded up to a multiple of PQ's sub-quantiser count where there is one."""
    width = dim + 1
    if spec.kind == "ivfpq":
        m = spec.params["m"]
        width = math.ceil(width / m) * m
    return width


def resolved_params(spec: IndexSpec, n: int) -> dict[str, int]:
    params = dict(spec.params)
    if "nlist" in params and params["nlist"] == 0:
        params["nlist"] = max(1, min(int(4 * math.sqrt(n)), n // 39 or 1))
    return params


def new_index(spec: IndexSpec, width: int, n: int) -> Any:
    p = resolved_params(spec, n)
    index: Any
    if spec.kind == "hnsw":
        index = faiss.IndexHNSWFlat(width, p["M"])
        index.hnsw.efConstruction = p["ef_construction"]
        index.hnsw.efSearch = p["ef_search"]
        return index
    quantizer = faiss.IndexFlatL2(width)
    if spec.kind == "ivf":
        index = faiss.IndexIVFFlat(quantizer, width, p["nlist"])
    elif spec.kind == "ivfpq":
        index = faiss.IndexIVFPQ(quantizer, width, p["nlist"], p["m"], p["nbits"])
    else:
        raise SpecError(f"no approximate index of kind {spec.kind!r}")
    index.nprobe = p["nprobe"]
    return index  # faiss's wrapper keeps the quantizer alive with the index


def set_search_params(index: Any, spec: IndexSpec) -> None:
    """Search-time parameters are not all serialised by FAISS; reapply them after loading."""
    if spec.kind == "hnsw":
        hnsw: Any = faiss.downcast_index(index)
        hnsw.hnsw.efSearch = spec.params["ef_search"]
    elif spec.kind in ("ivf", "ivfpq"):
        faiss.extract_index_ivf(index).nprobe = spec.params["nprobe"]


def search_params(
    index: Any, spec: IndexSpec, effort: int | None, allowed: np.ndarray | None
) -> Any:
    """FAISS search parameters for one call: the effort asked for (ef_search or nprobe) and a
    selector of the allowed positions; None when neither is given."""
    if effort is None and allowed is None:
        return None
    lib: Any = faiss  # its type stubs lack the search-parameter classes
    sel = None
    if allowed is not None:
        bits = np.packbits(allowed.astype(np.uint8), bitorder="little")
        sel = lib.IDSelectorBitmap(len(allowed), lib.swig_ptr(bits))
        sel.bits_ref = bits  # the selector points into the array: keep it alive with it
    if spec.kind == "hnsw":
        params = lib.SearchParametersHNSW(sel=sel, efSearch=effort or spec.params["ef_search"])
    elif spec.kind in ("ivf", "ivfpq"):
        params = lib.SearchParametersIVF(sel=sel, nprobe=effort or spec.params["nprobe"])
    else:
        params = lib.SearchParameters(sel=sel)
    params.sel_ref = sel
    return params
