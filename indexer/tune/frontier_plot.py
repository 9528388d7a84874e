"""Drawing a tuner's frontier (indexer.tune's report): recall@10 against single-query speed
relative to flat search, one line per index structure (its effort sweep), the bytes per record
of each structure in the legend, the pick starred. matplotlib comes from the `bench` extra."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from models.extras import require

COLORS = {
    "hnsw": "tab:blue",
    "ivf": "tab:green",
    "ivfip": "tab:olive",
    "ivfpq": "tab:red",
    "ivfsq": "tab:purple",
}
STYLES = ("-", "--", ":", "-.")
X_MIN = 0.5  # recall below this is never a choice; the plot spends its width above it


def _panel(ax: Any, report: dict[str, Any], title: str) -> None:
    by_structure: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in report["frontier"]:
        by_structure[p.get("structure", p["spec"])].append(p)
    seen: dict[str, int] = defaultdict(int)
    for structure, points in by_structure.items():
        points.sort(key=lambda p: p["effort"] or 0)
        family = points[0]["family"]
        style = STYLES[seen[family] % len(STYLES)]
        seen[family] += 1
        label = f"{structure.split(',ef_search')[0].split(',nprobe')[0]} " + (
            f"({points[0]['bytes_per_record']:.0f} B/record)"
        )
        ax.plot(
            [p["recall_at_10"] for p in points],
            [p["speedup_single"] for p in points],
            style,
            marker="o",
            markersize=3,
            color=COLORS.get(family, "black"),
            label=label,
        )
    flat = report["flat"]
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.text(
        X_MIN + 0.005, 1.05, f"flat search ({flat['bytes_per_record']:.0f} B/record)", fontsize=7
    )
    ax.axvline(report["target_recall"], color="gray", linestyle="--", linewidth=0.8)
    picked = next((p for p in report["frontier"] if p["spec"] == report["picked"]), None)
    if picked is not None:
        ax.plot(
            [picked["recall_at_10"]],
            [picked["speedup_single"]],
            "*",
            color="gold",
            markersize=14,
            markeredgecolor="black",
            label=f"picked: {picked['spec']}",
        )
    ax.set_yscale("log")
    ax.set_xlim(X_MIN, 1.003)
    ax.set_xlabel("recall@10 (tune queries)")
    ax.set_ylabel("single-query q/s / flat")
    check = report.get("check", {})
    ax.set_title(
        f"{title}\npicked {report['picked']}: recall {check.get('recall_at_10')} on check "
        f"queries, {check.get('speedup_single')}x flat",
        fontsize=8,
    )
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=2, frameon=False)
    ax.grid(True, which="both", alpha=0.3)


def plot_panels(panels: Sequence[tuple[str, dict[str, Any]]], path: Path, cols: int = 2) -> None:
    """One panel per (title, tuning report), `cols` to a row, saved as a PNG."""
    require("matplotlib", "bench", "the frontier plot").use("Agg")
    import matplotlib.pyplot as plt

    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 6.0 * rows), squeeze=False)
    for ax, (title, report) in zip(axes.flat, panels, strict=False):
        _panel(ax, report, title)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_view(report: dict[str, Any], title: str, path: Path) -> None:
    plot_panels([(title, report)], path, cols=1)
