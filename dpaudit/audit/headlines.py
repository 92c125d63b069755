"""The registry of eps lower bounds: each bound's name, how it is computed, why it is valid, what it is
valid for, and whether it needs delta > 0, in one table. The audit (``analysis.analyse``), the headline
rule, the report's "why valid" line and the CLI's --headline help are all read from it, so none can drift
from the others (tests/audit/test_audit_statistics.py compares the help with it).

A leaf module (no numpy at import): the CLI's help is built from it; each ``compute`` imports the
auditor when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dpaudit.audit.guesses import HullThresholds, TopGuesses

TOP_K = ("one-sided top-k guesses for counts k on a grid fixed in advance (at most 12, equal ones merged; "
         "label-free), alpha split over the distinct ones")
HULL = ("one-sided guesses at ROC-hull thresholds, alpha split over the hull's vertices (jax_privacy's rule; the "
        "hull is chosen with the labels, so this is slightly optimistic at the null)")
ANY_MECHANISM = "any (eps, delta)-DP mechanism"
GAUSSIAN_SHAPE = "mechanisms with a Gaussian trade-off curve (mu-GDP; DP-SGD/DP-ZO over many steps by the CLT)"
WHITE_BOX_SUMS = ("white-box scores that are sums of canary-aligned signals over many steps (Gaussian by the "
                  "CLT), from a mu-GDP mechanism or a Poisson-subsampled Gaussian one (G_mu at the score's shift "
                  "is below its accounted eps: tests/audit/test_audit_bounds.py)")
INDEPENDENT = "independent canaries (many runs); indicative in one run"
RUN_FAMILY = ("white-box sums from a run whose canaries are Poisson-sampled at its rate with Gaussian noise, each "
              "member adding at most C a step (the probes and the bundled white-box runs; audit/family.py); a "
              "PipelineProbe's only where its canaries' sampler audit passed and its steps are independent releases "
              "(no momentum)")


@dataclass(frozen=True)
class BoundSpec:
    name: str
    why: str                     # why the bound holds (the report's "why valid")
    valid_for: str               # the mechanisms it is valid for
    needs_delta: bool            # a Gaussian curve has no finite pure eps
    compute: Callable            # (CanaryScoreAuditor, alpha, delta, GuessCounts) -> Bound named ``name``
    headline: bool = True        # may decide the verdict (clopper-pearson: indicative only)
    white_box_only: bool = False  # computed for Gaussian-sum scores (or when asked for as the headline)
    needs_run: bool = False       # needs the run's family (rate, steps, the score's per-step function)


def _top():
    return TopGuesses()


def _hull():
    return HullThresholds()


BOUNDS: dict[str, BoundSpec] = {b.name: b for b in (
    BoundSpec("fdp-gdp", "f-DP one-run test (Mahloujifar et al. 2025) of the Gaussian trade-off family, the shape "
                         "DP-SGD and DP-ZO take over many steps; " + TOP_K, GAUSSIAN_SHAPE, True,
              lambda a, alpha, delta, counts: a.epsilon_one_run_fdp(alpha, delta, "gdp", _top())),
    BoundSpec("fdp-gdp-hull", "f-DP one-run test of the Gaussian family; " + HULL, GAUSSIAN_SHAPE, True,
              lambda a, alpha, delta, counts: a.epsilon_one_run_fdp(alpha, delta, "gdp", _hull())),
    BoundSpec("fdp", "f-DP one-run test of the (eps, delta) trade-off curve: valid for any (eps, delta)-DP "
                     "mechanism; " + TOP_K, ANY_MECHANISM, False,
              lambda a, alpha, delta, counts: a.epsilon_one_run_fdp(alpha, delta, "approx", _top())),
    BoundSpec("steinke", "Steinke et al. 2023 one-run bound, valid for any (eps, delta)-DP mechanism; " + TOP_K,
              ANY_MECHANISM, False, lambda a, alpha, delta, counts: a.epsilon_one_run(alpha, delta, _top())),
    BoundSpec("steinke-hull", "Steinke et al. 2023 one-run bound; " + HULL, ANY_MECHANISM, False,
              lambda a, alpha, delta, counts: a.epsilon_one_run(alpha, delta, _hull())),
    BoundSpec("steinke-two-sided", "Steinke et al. 2023 one-run bound with two-sided guesses at counts fixed in "
                                   "advance, alpha split over them", ANY_MECHANISM, False,
              lambda a, alpha, delta, counts: a.epsilon_one_run(alpha, delta, counts)),
    BoundSpec("gaussian", "white-box scores are sums over many released updates, hence Gaussian: the mean shift "
                          "of all m scores estimates mu (noncentral-t lower limit), converted to eps at delta "
                          "through G_mu", WHITE_BOX_SUMS, True,
              lambda a, alpha, delta, counts: a.epsilon_gaussian(alpha, delta), white_box_only=True),
    BoundSpec("gaussian-run", "white-box scores are sums over the run's releases: the mean shift of all m scores "
                              "(noncentral-t lower limit) is read through the run's own mechanism family (Poisson-"
                              "subsampled Gaussian at its p and T, exact moments of the score), and eps is the "
                              "least private member the shift refutes, from the pld accountant", RUN_FAMILY, True,
              lambda a, alpha, delta, counts: a.epsilon_gaussian_run(alpha, delta), white_box_only=True,
              needs_run=True),
    BoundSpec("clopper-pearson", "Clopper-Pearson intervals on TPR and FPR at each top-k threshold (Jagielski et "
                                 "al. 2020), treating canaries as independent trials", INDEPENDENT, False,
              lambda a, alpha, delta, counts: a.epsilon_clopper_pearson(alpha, delta, _top()), headline=False),
)}

WHY = {name: b.why for name, b in BOUNDS.items()}
HEADLINES = ("auto", *(name for name, b in BOUNDS.items() if b.headline))
AUTO_RULE = ("auto: steinke at delta = 0; else fdp for a non-Gaussian mechanism (Laplace); else gaussian-run for "
             "white-box sums of a run whose rate p < 1 and steps are known, gaussian for other white-box sums, fdp-gdp "
             "otherwise")


SCOPES = {ANY_MECHANISM: "any mechanism", GAUSSIAN_SHAPE: "Gaussian trade-off curves",
          WHITE_BOX_SUMS: "white-box sums", INDEPENDENT: "independent canaries",
          RUN_FAMILY: "white-box sums of a Poisson-sampled Gaussian run"}


def headline_help() -> str:
    """The --headline help: the rule, then the bounds that may headline, grouped by what they are valid for."""
    groups: dict[str, list[str]] = {}
    for name, b in BOUNDS.items():
        if b.headline:
            groups.setdefault(SCOPES[b.valid_for] + (", delta > 0" if b.needs_delta else ""), []).append(name)
    listed = "; ".join(f"valid for {scope}: {', '.join(names)}" for scope, names in groups.items())
    return f"The bound that decides the verdict, fixed in advance. {AUTO_RULE}. Or name one ({listed})."
