"""The columnar checks (indexer.ingest.checks) against the one-by-one Validator, the reference: the
same records accepted with the same inputs and payload bytes, the same records rejected with
the same line, id and message, for JSON Lines and Parquet, whatever the chunk size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from indexer.build.writer import RowWriter
from indexer.ingest.admission import Admission
from indexer.ingest.checks import ChunkChecker
from indexer.ingest.sources import RecordFiles
from indexer.ingest.validate import Rejected, Validator
from indexer.store import artifact
from indexer.store.verify import verify
from indexer.store.version import LoadedVersion
from models.checkpoint import load_model, save_model
from models.config import ModelConfig
from models.model import MultimodalModel
from tests.conftest import DIMS, index_build, make_model_dir, vector_records, write_jsonl
from tests.indexer.test_bad_records import CASES, MODS, RAW_CASES, good


def mm_model_dir(path: Path) -> Path:
    torch.manual_seed(0)
    return save_model(
        MultimodalModel(ModelConfig.from_dict({"modalities": MODS, "latent_dim": 4})), path
    )


def emb_model_dir(path: Path) -> Path:
    """A vector and an embedding modality: both take the array path."""
    cfg = {
        "modalities": {"v": {"kind": "vector", "dim": 3}, "e": {"kind": "embedding", "dim": 4}},
        "latent_dim": 4,
    }
    torch.manual_seed(0)
    return save_model(MultimodalModel(ModelConfig.from_dict(cfg)), path)


def reference(model: MultimodalModel, files: RecordFiles, fields: tuple[str, ...] = ()):
    """Record by record, as the engine checked records before the columnar path."""
    v = Validator(model, files.base_dir, skip_bad=True, filter_fields=fields)
    accepted = [r for loc, raw in files.iter_records() if (r := v.check(loc, raw)) is not None]
    return accepted, v.rejected, {k for r in accepted for k in r.ignored}


def columnar(
    model: MultimodalModel, files: RecordFiles, rows: int, fields: tuple[str, ...] = ()
) -> tuple[list[dict[str, Any]], list[Rejected], set[str]]:
    checker = ChunkChecker(Validator(model, files.base_dir, filter_fields=fields))
    admission = Admission(files, skip_bad=True)
    out: list[dict[str, Any]] = []
    for chunk in files.chunks(rows):
        checked = checker.check(chunk)
        got = checked.rows.take(admission.admit(checked))
        for i in range(len(got)):
            inputs = {}
            for j, n in enumerate(model.names):
                if got.presence[i, j]:
                    v = got.inputs[n][i]
                    inputs[n] = v if isinstance(got.inputs[n], list) else torch.from_numpy(v)
            out.append({"id": got.ids[i], "payload": got.payloads[i], "inputs": inputs})
    # the fast path must carry the clean records: only the others go to the reference
    assert checker.referred <= len(admission.rejected) + len(files.files) * 2
    return out, admission.rejected, set(admission.ignored)


def assert_same(model: MultimodalModel, files: RecordFiles, fields: tuple[str, ...] = ()) -> int:
    ref_ok, ref_bad, ref_ignored = reference(model, files, fields)
    for rows in (1, 3, 8192):  # chunk boundaries anywhere, or one chunk for all
        got_ok, got_bad, got_ignored = columnar(model, files, rows, fields)
        assert [r.to_dict() for r in got_bad] == [r.to_dict() for r in ref_bad]
        # Fields that are no modality are left out and named: every one the reference names
        # (the fast checks may also name one that only a rejected record holds).
        assert got_ignored >= ref_ignored
        assert [g["id"] for g in got_ok] == [r.id for r in ref_ok]
        for g, r in zip(got_ok, ref_ok, strict=True):
            assert g["payload"] == r.payload_json
            assert g["inputs"].keys() == r.inputs.keys(), r.id
            for n, x in r.inputs.items():
                assert torch.equal(torch.as_tensor(g["inputs"][n]), x), (r.id, n)
    return len(ref_bad)


def test_every_bad_line_kind_is_named_as_the_validator_names_it(tmp_path: Path) -> None:
    model = load_model(mm_model_dir(tmp_path / "m"))
    lines = [json.dumps(good(i)) for i in range(3)]
    for k, (mutate, _) in enumerate(CASES):
        row = good(10 + k)
        mutate(row)
        lines += [json.dumps(row), json.dumps(good(100 + k))]
    for k, (mutate, _) in enumerate(RAW_CASES):  # as in test_bad_records, on good(2)
        raw = mutate(json.dumps(good(2))).replace('"g2"', f'"raw{k}"')
        lines += [raw, "", json.dumps(good(300 + k))]
    extra = [
        dict(good(400), payload={"flag": True, "n": None}),  # booleans elsewhere are fine
        dict(good(401), vec=[1, 2, 3]),  # integers are numbers
        dict(good(402), vec=["1", 2, 3]),  # numpy reads a numeric string, as decode_vector does
        dict(good(403), vec=[[1], 2, 3]),
        dict(good(404), vec={"a": 1}),
        dict(good(405), vec=[1, None, 3]),
        dict(good(406), vec=[1e39, 0, 0]),  # beyond float32
        dict(good(407), smell=None),  # a null unknown key is absent, not unknown
        dict(good(408), payload=None),
        dict(good(409), id=""),
        {"id": "g2", "smell": 1},  # a duplicate that is also bad: named as a duplicate
        {"id": "x1", "smell": 1},  # bad, so it does not take its id ...
        dict(good(410), id="x1"),  # ... and this one may
        dict(good(411), audio=None),
    ]
    lines += [json.dumps(r) for r in extra]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    bad = assert_same(model, RecordFiles.resolve(tmp_path / "r.jsonl"))
    assert bad == len(CASES) + len(RAW_CASES) + 8


def test_array_kinds_and_filter_fields(tmp_path: Path) -> None:
    model = load_model(emb_model_dir(tmp_path / "m"))
    rows: list[Any] = [
        {"id": "a", "v": [1, 2, 3], "e": [0.5, 0, 0, 1], "payload": {"k": "x"}},
        {"id": "b", "e": [0, 0, 0, 0]},  # an embedding needs a direction
        {"id": "c", "v": [1, 2, 3], "payload": {"k": [1]}},  # not a filterable value
        {"id": "d", "v": [True, 2, 3]},
        {"id": "e", "e": [1, 2, 3, 4], "payload": {"k": 2.5, "other": {"deep": [True]}}},
        {"id": "f", "v": [1, 2, 3], "payload": {"k": False}},
        {"id": "g", "e": [1, 2, 3]},
    ]
    write_jsonl(tmp_path / "r.jsonl", rows)
    assert assert_same(model, RecordFiles.resolve(tmp_path / "r.jsonl"), ("k",)) == 4


def vector_line_cases() -> list[str]:
    """JSON lines for emb_model_dir's model (v: 3-d vector, e: 4-d embedding): plain ones, and
    every way a vector, a payload or an id can be odd or wrong, as text (some are not JSON)."""
    good = [
        json.dumps({"id": f"g{i}", "v": [i, 0.5, -1.25e-3], "e": [1, 2, 3, i], "payload": {}})
        for i in range(6)
    ]
    odd_vectors = [
        '["1", 2, 3]',  # a numeric string: numpy reads it, as decode_vector does
        "[true, 2, 3]",
        "[null, 2, 3]",
        "[[1], 2, 3]",
        "[[1, 2, 3]]",
        "[1, 2]",
        "[1, 2, 3, 4]",
        "[]",
        '{"a": 1}',
        "5",
        '"1,2,3"',
        "[1e39, 0, 0]",  # beyond float32
        "[1e400, 0, 0]",  # beyond float64
        "[-0, 1E+2, 2.5e-1]",
        "[ 1 ,\t2 , 3 ]",
        "[12345678901234567890123, 0, 1]",
        "null",
    ]
    lines = list(good)
    for k, vec in enumerate(odd_vectors):
        lines += [f'{{"id": "v{k}", "v": {vec}, "payload": {{"k": {k}}}}}', good[k % 6]]
    lines += [
        '{"id": "p1", "v": [1, 2, 3], "payload": null}',
        '{"id": "p2", "v": [1, 2, 3], "payload": [1]}',
        '{"id": "p3", "v": [1, 2, 3], "payload": "x"}',
        '{"id": "p4", "v": [1, 2, 3], "payload": {"big": 123456789012345678901234567890}}',
        '{"id": "p5", "v": [1, 2, 3], "payload": {"s": "\\u00e9\\n", "f": 1.0E5}}',
        '{"id": "p6", "v": [1, 2, 3], "payload": {"a": 1}, "payload": {"b": 2}}',
        '{"id": "", "v": [1, 2, 3]}',
        '{"id": 7, "v": [1, 2, 3]}',
        '{"v": [1, 2, 3]}',
        '{"id": "u1", "v": [1, 2, 3], "smell": 1}',
        '{"id": "u2", "v": [1, 2, 3], "smell": null}',  # a null unknown key is absent
        '{"id": "n1", "v": [NaN, 2, 3]}',
        '{"id": "n2", "v": [1, 2, 3]} trailing',
        '{"id": "n3", "v": [1, 2, 3]',
        '{"id": "g0", "v": [1, 2, 3]}',  # a duplicate id
        '{"id": "d1", "v": null, "e": null}',  # no modality
        '{"id": "d2", "e": [0, 0, 0, 0]}',  # an embedding needs a direction
        "[1, 2, 3]",
    ]
    return lines


@pytest.mark.parametrize("clean_first", [True, False])
def test_vector_lines_match_the_validator(tmp_path: Path, clean_first: bool) -> None:
    """Records of vector kinds only take indexer.ingest.jsonl_vectors: the same answers as the
    reference for every odd case, whether a chunk holds one of them or none."""
    model = load_model(emb_model_dir(tmp_path / "m"))
    lines = vector_line_cases()
    if not clean_first:
        lines.reverse()
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    files = RecordFiles.resolve(tmp_path / "r.jsonl")
    checker = ChunkChecker(Validator(model, files.base_dir))
    assert checker.vector_lines is not None  # the path under test
    assert assert_same(model, files) >= 25


def test_clean_vector_lines_never_reach_the_reference(tmp_path: Path) -> None:
    model = load_model(emb_model_dir(tmp_path / "m"))
    rows = [
        {"id": f"r{i}", "v": [i, 1.5, -2], "e": [0.25, i, 0, 1], "payload": {"i": i}}
        for i in range(50)
    ]
    rows[7].pop("e")
    rows[9]["v"] = None
    write_jsonl(tmp_path / "r.jsonl", rows)
    files = RecordFiles.resolve(tmp_path / "r.jsonl")
    checker = ChunkChecker(Validator(model, files.base_dir))
    got = [checker.check(c) for c in files.chunks(16)]
    assert checker.referred == 0
    assert sum(len(c.rows) for c in got) == 50
    assert assert_same(model, files) == 0
    # Fields of another model on every line: the general path takes them, none one by one.
    write_jsonl(tmp_path / "x.jsonl", [{**r, "sound": [1, 2], "t": "x"} for r in rows])
    files = RecordFiles.resolve(tmp_path / "x.jsonl")
    checker = ChunkChecker(Validator(model, files.base_dir))
    got = [checker.check(c) for c in files.chunks(16)]
    assert checker.referred == 0 and sum(len(c.rows) for c in got) == 50
    assert got[0].ignored == {"sound": got[0].rows.locs[0], "t": got[0].rows.locs[0]}
    assert assert_same(model, files) == 0


def parquet_table(rows: list[dict[str, Any]], vec_type: pa.DataType) -> pa.Table:
    return pa.table(
        {
            "id": pa.array([r.get("id") for r in rows], pa.string()),
            "payload": pa.array([r.get("payload") for r in rows], pa.string()),
            **{m: pa.array([r.get(m) for r in rows], vec_type(d)) for m, d in DIMS.items()},
        }
    )


@pytest.mark.parametrize(
    "vec_type",
    [
        lambda d: pa.list_(pa.float32(), d),  # fixed size: read straight from its buffer
        lambda d: pa.list_(pa.float64()),
        lambda d: pa.large_list(pa.float32()),
        lambda d: pa.list_(pa.int64()),
    ],
    ids=["fixed_f32", "list_f64", "large_list_f32", "list_i64"],
)
def test_parquet_columns_match_the_validator(tmp_path: Path, vec_type) -> None:
    model = load_model(make_model_dir(tmp_path / "m"))
    rows: list[dict[str, Any]] = vector_records(40, DIMS, seed=2)
    for r in rows:
        r["payload"] = json.dumps(r["payload"])
        if vec_type(2) == pa.list_(pa.int64()):
            r.update({m: [int(x * 10) for x in r[m]] for m in DIMS})
    rows[3]["a"] = None  # absent
    rows[5]["payload"] = '{"n": 123456789012345678901234}'  # kept as an integer, too big
    rows[6]["payload"] = "[1, 2]"
    rows[7]["payload"] = "{nope"
    rows[8]["id"] = None
    rows[9]["id"] = rows[2]["id"]
    rows[10]["payload"] = None
    rows[11]["payload"] = '{"x": NaN}'
    rows[12].update(a=None, b=None, c=None)
    pq.write_table(parquet_table(rows, vec_type), tmp_path / "r.parquet", row_group_size=7)
    assert assert_same(model, RecordFiles.resolve(tmp_path / "r.parquet")) == 7


def test_parquet_bad_vectors(tmp_path: Path) -> None:
    model = load_model(make_model_dir(tmp_path / "m"))
    rows: list[dict[str, Any]] = vector_records(12, DIMS, seed=3)
    rows[1]["a"] = rows[1]["a"][:-1]  # wrong length
    rows[2]["b"] = [*rows[2]["b"][:-1], None]  # a null inside
    rows[4]["c"] = [float("nan")] * DIMS["c"]
    rows[6]["c"] = [1e39] * DIMS["c"]
    table = pa.table(
        {
            "id": [r["id"] for r in rows],
            "payload": [{"symbol": r["payload"]["symbol"], "tag": None} for r in rows],
            **{m: pa.array([r[m] for r in rows], pa.list_(pa.float64())) for m in DIMS},
            "smell": [None] * 11 + ["roses"],  # no modality, empty but for one row: left out
        }
    )
    pq.write_table(table, tmp_path / "r.parquet")
    assert assert_same(model, RecordFiles.resolve(tmp_path / "r.parquet")) == 4
    # a column of booleans: every row with a value goes to the reference
    flags = table.set_column(
        table.schema.get_field_index("a"),
        "a",
        pa.array([[True] * DIMS["a"]] * 12, pa.list_(pa.bool_())),
    )
    pq.write_table(flags.drop_columns(["payload"]), tmp_path / "b.parquet")
    assert assert_same(model, RecordFiles.resolve(tmp_path / "b.parquet")) == 12


def test_columnar_build_equals_the_record_by_record_build(tmp_path: Path) -> None:
    """The whole artifact: ids, payloads, presence, embeddings and every view."""
    rows = vector_records(700, DIMS, seed=4, k=50)
    for i in range(0, 700, 7):
        rows[i].pop("b")
    rows[5]["a"] = [1.0]  # rejected with --skip-bad
    write_jsonl(tmp_path / "r.jsonl", rows)
    model_dir = make_model_dir(tmp_path / "m")
    root = tmp_path / "root"
    assert (
        index_build(model_dir, tmp_path / "r.jsonl", root, "--skip-bad", "--batch-size", "64") == 0
    )
    got = LoadedVersion(artifact.current_version_dir(root))
    assert verify(got.path) == []

    # the reference, as the engine wrote a version before: one record at a time, 64 per batch
    model = load_model(model_dir)
    files = RecordFiles.resolve(tmp_path / "r.jsonl")
    accepted, rejected, _ = reference(model, files)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    writer = RowWriter(ref_dir, model.names, model.cfg.latent_dim)
    with torch.no_grad():
        for s in range(0, len(accepted), 64):
            batch = accepted[s : s + 64]
            embs = {}
            for n in model.names:
                full = np.zeros((len(batch), model.cfg.latent_dim), np.float32)
                have = [i for i, r in enumerate(batch) if n in r.inputs]
                full[have] = model.encode(n, [batch[i].inputs[n] for i in have]).numpy()
                embs[n] = full
            presence = np.array([r.presence(model.names) for r in batch])
            writer.write_rows(
                [r.id for r in batch], [r.payload_json for r in batch], presence, embs
            )
    writer.close()
    assert got.manifest["rejected"] == [r.to_dict() for r in rejected]
    ids = [r.id for r in accepted]
    assert [r["id"] for r in got.records] == ids
    assert [got.records.payload_json(i) for i in range(len(ids))] == [
        r.payload_json for r in accepted
    ]
    ref_presence = np.load(ref_dir / "records" / "presence.npy")
    assert np.array_equal(np.asarray(got.records.presence), ref_presence)
    for n in model.names:
        ref = np.load(ref_dir / "embeddings" / f"{n}.npy")
        assert np.allclose(np.asarray(got.stored.embeddings[n]), ref, atol=1e-6), n


def test_a_directory_of_shards_reads_as_their_concatenation(tmp_path: Path, capsys) -> None:
    rows = vector_records(90, DIMS, seed=5)
    (tmp_path / "in").mkdir()
    for k in range(3):
        write_jsonl(tmp_path / "in" / f"part-{k}.jsonl", rows[30 * k : 30 * (k + 1)])
    write_jsonl(tmp_path / "all.jsonl", rows)
    model_dir = make_model_dir(tmp_path / "m")
    for src, root in (
        (tmp_path / "in", "d"),
        (tmp_path / "in" / "part-*.jsonl", "g"),
        (tmp_path / "all.jsonl", "f"),
    ):
        assert index_build(model_dir, src, tmp_path / root) == 0
    versions = [LoadedVersion(artifact.current_version_dir(tmp_path / r)) for r in "dgf"]
    for v in versions[:2]:
        assert list(v.records) == list(versions[2].records)
        for n in v.names:
            assert np.array_equal(v.stored.embeddings[n], versions[2].stored.embeddings[n])
    # a duplicate across files names both, with their files
    write_jsonl(tmp_path / "in" / "part-3.jsonl", [dict(rows[0], id=rows[31]["id"])])
    assert index_build(model_dir, tmp_path / "in", tmp_path / "x") == 2
    err = capsys.readouterr().err
    dup = rows[31]["id"]
    assert f"line 1 of part-3.jsonl, id '{dup}': duplicate id, first seen on line 2 of " in err
    assert index_build(model_dir, tmp_path / "in", tmp_path / "x", "--skip-bad") == 0
    m = artifact.read_manifest(artifact.current_version_dir(tmp_path / "x"))
    assert m["rejected"] == [
        {
            "file": "part-3.jsonl",
            "line": 1,
            "id": rows[31]["id"],
            "reason": "duplicate id, first seen on line 2 of part-1.jsonl",
        }
    ]


def test_records_inputs_that_are_not_there(tmp_path: Path, capsys) -> None:
    model_dir = make_model_dir(tmp_path / "m")
    (tmp_path / "empty").mkdir()
    assert index_build(model_dir, tmp_path / "empty", tmp_path / "root") == 2
    assert "no .jsonl or .parquet records files in directory" in capsys.readouterr().err
    assert index_build(model_dir, tmp_path / "nothing-*.jsonl", tmp_path / "root") == 2
    assert "no records files match" in capsys.readouterr().err
    write_jsonl(tmp_path / "empty" / "a.jsonl", vector_records(3, DIMS))
    pq.write_table(pa.table({"id": ["z"]}), tmp_path / "empty" / "b.parquet")
    assert index_build(model_dir, tmp_path / "empty", tmp_path / "root") == 2
    assert "mixes Parquet and JSON Lines files" in capsys.readouterr().err


COMPACT_PAYLOAD_CASES = [
    '{"a":1,"a":2}',  # a duplicate key: kept once, so not as written
    '{"s":"\\u00e9"}',  # an escape that orjson writes as the character
    '{"x":1e5}',  # written back as 100000.0
    '{"n":123456789012345678901234}',  # too big to store
    '{"a":\n1}',  # a newline inside
    '{"a":',  # cut short, then the next row reads as if it closed it:
    "1}{}",
    " {}",  # a space before
    "[1]",
    "",
]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("bad", [None, *COMPACT_PAYLOAD_CASES])
def test_compact_payloads_match_the_validator(tmp_path: Path, monkeypatch, bad, fmt) -> None:
    """Payloads already in orjson's compact form are kept as they are, a chunk at a time; a
    chunk with any other payload, whatever its oddity, gets the reference's answer."""
    model = load_model(make_model_dir(tmp_path / "m"))
    rows: list[dict[str, Any]] = vector_records(30, DIMS, seed=5)
    for i, r in enumerate(rows):
        payload = {"i": i, "s": "ünï ☃", "f": 0.5, "l": [1, None]}
        r["payload"] = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    if bad is not None:
        rows[10]["payload"] = bad
        rows[11]["payload"] = "1}{}" if bad == '{"a":' else rows[11]["payload"]
    rows[12]["payload"] = None  # no payload at all: stored as {}
    if fmt == "parquet":
        path = tmp_path / "r.parquet"
        pq.write_table(parquet_table(rows, lambda d: pa.list_(pa.float32(), d)), path)
        name = "_canonical_payloads"
    else:  # the payload's text goes into the line as it is
        path = tmp_path / "r.jsonl"
        lines = []
        for r in rows:
            vectors = "".join(f',"{m}":{json.dumps(r[m])}' for m in DIMS)
            payload = "" if r["payload"] is None else f',"payload":{r["payload"]}'
            lines.append(f'{{"id":"{r["id"]}"{payload}{vectors}}}\n')
        path.write_text("".join(lines))
        name = "_canonical"
    kept: list[bool] = []
    canonical = getattr(ChunkChecker, name)

    def spy(*args):
        out = canonical(*args)
        kept.append(out is not None)
        return out

    monkeypatch.setattr(ChunkChecker, name, spy if fmt == "parquet" else staticmethod(spy))
    assert_same(model, RecordFiles.resolve(path))
    assert any(kept)  # chunks of clean rows (of 1 and 3 rows) kept their payloads as written
    if bad is not None and (fmt == "parquet" or odd_in_its_line(bad)):
        assert not all(kept)  # and the chunks with the odd one did not


def odd_in_its_line(payload: str) -> bool:
    """In a JSON line, the payload is the odd one: the line is one valid line (else the line
    is refused before its payload is looked at) and the value has no blank around it (which
    is the line's, not the payload's)."""
    try:
        json.loads(f'{{"payload":{payload}}}')
    except json.JSONDecodeError:
        return False
    return "\n" not in payload and payload == payload.strip()
