"""PNG plots: epsilon against sigma or steps, and ROC curves of an audit."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dpaudit.core.atomic import atomic_write  # noqa: E402


def save_figure(fig, path: Path) -> Path:
    try:
        return atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)


def epsilon_curve(xs: Sequence[float], eps: Sequence[float], *, x_label: str, title: str, path: Path,
                  target: float | None = None, marker: float | None = None, log_x: bool = True) -> Path:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, eps, marker="o", markersize=3, label=f"eps (upper bound) at each {x_label.split(' (')[0]}")
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # 0.3, 2, 40: never 3x10^-1 squeezed beside 4x10^-1
    axes = ((ax.xaxis, ax.set_xscale) if log_x else ()), (ax.yaxis, ax.set_yscale)
    for axis, set_scale in filter(None, axes):
        set_scale("log")
        axis.set_major_locator(LogLocator(base=10))
        axis.set_major_formatter(plain)
        axis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
        axis.set_minor_formatter(plain if _decades(axis, xs if axis is ax.xaxis else eps) <= 2 else NullFormatter())
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", label=f"target eps = {target:g}")
    if marker is not None:
        ax.axvline(marker, color="tab:green", linestyle=":", label=f"calibrated = {marker:.4g}")
    ax.set_xlabel(x_label)
    ax.set_ylabel("epsilon (upper bound)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _decades(axis, values) -> float:
    """How many powers of ten the values span (minor labels only where few major ones show)."""

    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return math.log10(max(positive) / min(positive)) if positive else 0.0


def roc_plot(fpr, tpr, auc: float, path: Path, score: str = "-loss of the secret", forbidden=None) -> Path:
    """ROC on linear axes and with a log-scale FPR (where low-FPR leakage shows); ``forbidden``: (fpr, the most
    TPR the claim allows), shaded above as the region the claim forbids."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, log in zip(axes, (False, True)):
        if forbidden is not None:
            ax.fill_between(forbidden[0], forbidden[1], 1.0, color="tab:red", alpha=0.15, step=None,
                            label="forbidden by the claim")
        ax.plot(fpr, tpr, label=f"AUC = {auc:.3f}", drawstyle="steps-post")
        lo = 1e-3 if log else 0.0
        ax.plot([max(lo, 1e-4), 1], [max(lo, 1e-4), 1], color="grey", linestyle="--", label="chance")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(1e-3, 1)
            ax.set_ylim(1e-3, 1)
        ax.set_xlabel("false positive rate" + (" (log)" if log else ""))
        ax.set_ylabel("true positive rate" + (" (log)" if log else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(f"Membership inference on canaries (score: {score})", fontsize=10)
    return save_figure(fig, path)
