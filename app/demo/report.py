"""The demo's results as Markdown tables and a bar plot: of one run, or summarised over seeds.

A results dict is `{"seed", "recipe", "datasets": {dataset: {head: {view: metrics}}}}` as
app/demo/pipeline.py writes it; a summary (`summarise`) holds, per cell, the mean, the minimum
and the maximum over runs of different seeds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.extras import require

METRICS = ("hit@1", "hit@5", "hit@10", "precision@10")
INTRO = (
    "Held-out images, voices and sentences; a result is relevant when its digits agree with the "
    "query's (same digit in `shared`, (image + audio) mod 10 = text in `interaction`). Chance is "
    "the gallery's share of relevant records."
)


def _views(heads: dict[str, Any]) -> list[str]:
    return list(next(iter(heads.values())))


def markdown(results: dict[str, Any]) -> str:
    """One run's tables."""
    lines = ["# Demo results: digits shown, spoken and written", "", INTRO, ""]
    lines += [f"Seed {results['seed']}; {describe(results['recipe'])}.", ""]
    for dataset, heads in results["datasets"].items():
        lines += [
            f"## {dataset}",
            "",
            "| query | head | hit@1 | hit@5 | hit@10 | precision@10 | chance p@10 "
            "| chance hit@10 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for view in _views(heads):
            for head, rows in heads.items():
                r = rows[view]
                lines.append(
                    f"| `{view}` | {head} | {r['hit@1']:.3f} | {r['hit@5']:.3f} | "
                    f"{r['hit@10']:.3f} | {r['precision@10']:.3f} | {r['chance_precision']:.3f} | "
                    f"{r['chance_hit@10']:.3f} |"
                )
        lines.append("")
    return "\n".join(lines)


def describe(recipe: dict[str, Any]) -> str:
    stages = ", then ".join(
        f"{s['dataset']} {s['steps']} steps"
        + (f" from the {s['warm_start']} model's encoders" if s["warm_start"] else "")
        for s in recipe["stages"]
    )
    return f"each head trained on {stages}, batches of {recipe['batch_size']} fresh tuples"


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, min and max over runs of every metric in every cell; the runs share a recipe."""
    if len({str(r["recipe"]) for r in runs}) != 1:
        raise ValueError("the runs were trained by different recipes")
    first = runs[0]["datasets"]
    cells: dict[str, Any] = {}
    for dataset, heads in first.items():
        for head, rows in heads.items():
            for view in rows:
                cell = cells.setdefault(dataset, {}).setdefault(head, {})[view] = {}
                for metric in (*METRICS, "chance_precision", "chance_hit@1"):
                    xs = np.array([r["datasets"][dataset][head][view][metric] for r in runs])
                    cell[metric] = {
                        "mean": float(xs.mean()),
                        "min": float(xs.min()),
                        "max": float(xs.max()),
                    }
    return {
        "seeds": [r["seed"] for r in runs],
        "recipe": runs[0]["recipe"],
        "datasets": cells,
        "runs": runs,
    }


def _cell(c: dict[str, float]) -> str:
    return f"{c['mean']:.3f} ({c['min']:.3f}-{c['max']:.3f})"


def summary_markdown(summary: dict[str, Any], extra: list[str] | None = None) -> str:
    """Mean (min-max) over seeds of every cell."""
    seeds = ", ".join(str(s) for s in summary["seeds"])
    lines = ["# Demo results: digits shown, spoken and written", "", INTRO, ""]
    lines += [
        f"Mean and (min-max) over seeds {seeds}: {describe(summary['recipe'])}. "
        "A run with a given seed and thread count reproduces its figures exactly on the same "
        "machine.",
        "",
        *(extra or []),
    ]
    for dataset, heads in summary["datasets"].items():
        lines += [
            f"## {dataset}",
            "",
            "| query | head | hit@1 | hit@5 | hit@10 | precision@10 | chance hit@1 |",
            "|---|---|---|---|---|---|---|",
        ]
        for view in _views(heads):
            for head, rows in heads.items():
                r = rows[view]
                lines.append(
                    f"| `{view}` | {head} | "
                    + " | ".join(_cell(r[m]) for m in METRICS)
                    + f" | {r['chance_hit@1']['mean']:.3f} |"
                )
        lines.append("")
    return "\n".join(lines)


def plot(datasets: dict[str, Any], path: Any, metric: str = "hit@1") -> None:
    """Bars of `metric` per view and head, with chance dashed. Cells may be plain numbers (one
    run) or {"mean", "min", "max"} (a summary, drawn as the mean with a min-max whisker)."""
    require("matplotlib", "demo", "the demo's results plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datasets), figsize=(12, 4.2), squeeze=False)
    for ax, (dataset, heads) in zip(axes[0], datasets.items(), strict=True):
        views = _views(heads)
        for i, (head, rows) in enumerate(heads.items()):
            xs = np.arange(len(views)) + (i - 0.5) * 0.4
            cells = [rows[v][metric] for v in views]
            summary = isinstance(cells[0], dict)
            if summary:
                mean = np.array([c["mean"] for c in cells])
                err = [mean - [c["min"] for c in cells], [c["max"] for c in cells] - mean]
                ax.bar(xs, mean, 0.4, label=head, yerr=err, capsize=3)
            else:
                ax.bar(xs, cells, 0.4, label=head)
        chance_key = "chance_hit@1" if metric == "hit@1" else "chance_precision"
        for j, v in enumerate(views):
            c = next(iter(heads.values()))[v][chance_key]
            c = c["mean"] if isinstance(c, dict) else c
            ax.hlines(c, j - 0.45, j + 0.45, colors="k", linestyles="dashed")
        ax.set_xticks(np.arange(len(views)), [f"query {v}" for v in views], rotation=30)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(f"{metric} (held out)")
        whiskers = "; whiskers: min-max over seeds" if summary else ""
        ax.set_title(f"{dataset} (dashed: chance{whiskers})")
    # One legend above the panels: inside them it would cover bars at 0.1 or at 1.0.
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
