"""`hclip bench expressivity`: sum-of-pairs CLIP cannot represent a pure three-way interaction.

Two synthetic three-modality datasets over K symbols, each modality seeing its symbol through its
own random codebook plus Gaussian noise:
- shared factor: one symbol s, shown in all three modalities (pairwise dependence);
- pure interaction: a and b uniform and independent, c = (a + b) mod K. Every pair of modalities
  is independent, so any pairwise score carries no information about the third.
Each head trains with the same budget; held-out retrieval (fresh noise) is scored by top-1
accuracy in every view, next to the chance level measured on the same gallery.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModalityConfig, ModelConfig, TrainConfig
from models.extras import require
from models.heads import default_views, split_modalities, view_name
from models.metrics import first_relevant_rank, hit_at
from models.model import MultimodalModel
from models.train.data import TupleDataset
from models.train.trainer import train_model

log = logging.getLogger(__name__)

Relation = Callable[[dict[str, np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class Task:
    name: str
    names: tuple[str, ...]
    symbols: Callable[[np.random.Generator, int], dict[str, np.ndarray]]
    relevant: Relation  # symbols of full tuples (N, ...) -> (N,) bool


def _shared_symbols(names: Sequence[str], k: int) -> Callable[[np.random.Generator, int], dict]:
    def draw(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        s = rng.integers(0, k, n)
        return {name: s for name in names}

    return draw


def _all_equal(sym: dict[str, np.ndarray]) -> np.ndarray:
    vals = list(sym.values())
    return np.logical_and.reduce([v == vals[0] for v in vals[1:]])


def _sum_symbols(k: int) -> Callable[[np.random.Generator, int], dict]:
    def draw(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        a, b = rng.integers(0, k, n), rng.integers(0, k, n)
        return {"a": a, "b": b, "c": (a + b) % k}

    return draw


def tasks(k: int) -> list[Task]:
    return [
        Task("shared_factor", ("a", "b", "c"), _shared_symbols("abc", k), _all_equal),
        Task(
            "pure_interaction",
            ("a", "b", "c"),
            _sum_symbols(k),
            lambda s: s["c"] == (s["a"] + s["b"]) % k,
        ),
        Task("two_modalities", ("a", "b"), _shared_symbols("ab", k), _all_equal),
    ]


@dataclass
class Synth:
    """Codebooks per modality; inputs are codebook rows plus noise."""

    k: int
    dim: int
    noise: float
    codebooks: dict[str, np.ndarray]

    @staticmethod
    def make(names: Sequence[str], k: int, dim: int, noise: float, seed: int) -> Synth:
        rng = np.random.default_rng(seed)
        books = {n: rng.standard_normal((k, dim)).astype(np.float32) for n in names}
        return Synth(k, dim, noise, books)

    def inputs(
        self, sym: dict[str, np.ndarray], rng: np.random.Generator
    ) -> dict[str, torch.Tensor]:
        out = {}
        for n, s in sym.items():
            x = self.codebooks[n][s] + self.noise * rng.standard_normal((len(s), self.dim))
            out[n] = torch.from_numpy(x.astype(np.float32))  # (N, dim)
        return out


def make_dataset(x: dict[str, torch.Tensor], sym: dict[str, np.ndarray]) -> TupleDataset:
    # Every noisy sample of one symbol is the same underlying input, so duplicates are judged on
    # the symbol: rows sharing it are never treated as each other's negatives.
    items = {n: list(v) for n, v in x.items()}
    keys = {n: torch.as_tensor(s, dtype=torch.int64) for n, s in sym.items()}
    return TupleDataset(items=items, keys=keys)


@torch.no_grad()
def evaluate(
    model: MultimodalModel,
    task: Task,
    xq: dict[str, torch.Tensor],
    sq: dict[str, np.ndarray],
    xg: dict[str, torch.Tensor],
    sg: dict[str, np.ndarray],
) -> dict[str, dict[str, float]]:
    """Top-1 accuracy and chance per view: queries' Q part against the gallery's T part."""
    embq = {n: model.encode(n, list(v)) for n, v in xq.items()}
    embg = {n: model.encode(n, list(v)) for n, v in xg.items()}
    out = {}
    for view in default_views(task.names):
        q, t = split_modalities(model.names, view)
        scores = model.head.query_factor(embq, q) @ model.head.record_factor(embg, t).T  # (Nq, G)
        nq, ng = scores.shape
        # relevance of every (query, gallery) combination, to measure chance exactly
        combo = {n: np.repeat(sq[n], ng) for n in q} | {n: np.tile(sg[n], nq) for n in t}
        rel = task.relevant(combo).reshape(nq, ng)
        ranks = first_relevant_rank(scores, torch.from_numpy(rel)).numpy()  # (Nq,)
        out[view_name(view)] = {"top1": hit_at(ranks, 1), "chance": float(rel.mean())}
    return out


HEAD_RUNS: list[tuple[str, str, str]] = [  # (label, head, loss)
    ("hclip", "hclip", "full_conditional"),
    ("symile", "symile", "full_conditional"),
    ("sum_of_pairs (pairwise loss)", "sum_of_pairs", "pairwise"),
    ("sum_of_pairs (full-conditional loss)", "sum_of_pairs", "full_conditional"),
]
M2_RUNS: list[tuple[str, str, str]] = [
    ("hclip", "hclip", "full_conditional"),
    ("clip", "clip", "pairwise"),
]


@dataclass(frozen=True)
class BenchSettings:
    symbols: int = 32
    input_dim: int = 16
    noise: float = 0.3
    latent_dim: int = 64
    hidden: int = 128
    train_size: int = 8192
    epochs: int = 12
    batch_size: int = 256
    lr: float = 3e-3
    queries: int = 1000
    gallery: int = 1000
    seed: int = 0
    threads: int = 2
    queue_size: int = 0  # negatives from earlier batches (train.queue_size); 0: the batch alone


def run_task(task: Task, s: BenchSettings, progress: bool) -> dict[str, Any]:
    synth = Synth.make(task.names, s.symbols, s.input_dim, s.noise, s.seed)
    rng = np.random.default_rng(s.seed + 1)
    sym_train = task.symbols(rng, s.train_size)
    data = make_dataset(synth.inputs(sym_train, rng), sym_train)
    sq, sg = task.symbols(rng, s.queries), task.symbols(rng, s.gallery)
    xq, xg = synth.inputs(sq, rng), synth.inputs(sg, rng)
    runs = M2_RUNS if len(task.names) == 2 else HEAD_RUNS
    results: dict[str, Any] = {}
    for label, head, loss in runs:
        mods = {
            n: ModalityConfig(kind="vector", dim=s.input_dim, hidden=s.hidden) for n in task.names
        }
        mcfg = ModelConfig(modalities=mods, head=head, latent_dim=s.latent_dim)
        tcfg = TrainConfig(
            records="<synthetic>",
            epochs=s.epochs,
            batch_size=s.batch_size,
            lr=s.lr,
            seed=s.seed,
            loss=loss,
            log_every=10**9,
            num_threads=s.threads,
            # The queue extends the full-conditional loss; the pairwise baselines train as ever.
            queue_size=s.queue_size if loss == "full_conditional" else 0,
            device="cpu",  # small models: a GPU would not help, and results stay comparable
        )
        t0 = time.perf_counter()
        trained = train_model(mcfg, tcfg, data, progress=progress)
        seconds = time.perf_counter() - t0
        views = evaluate(trained.model, task, xq, sq, xg, sg)
        final = trained.history[-1]
        results[label] = {
            "head": head,
            "loss": loss,
            "train_seconds": round(seconds, 1),
            "views": views,
            "final_loss": final["loss"],
            "mi_bound_bits": final["mi_bound_bits"],
            "ceiling_bits": final["ceiling_bits"],
        }
        log.info(
            "%s / %s: %s (%.0fs)",
            task.name,
            label,
            ", ".join(f"{v}={r['top1']:.3f}" for v, r in views.items()),
            seconds,
        )
    return results


def markdown_table(results: dict[str, Any]) -> str:
    lines = []
    for task, runs in results["tasks"].items():
        views = list(next(iter(runs.values()))["views"])
        lines.append(f"### {task}\n")
        lines.append("| head | " + " | ".join(f"query `{v}`" for v in views) + " |")
        lines.append("|---" * (len(views) + 1) + "|")
        chance = next(iter(runs.values()))["views"]
        lines.append(
            "| *chance* | " + " | ".join(f"*{chance[v]['chance']:.3f}*" for v in views) + " |"
        )
        for label, r in runs.items():
            lines.append(
                f"| {label} | " + " | ".join(f"{r['views'][v]['top1']:.3f}" for v in views) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    require("matplotlib", "bench", "the benchmark's plot").use("Agg")
    import matplotlib.pyplot as plt

    tasks_ = results["tasks"]
    fig, axes = plt.subplots(1, len(tasks_), figsize=(6 * len(tasks_), 4.2), squeeze=False)
    for ax, (task, runs) in zip(axes[0], tasks_.items(), strict=True):
        views = list(next(iter(runs.values()))["views"])
        width = 0.8 / len(runs)
        for i, (label, r) in enumerate(runs.items()):
            xs = np.arange(len(views)) + (i - (len(runs) - 1) / 2) * width
            ax.bar(xs, [r["views"][v]["top1"] for v in views], width, label=label)
        chance = next(iter(runs.values()))["views"]
        for j, v in enumerate(views):
            ax.hlines(chance[v]["chance"], j - 0.45, j + 0.45, colors="k", linestyles="dashed")
        ax.set_xticks(np.arange(len(views)), [f"query {v}" for v in views], rotation=30)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{task} (dashed: chance)")
        ax.set_ylabel("held-out top-1 accuracy")
        ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


READING_NOTE = """\
How to read the pure interaction. In the views that query with two modalities and retrieve the
third, p(target | query) carries no pairwise information at all, and sum-of-pairs stays near
chance: no sum of pairwise terms can single out c = (a + b) mod K. The views that query with one
modality and retrieve a pair are weaker tests: top-1 needs only one consistent pair, and a pairwise
score can produce one, e.g. f(a, c) = [c = a] plus a bonus for b = 0 picks (b, c) = (0, a).
Contrastive training on consistent triples drifts toward such shortcuts, so sum-of-pairs lands
above chance there while its full conditional p(b, c | a) stays wrong; H-CLIP gets every view
right.
"""


def run(
    out: Path,
    settings: BenchSettings,
    progress: bool = True,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    results: dict[str, Any] = {"settings": settings.__dict__, "tasks": {}}
    for task in tasks(settings.symbols):
        if only is None or task.name in only:
            results["tasks"][task.name] = run_task(task, settings, progress)
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    queue = (
        f", a queue of {settings.queue_size} negatives for the full-conditional runs"
        if settings.queue_size
        else ""
    )
    default_batch = settings.batch_size == BenchSettings.batch_size
    batch = "" if default_batch else f", batch {settings.batch_size}"
    header = (
        f"# Expressivity benchmark\n\nHeld-out top-1 retrieval accuracy, K = {settings.symbols} "
        f"symbols, {settings.train_size} training tuples, {settings.epochs} epochs per head"
        f"{batch}{queue}, {results['total_seconds']:.0f} s in all.\n\n"
    )
    (out / "results.md").write_text(header + markdown_table(results) + "\n" + READING_NOTE)
    plot(results, out / "expressivity.png")
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("bench-out/expressivity"))
    p.add_argument("--symbols", type=int, default=BenchSettings.symbols, help="K")
    p.add_argument("--epochs", type=int, default=BenchSettings.epochs)
    p.add_argument("--train-size", type=int, default=BenchSettings.train_size)
    p.add_argument("--seed", type=int, default=BenchSettings.seed)
    p.add_argument("--batch-size", type=int, default=BenchSettings.batch_size)
    p.add_argument(
        "--queue-size",
        type=int,
        default=BenchSettings.queue_size,
        help="negatives kept from earlier batches (0: none)",
    )
    p.add_argument("--threads", type=int, default=BenchSettings.threads, help="torch threads")
    p.add_argument(
        "--tasks",
        help=f"comma-separated subset of {','.join(t.name for t in tasks(2))} (default: all)",
    )
    p.add_argument("--quiet", action="store_true")


def main_args(args: argparse.Namespace) -> int:
    known = [t.name for t in tasks(2)]
    only = args.tasks.split(",") if args.tasks else None
    bad = [t for t in only or [] if t not in known]
    if (
        args.symbols < 2
        or args.epochs < 1
        or args.batch_size < 2
        or args.train_size < 2 * args.batch_size
        or args.queue_size < 0
        or args.threads < 1
        or bad
    ):
        raise SystemExit(
            f"hclip bench expressivity: error: need --symbols >= 2, --epochs >= 1, "
            f"--batch-size >= 2, --train-size >= 2 x batch size, --queue-size >= 0, "
            f"--threads >= 1 and --tasks among {','.join(known)}"
        )
    settings = BenchSettings(
        symbols=args.symbols,
        epochs=args.epochs,
        train_size=args.train_size,
        seed=args.seed,
        batch_size=args.batch_size,
        queue_size=args.queue_size,
        threads=args.threads,
    )
    results = run(args.out, settings, progress=not args.quiet, only=only)
    print(markdown_table(results))
    print(
        f"results in {args.out}/results.json, results.md, expressivity.png "
        f"({results['total_seconds']:.0f} s)"
    )
    return 0
