"""Named canary scores: what a score measures travels with it into the report (higher = member, always).

The statistics do not care what a score is; the headline bound does care whether it is a sum of
canary-aligned signals over many releases (then Gaussian, and the continuous audit applies).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpaudit.core.errors import DPAuditError


@dataclass(frozen=True)
class Score:
    name: str
    description: str
    white_box: bool = False
    gaussian_sum: bool = False  # a sum of canary-aligned signals over many releases (CLT)


SCORES = {s.name: s for s in (
    Score("neg-loss", "-loss of the secret token given its prefix (black box)"),
    Score("loss-vs-base", "loss of the secret on the base model minus on the audited model (black box, "
                          "difficulty-calibrated)"),
    Score("user-inference", "mean over a canary user's held-out records (never trained) of the secret's loss on the "
                            "base model minus on the audited model: user inference, Kandpal et al. 2023 (black box)"),
    Score("white-box-dp-sgd", "sum over steps of each released noisy gradient's alignment with the canary's "
                              "signed gradient direction, in units of C (white box)", True, True),
    Score("white-box-dp-zo", "correlation of the released DP-ZO scalars with the canary's sign pattern, in units "
                             "of C (white box)", True, True),
    Score("white-box-pipeline", "sum over steps of how far each canary's own input row moved along a canary "
                                "example's descent direction, standardised across the canaries each step (a "
                                "PipelineProbe: new-token canaries in the user's data, white box)", True, True),
    Score("unnamed", "a score file's own score (higher = member); its meaning was not given"),
)}


def get_score(name: str) -> Score:
    try:
        return SCORES[name]
    except KeyError:
        raise DPAuditError(f"unknown score {name!r}; use {', '.join(SCORES)}") from None
