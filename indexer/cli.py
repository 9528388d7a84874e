"""`hclip index build|update|tune|list|verify|gc`."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from indexer.build.ray_address import ClusterError
from indexer.search.specs import DEFAULT_TARGET_RECALL, IndexSpec, SpecError
from indexer.store import artifact
from indexer.tune.defaults import FAMILIES, MIN_SPEEDUP, MIN_TIMING_S, SERVED_BATCH

if TYPE_CHECKING:
    from indexer.build.options import JobOptions

# The jobs themselves (torch, FAISS) are imported by the command that runs them, so that help
# and argument errors answer at once.
USER_ERRORS = (artifact.ArtifactError, artifact.BackendUnavailable, SpecError, ClusterError)
BACKENDS = ("faiss", "milvus")
ENGINES = ("local", "ray")
ROOT_HELP = "the index root: every version lives under it (docs/design.md §5)"
FIELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="index_command", required=True)

    def job_options(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--spec",
            help="flat (default) | auto[:recall=0.95] (measure and pick) | hnsw[:M=..,"
            "ef_search=..] | ivf[:nlist=..,nprobe=..] | ivfip[:nlist=..,nprobe=..] | "
            "ivfpq[:nlist=..,m=..,nbits=..,nprobe=..,rerank=..] | ivfsq[:nlist=..,nprobe=..] | "
            "sq8[:rerank=..] (8-bit codes, re-ranked exactly)",
        )
        sp.add_argument(
            "--views",
            help="comma-separated query sets (a,b+c); default: each modality, and for 3 or more "
            "modalities each all-but-one set",
        )
        sp.add_argument(
            "--batch-size", type=int, default=256, help="records per encoder call (default 256)"
        )
        sp.add_argument(
            "--skip-bad",
            action="store_true",
            help="report bad records and leave them out instead of failing",
        )
        sp.add_argument(
            "--media-root",
            type=Path,
            metavar="DIR",
            help="media paths in records may lead anywhere inside DIR (default: only inside "
            "the records file's folder); paths out of it, symlinks included, are bad records",
        )
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.add_argument(
            "--engine",
            choices=ENGINES,
            default="local",
            help="local: this process (default); ray: Ray Data, on a local Ray or a cluster "
            "(needs the 'ray' extra)",
        )
        sp.add_argument(
            "--ray-address",
            help="with --engine ray: an existing cluster (auto, ray://HOST:10001); default: "
            "start a local Ray for this job and stop it afterwards",
        )
        sp.add_argument(
            "--workers",
            type=int,
            help="with --engine ray: encoding actors, each loading the model once (default: "
            "one per CPU of the local Ray, or of the cluster)",
        )
        sp.add_argument(
            "--filter-fields",
            help="comma-separated payload fields that searches may filter on (equality, in, "
            "numeric ranges); default: none at build, the current version's at update",
        )
        sp.add_argument(
            "--backend",
            choices=BACKENDS,
            help="where the views live: faiss (memory-mapped files under the root) or milvus "
            "(collections in Milvus, needs the 'milvus' extra); default: the root's, else faiss",
        )
        sp.add_argument(
            "--milvus-uri",
            help="with --backend milvus: a Milvus Lite data path or http://HOST:19530 (token "
            "from HCLIP_MILVUS_TOKEN); default: the root's",
        )
        sp.add_argument(
            "--shards", type=int, default=1, help="with --backend milvus: shards per collection"
        )
        sp.add_argument(
            "--compact",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="store embeddings as float16 and each product view only as FAISS codes "
            "(--spec sq8[:rerank=R], the default, auto[:recall=R], ivfsq or ivfpq), every "
            "search re-ranked "
            "exactly from the float16 embeddings (docs/design.md §5); default: full at build, "
            "the current version's form at update (--no-compact makes it full)",
        )
        sp.add_argument(
            "--device",
            choices=("auto", "cpu", "cuda"),
            default="auto",
            help="where the local engine runs the encoders: auto (a GPU when torch sees one, "
            "under bf16 autocast where it supports it), cpu or cuda",
        )

    b = sub.add_parser("build", help="encode records and publish a new version")
    b.add_argument(
        "--model", required=True, type=Path, help="the model directory (`hclip train --out`)"
    )
    b.add_argument(
        "--records",
        required=True,
        type=Path,
        help="JSON Lines or Parquet: a file, a directory of them or a glob (quoted)",
    )
    b.add_argument(
        "--root",
        required=True,
        type=Path,
        help=f"{ROOT_HELP}; created if missing",
    )
    job_options(b)
    b.set_defaults(func=_build)

    u = sub.add_parser("update", help="a new version from the current one: deletes, then upserts")
    u.add_argument("--root", required=True, type=Path, help=ROOT_HELP)
    u.add_argument(
        "--upsert",
        type=Path,
        help="records to add or replace (JSON Lines or Parquet: a file, a directory or a glob)",
    )
    u.add_argument("--delete", type=Path, help="ids to remove, one per line")
    u.add_argument("--model", type=Path, help="default: the model that built the current version")
    job_options(u)
    u.set_defaults(func=_update)

    _tune_parser(sub)

    ls = sub.add_parser("list", help="list versions")
    ls.add_argument("--root", required=True, type=Path, help=ROOT_HELP)
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    ls.set_defaults(func=_list)

    v = sub.add_parser("verify", help="check checksums and view contents")
    v.add_argument("--root", required=True, type=Path, help=ROOT_HELP)
    v.add_argument("--version", help="one version (default: all)")
    v.set_defaults(func=_verify)

    r = sub.add_parser(
        "rollback",
        help="publish an older version again (default: the newest before the published one), "
        "after checking every file's checksum; the servers swap to it as to a new version",
    )
    r.add_argument("--root", required=True, type=Path, help=ROOT_HELP)
    r.add_argument("--to", metavar="VERSION", help="the version to publish (`hclip index list`)")
    r.set_defaults(func=_rollback)

    g = sub.add_parser("gc", help="keep the newest N versions and the published one")
    g.add_argument("--root", required=True, type=Path, help=ROOT_HELP)
    g.add_argument("--keep", type=int, default=3, help="the newest versions to keep (default 3)")
    g.set_defaults(func=_gc)


def _options(args: argparse.Namespace, names: list[str]) -> JobOptions:
    from indexer.build.options import JobOptions
    from indexer.build.views import parse_views

    if args.batch_size < 1:
        raise SpecError("--batch-size must be at least 1")
    if args.workers is not None and args.workers < 1:
        raise SpecError("--workers must be at least 1")
    if args.engine != "ray" and (args.ray_address or args.workers is not None):
        raise SpecError("--ray-address and --workers go with --engine ray")
    if args.shards < 1:
        raise SpecError("--shards must be at least 1")
    if args.backend == "faiss" and (args.milvus_uri or args.shards != 1):
        raise SpecError("--milvus-uri and --shards go with --backend milvus")
    opts = JobOptions(
        batch_size=args.batch_size,
        skip_bad=args.skip_bad,
        progress=not args.quiet,
        engine=args.engine,
        ray_address=args.ray_address,
        workers=args.workers,
        backend=args.backend,
        milvus_uri=args.milvus_uri,
        shards=args.shards,
        device=args.device,
        media_root=args.media_root,
        compact=args.compact,
    )
    if args.spec:
        opts.spec = IndexSpec.parse(args.spec)
    if args.views:
        try:
            opts.views = parse_views(args.views, names)
        except ValueError as exc:
            raise SpecError(f"--views: {exc}") from None
    if args.filter_fields is not None:
        fields = tuple(f.strip() for f in args.filter_fields.split(",") if f.strip())
        bad = [f for f in fields if not FIELD_NAME.match(f)]
        if bad:
            raise SpecError(
                f"--filter-fields: {bad[0]!r} is not a field name (letters, digits, _-.)"
            )
        opts.filter_fields = fields
    return opts


def _build(args: argparse.Namespace) -> int:
    from indexer.build.build_job import build
    from indexer.build.options import summary
    from models.checkpoint import read_config

    cfg, _ = read_config(args.model)
    result = build(args.model, args.records, args.root, _options(args, cfg.names))
    print("\n".join(summary(result)))
    return 0


def _update(args: argparse.Namespace) -> int:
    from indexer.build.options import summary
    from indexer.build.update_job import update

    vdir = artifact.current_version_dir(args.root)
    names = artifact.read_manifest(vdir)["modalities"]
    result = update(
        args.root,
        args.upsert,
        args.delete,
        _options(args, names),
        args.model,
        spec_given=bool(args.spec),
    )
    if result is None:
        print(
            f"nothing to change: no record upserted or deleted (ids to delete not present, or "
            f"every upsert rejected); version {vdir.name} stays published, none is added"
        )
        return 0
    print("\n".join(summary(result)))
    info = result.manifest["update"]
    print(
        f"  kept {info['kept']} stored rows, encoded {info['encoded']} "
        f"({info['replaced']} replacing stored ones), deleted {info['deleted']}"
    )
    if info["deleted_not_found"]:
        print(f"  ids to delete that were not present: {', '.join(info['deleted_not_found'][:20])}")
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = artifact.list_versions(args.root)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"{args.root}: no versions")
    for r in rows:
        mark = "*" if r["current"] else " "
        if "error" in r:
            print(f"{mark} {r['version']}  ERROR {r['error']}")
        else:
            print(
                f"{mark} {r['version']}  {r['created']}  {r['records']:>9} records  "
                f"parent {r['parent'] or '-'}  views {','.join(r['views'])}"
                f"{'  compact' if r['compact'] else ''}"
            )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from indexer.store.verify import verify

    names = (
        [args.version]
        if args.version
        else [r["version"] for r in artifact.list_versions(args.root)]
    )
    if not names:
        raise artifact.ArtifactError(f"{args.root}: no versions to verify")
    bad = 0
    for name in names:
        problems = verify(artifact.version_dir(args.root, name))
        print(f"{name}: {'ok' if not problems else 'FAILED'}")
        for p in problems:
            print(f"  {p}")
        bad += bool(problems)
    try:
        artifact.published(args.root)
    except artifact.CurrentError as exc:
        print(f"CURRENT: FAILED\n  {exc}")
        bad += 1
    return 1 if bad else 0


def _rollback(args: argparse.Namespace) -> int:
    from indexer.store import milvus
    from indexer.store.verify import verify_files

    was, now = artifact.rollback(args.root, args.to, verify_files)
    print(f"published version {now} again (was {was or 'none'})")
    milvus.point_aliases(artifact.read_manifest(artifact.version_dir(args.root, now)))
    return 0


def _gc(args: argparse.Namespace) -> int:
    from indexer.store import milvus

    removed = artifact.gc(args.root, args.keep)
    print(f"removed {len(removed)} version(s){': ' + ', '.join(removed) if removed else ''}")
    with artifact.root_lock(args.root, "gc"):
        dropped = milvus.drop_unpublished(args.root)
    if dropped:
        print(f"dropped {len(dropped)} Milvus collection(s) of removed versions")
    return 0


def _tune_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`hclip index tune` (run by indexer.build.retune)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "tune",
        help="measure index families on the published version's views and publish a new "
        "version with the fastest that keeps the recall target",
    )
    p.add_argument("--root", required=True, type=Path, help=ROOT_HELP)
    p.add_argument("--view", help="comma-separated views to tune (default: all)")
    p.add_argument(
        "--recall",
        type=float,
        default=DEFAULT_TARGET_RECALL,
        help=f"recall@10 target (default {DEFAULT_TARGET_RECALL})",
    )
    p.add_argument(
        "--queries",
        type=Path,
        help="held-out queries: JSON Lines of /v1/search request bodies (e.g. a request log)",
    )
    p.add_argument(
        "--min-speedup",
        type=float,
        default=MIN_SPEEDUP,
        help="an index must serve this many times flat search's queries/s in batches of "
        f"--served-batch, and be as fast alone (default {MIN_SPEEDUP})",
    )
    p.add_argument(
        "--served-batch",
        type=int,
        default=SERVED_BATCH,
        help="the queries a worker searches at once under load (about the concurrent requests "
        f"over the workers; default {SERVED_BATCH})",
    )
    p.add_argument("--families", help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument(
        "--timing-seconds",
        type=float,
        default=MIN_TIMING_S,
        help=f"each speed measurement runs at least this long, twice (default {MIN_TIMING_S}; "
        "shorter is noisier)",
    )
    p.add_argument("--model", type=Path, help="default: the model that built the version")
    p.add_argument("--plot", type=Path, help="write each view's frontier as DIR/<view>.png")
    p.set_defaults(func=_tune)
    return p


def _tune(args: argparse.Namespace) -> int:
    from indexer.build import retune

    return retune.run(args)
