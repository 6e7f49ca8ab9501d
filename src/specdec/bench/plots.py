"""A benchmark run's results (:func:`specdec.bench.report.results`) as four PNG plots."""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

from specdec.backends.table import TORCH
from specdec.bench.markdown import title

PLOTS = ("speedup.png", "accepted_per_step.png", "k_sweep.png", "predicted_vs_measured.png")


def plot(data: dict[str, Any], out: Path) -> list[Path]:
    """Write the four PNGs of :data:`PLOTS` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = data["methods"]
    heading = textwrap.fill(title(data), 90)
    paths = []
    for name, draw in zip(PLOTS, (_plot_speedup, _plot_histogram, _plot_k_sweep, _plot_predicted)):
        fig = draw(plt, methods)
        fig.suptitle(heading, fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def _color(m: dict[str, Any]) -> str:
    return "tab:gray" if m["kind"] == "peer" else "tab:blue"


def _plot_speedup(plt, methods):
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(methods)), 4))
    names = list(methods)
    x = range(len(names))
    ax.bar(x, [methods[n]["speedup_vs_ar"] or 0 for n in names], color=[_color(methods[n]) for n in names],
           label="total time ratio")
    ax.scatter(x, [methods[n]["speedup_vs_ar_geomean"] or 0 for n in names], color="black", zorder=3,
               marker="_", s=400, label="geomean over prompts")
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speed-up vs ar")
    ax.legend(fontsize=8)
    return fig


def _plot_histogram(plt, methods):
    fig, ax = plt.subplots(figsize=(7, 4))
    shown = {n: m["accepted_per_step_histogram"] for n, m in methods.items() if m["accepted_per_step_histogram"]}
    width = 0.8 / max(1, len(shown))
    for i, (name, counts) in enumerate(shown.items()):
        total = sum(counts)
        ax.bar([j + i * width for j in range(len(counts))], [c / total for c in counts], width=width, label=name)
    if not shown:
        ax.text(0.5, 0.5, "no speculative methods in this run", ha="center", transform=ax.transAxes)
    ax.set_xlabel("draft tokens accepted in one target forward")
    ax.set_ylabel("share of steps")
    if shown:
        ax.legend(fontsize=7)
    return fig


def _plot_k_sweep(plt, methods):
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    families: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for m in methods.values():
        spec = m["spec"]
        if spec["kind"] == "spec" and spec["verifier"] != "tree":
            backend = "" if spec.get("backend", TORCH) == TORCH else f" ({spec['backend']})"
            families[f"{spec['drafter']}:{spec['verifier']}:{spec['policy']}{backend}"].append((spec["k"], m))
    for family, points in families.items():
        points.sort(key=lambda p: p[0])
        ks = [k for k, _ in points]
        left.plot(ks, [m["speedup_vs_ar"] or 0 for _, m in points], marker="o", label=family)
        right.plot(ks, [m["mean_accepted_per_forward"] or 0 for _, m in points], marker="o", label=family)
    styles = iter([":", "-.", "--", (0, (1, 3)), (0, (5, 2, 1, 2))] * 4)
    for name, m in methods.items():
        if m["kind"] == "peer" and m["speedup_vs_ar"] is not None:
            left.axhline(m["speedup_vs_ar"], ls=next(styles), color="gray", label=f"{name} (peer)")
    left.axhline(1.0, color="red", lw=0.8, ls="--")
    left.set_xlabel("k (draft tokens per step)")
    left.set_ylabel("speed-up vs ar")
    right.set_xlabel("k (draft tokens per step)")
    right.set_ylabel("tokens per target forward")
    for ax in (left, right):
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:  # an empty legend is a warning from matplotlib
            ax.legend(fontsize=7)
    if not families:
        left.text(0.5, 0.5, "no chain methods in this run", ha="center", transform=left.transAxes)
    return fig


def _plot_predicted(plt, methods):
    fig, ax = plt.subplots(figsize=(5, 5))
    points = [(n, m["predicted_speedup"], m["speedup_vs_ar"]) for n, m in methods.items()
              if m["predicted_speedup"] is not None and m["speedup_vs_ar"] is not None]
    markers = iter("osD^v<>pXh*" * 4)
    for name, predicted, measured in points:
        ax.scatter(predicted, measured, color=_color(methods[name]), marker=next(markers), label=name)
    top = max([1.5] + [max(p, m) * 1.1 for _, p, m in points])
    ax.plot([0, top], [0, top], color="red", lw=0.8, ls="--", label="measured = predicted")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("predicted speed-up (measured α, k, c)")
    ax.set_ylabel("measured speed-up")
    ax.legend(fontsize=7)
    return fig
