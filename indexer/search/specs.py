"""Index specs (`--spec`) and the FAISS indexes they describe. Approximate indexes work on the
norm-augmented vectors of indexer.search.mips.

Spec strings: `flat` | `hnsw[:M=32,ef_construction=200,ef_search=128]` |
`ivf[:nlist=1024,nprobe=32]` | `ivfpq[:nlist=1024,m=16,nbits=8,nprobe=32,rerank=10]` |
`ivfsq[:nlist=1024,nprobe=32,rerank=4]` | `ivfip[:nlist=1024,nprobe=32]` | `sq8[:rerank=10]` |
`auto[:recall=0.95]`.

`sq8` is a flat scan of 8-bit scalar codes (one byte per dimension, FAISS's
IndexScalarQuantizer) of the raw products under inner product, its best k * rerank re-scored
exactly: the product views of a compact version (indexer.build.compact).

`ivfip` is the one kind that does not store the norm-augmented vectors: an inverted file over
the raw products with inner-product lists, probed by <q, centroid>, where the augmented L2
distance also weighs each centroid's norm. Neither wins everywhere on H-CLIP products (in
docs/ann each needed fewer probes than the other on some data), so the tuner measures both.

`auto` is not an index: it asks indexer.tune to measure candidates on the view and pick the
fastest that reaches the recall target. The spec it picks keeps the target (`target_recall`),
so a later rebuild of the version (an update) tunes again instead of re-using parameters
chosen for other data.

What a request's `effort` sets, per kind: hnsw ef_search (never below k); ivf, ivfip, ivfpq and
ivfsq nprobe (the re-ranking depth stays the spec's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULTS: dict[str, dict[str, int]] = {
    "flat": {},
    "hnsw": {"M": 32, "ef_construction": 200, "ef_search": 128},
    "ivf": {"nlist": 0, "nprobe": 32},  # nlist 0: about 4 sqrt(N), chosen at build time
    # rerank R: the k * R best by PQ distance are re-scored exactly, from vectors recomputed
    # from the stored embeddings (indexer.search.ann); 0 (specs written before it existed) returns
    # PQ's approximate scores. nbits 4 is FAISS's fast-scan layout.
    "ivfpq": {"nlist": 0, "m": 16, "nbits": 8, "nprobe": 32, "rerank": 10},
    # 8-bit scalar codes (one byte per dimension), re-ranked like ivfpq
    "ivfsq": {"nlist": 0, "nprobe": 32, "rerank": 4},
    "ivfip": {"nlist": 0, "nprobe": 32},
    # a flat scan of 8-bit codes of the raw products, re-ranked like ivfsq (compact versions)
    "sq8": {"rerank": 10},
    # a compact version's float16 embeddings searched as they are (indexer.store.fp16_file):
    # exact scores of the float16 rows; written by compact builds only, never asked for
    "fp16": {},
    "auto": {},
}
DEFAULT_TARGET_RECALL = 0.95
EFFORT_PARAM = {
    "hnsw": "ef_search",
    "ivf": "nprobe",
    "ivfpq": "nprobe",
    "ivfsq": "nprobe",
    "ivfip": "nprobe",
}
IVF_KINDS = ("ivf", "ivfpq", "ivfsq", "ivfip")
INNER_PRODUCT_KINDS = ("ivfip", "sq8", "fp16")  # they index the raw products, not augmented ones
FLAT_CODE_KINDS = ("sq8", "fp16")  # flat codes FAISS can memory-map (IO_FLAG_MMAP_IFC)
BUILT_ONLY_KINDS = ("fp16",)  # written by a compact build, never given as --spec


class SpecError(ValueError):
    """An index spec string is malformed."""


@dataclass(frozen=True)
class IndexSpec:
    kind: str
    params: dict[str, int] = field(default_factory=dict)
    # Set by `auto` and kept by the spec the tuner picks: rebuilds tune again for this recall.
    target_recall: float | None = None

    @property
    def exact(self) -> bool:
        return self.kind == "flat"

    @property
    def tuned(self) -> bool:
        return self.target_recall is not None

    @property
    def effort(self) -> int | None:
        """The effort this spec searches with (see the module's docstring), else None."""
        name = EFFORT_PARAM.get(self.kind)
        return None if name is None else self.params[name]

    @staticmethod
    def parse(text: str) -> IndexSpec:
        kind, _, rest = text.strip().partition(":")
        kind = kind.strip().lower()
        if kind not in DEFAULTS or kind in BUILT_ONLY_KINDS:
            known = ", ".join(k for k in DEFAULTS if k not in BUILT_ONLY_KINDS)
            raise SpecError(f"--spec: unknown index kind {kind!r} (known: {known})")
        if kind == "auto":
            target, batch = _parse_auto(rest)
            return IndexSpec("auto", {"batch": batch} if batch else {}, target)
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
            if params[key] < (0 if key in ("nlist", "rerank") else 1):
                raise SpecError(f"--spec: {key} must be positive, got {params[key]}")
        if kind == "ivfpq" and params["nbits"] not in (4, 8):
            raise SpecError(
                f"--spec: ivfpq nbits must be 4 (fast scan) or 8, got {params['nbits']}"
            )
        return IndexSpec(kind, params)

    def with_target(self, target: float | None) -> IndexSpec:
        return IndexSpec(self.kind, dict(self.params), target)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, **self.params}
        if self.target_recall is not None:
            out["target_recall"] = self.target_recall
        return out

    @staticmethod
    def from_dict(obj: dict[str, Any]) -> IndexSpec:
        params = {k: int(v) for k, v in obj.items() if k not in ("kind", "target_recall")}
        target = obj.get("target_recall")
        return IndexSpec(str(obj["kind"]), params, None if target is None else float(target))

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.params.items())
        return self.kind + (f":{opts}" if opts else "")


def _parse_auto(rest: str) -> tuple[float, int | None]:
    """auto[:recall=R][,batch=B]: the recall target, and the batch the server forms under load
    (indexer.tune.tuner; None: its default)."""
    target, batch = DEFAULT_TARGET_RECALL, None
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in ("recall", "batch"):
            raise SpecError(
                f"--spec: auto takes recall=R (0.5 <= R < 1) and batch=B (B >= 1), got {item!r}"
            )
        if key == "batch":
            if not value.isdigit() or int(value) < 1:
                raise SpecError(f"--spec: batch must be a positive integer, got {value!r}")
            batch = int(value)
            continue
        try:
            target = float(value)
        except ValueError:
            raise SpecError(f"--spec: recall must be a number, got {value!r}") from None
        # 1.0 is flat search, which needs no tuner; below 0.5 nobody means it.
        if not 0.5 <= target < 1.0:
            raise SpecError(f"--spec: recall must be in [0.5, 1), got {target}")
    return target, batch


def augmented_width(dim: int, spec: IndexSpec) -> int:
    """dim + 1, rounded up to a multiple of PQ's sub-quantiser count where there is one; dim
    for the kinds that index the raw products."""
    if spec.kind in INNER_PRODUCT_KINDS:
        return dim
    width = dim + 1
    if spec.kind == "ivfpq":
        m = spec.params["m"]
        width = math.ceil(width / m) * m
    return width


def default_nlist(n: int) -> int:
    """About 4 sqrt(N) lists, with at least 39 points each to train on (FAISS's minimum)."""
    return max(1, min(int(4 * math.sqrt(n)), n // 39 or 1))


def resolved_params(spec: IndexSpec, n: int) -> dict[str, int]:
    params = dict(spec.params)
    if "nlist" in params and params["nlist"] == 0:
        params["nlist"] = default_nlist(n)
    return params


def new_index(spec: IndexSpec, width: int, n: int) -> Any:
    import faiss  # here, not at import: the command line reads specs without it

    p = resolved_params(spec, n)
    index: Any
    if spec.kind == "hnsw":
        index = faiss.IndexHNSWFlat(width, p["M"])
        index.hnsw.efConstruction = p["ef_construction"]
        index.hnsw.efSearch = p["ef_search"]
        return index
    if spec.kind == "sq8":
        qt = faiss.ScalarQuantizer.QT_8bit
        return faiss.IndexScalarQuantizer(width, qt, faiss.METRIC_INNER_PRODUCT)
    if spec.kind == "ivfip":
        ip = faiss.METRIC_INNER_PRODUCT
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(width), width, p["nlist"], ip)
        index.nprobe = p["nprobe"]
        return index
    quantizer = faiss.IndexFlatL2(width)
    if spec.kind == "ivf":
        index = faiss.IndexIVFFlat(quantizer, width, p["nlist"])
    elif spec.kind == "ivfpq" and p["nbits"] == 4:
        # 4-bit codes in FAISS's fast-scan layout: SIMD lookups instead of a table per code.
        index = faiss.IndexIVFPQFastScan(quantizer, width, p["nlist"], p["m"], 4)
    elif spec.kind == "ivfpq":
        index = faiss.IndexIVFPQ(quantizer, width, p["nlist"], p["m"], p["nbits"])
    elif spec.kind == "ivfsq":
        qtype = faiss.ScalarQuantizer.QT_8bit
        index = faiss.IndexIVFScalarQuantizer(quantizer, width, p["nlist"], qtype)
    else:
        raise SpecError(f"no approximate index of kind {spec.kind!r}")
    index.nprobe = p["nprobe"]
    return index  # faiss's wrapper keeps the quantizer alive with the index


def set_search_params(index: Any, spec: IndexSpec) -> None:
    """Search-time parameters are not all serialised by FAISS; reapply them after loading."""
    import faiss  # here, not at import: the command line reads specs without it

    if spec.kind == "hnsw":
        hnsw: Any = faiss.downcast_index(index)
        hnsw.hnsw.efSearch = spec.params["ef_search"]
    elif spec.kind in IVF_KINDS:
        faiss.extract_index_ivf(index).nprobe = spec.params["nprobe"]


def search_params(
    index: Any, spec: IndexSpec, effort: int | None, allowed: np.ndarray | None
) -> Any:
    """FAISS search parameters for one call: the effort asked for (ef_search or nprobe) and a
    selector of the allowed positions; None when neither is given."""
    import faiss  # here, not at import: the command line reads specs without it

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
    elif spec.kind in IVF_KINDS:
        params = lib.SearchParametersIVF(sel=sel, nprobe=effort or spec.params["nprobe"])
    else:
        params = lib.SearchParameters(sel=sel)
    params.sel_ref = sel
    return params
