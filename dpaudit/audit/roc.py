"""ROC summary: AUC exactly as measured (no max(AUC, 1 - AUC)), TPR at fixed low FPRs, each with its two-sided 95 %
Clopper-Pearson interval over the members (the threshold is read off the same non-members, so the FPR is the
empirical one: the interval is on the TPR at that threshold, as memaudit and the MIA literature report it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve

from dpaudit.audit.clopper_pearson import lower_rate, upper_rate

REPORTED_FPRS = (0.001, 0.01, 0.1)


@dataclass(frozen=True)
class RocSummary:
    auc: float
    tpr_at_fpr: dict[float, float]
    fpr: np.ndarray
    tpr: np.ndarray
    tpr_interval: dict[float, tuple[float, float]] | None = None
    negatives: int = 0      # the non-members the FPR is read off (an FPR below 1/negatives means nothing)


def summarise(scores: np.ndarray, members: np.ndarray, fprs=REPORTED_FPRS) -> RocSummary:
    fpr, tpr, _ = roc_curve(members, scores)
    auc = float(roc_auc_score(members, scores))
    # Highest TPR reachable by a threshold whose FPR does not exceed the target.
    at = {float(x): float(tpr[fpr <= x].max()) for x in fprs}

    n = int(np.sum(members))
    interval = {x: (lower_rate(round(v * n), n, 0.025), upper_rate(round(v * n), n, 0.025)) for x, v in at.items()}
    return RocSummary(auc=auc, tpr_at_fpr=at, fpr=fpr, tpr=tpr, tpr_interval=interval,
                      negatives=int(len(members) - n))
