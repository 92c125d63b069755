"""PNG plots: epsilon against sigma or against steps (ROC curves live with the audit)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dpaudit.atomic import atomic_write  # noqa: E402


def save_figure(fig, path: Path) -> Path:
    try:
        return atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)


def epsilon_curve(xs: Sequence[float], eps: Sequence[float], *, x_label: str, title: str, path: Path,
                  target: float | None = None, marker: float | None = None, log_x: bool = True) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, eps, marker="o", markersize=3)
    if log_x:
        ax.set_xscale("log")
    ax.set_yscale("log")
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", label=f"target eps = {target:g}")
    if marker is not None:
        ax.axvline(marker, color="tab:green", linestyle=":", label=f"calibrated = {marker:.4g}")
    ax.set_xlabel(x_label)
    ax.set_ylabel("epsilon (upper bound)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if target is not None or marker is not None:
        ax.legend()
    return save_figure(fig, path)
