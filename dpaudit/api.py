"""The Python API: the CLI's accounting questions, with keywords named like its flags.

    from dpaudit import calibrate, epsilon
    plan = calibrate(eps=1.0, delta=1e-5, p=16 / 1000, steps=75_000)   # plan.sigma, plan.epsilon
    spent = epsilon(sigma=plan.sigma, delta=1e-5, p=16 / 1000, steps=75_000)  # spent.epsilon

Same code path and the same numbers as ``dpaudit calibrate / epsilon / delta / max-steps``. Every
answer is an upper bound for the neighbouring relation of its batch sampler (the result's ``neighboring``:
add/remove for Poisson sampling, replace-one for ``sampling="fixed"``, zero-out for ``"shuffle"``).
A schedule of several phases is ``phases=[{"sigma": 1.0, "p": 0.01, "steps": 1000}, ...]`` (the keys of
``--phase``; or ``Mechanism`` objects), composed in sequence; ``calibrate(phases=...)`` finds the smallest
multiplier of every phase's sigma (a phase without sigma has share 1). ``max_memory``
('2G', or bytes) bounds what an accountant may allocate, as --max-memory does; ``timeout`` is the
time the call may take: the accountants plan within it, and past it the call stops with one
``DPAuditError``, as the CLI does (SIGALRM, so from the main thread; on another thread the deadline is
planned within and checked between chunks of work). ``unit="user", records_per_user=k`` (and
``user_sampling="els" | "uls"``) ask for a user's eps, as ``--unit user`` does (docs/accounting.md).
"""

from __future__ import annotations

from dataclasses import replace

from dpaudit.core import limits as budgets
from dpaudit.accounting.calibrate import Calibration, StepsAnswer
from dpaudit.accounting.calibrate import calibrate_sigma as _calibrate_sigma
from dpaudit.accounting.calibrate import max_steps as _max_steps
from dpaudit.accounting.mechanism import Mechanism, Phases, event as _event, schedule, with_unit
from dpaudit.accounting.unit import unit_from
from dpaudit.core.validate import check_epsilon
from dpaudit.accounting.noises import resolve_delta
from dpaudit.accounting.registry import delta as _delta, epsilon as _epsilon
from dpaudit.accounting.result import DeltaResult, EpsilonResult, NeighboringRelation
from dpaudit.accounting.shuffle import context_for

_WORDS = ("sigma", "phases=[...]", "p/batch_size/steps/epochs/sampling")  # the keywords, for refusals

__all__ = ["Mechanism", "NeighboringRelation", "Phases", "calibrate", "delta", "epsilon", "max_steps"]


def calibrate(eps: float, *, mech: str = "gaussian", delta: float | None = None, p: float | None = None,
              batch_size: int | None = None, dataset_size: int | None = None, steps: int | None = None,
              epochs: float | None = None, sampling: str = "poisson", phases=None, accountant: str | None = None,
              rtol: float = 1e-3, options=None, max_memory: int | str | None = None,
              timeout: float | None = None, unit: str = "example", records_per_user: int | None = None,
              user_sampling: str | None = None) -> Calibration:
    """Smallest sigma whose accounted eps is <= ``eps`` (``.sigma``, ``.epsilon``, ``.result``); with
    ``phases``, the smallest multiplier of every phase's sigma (``.result.mechanism`` holds the phases; phases
    that merge into one are that phase, and ``.sigma`` is its sigma)."""
    check_epsilon(eps)
    d = resolve_delta(mech, delta)
    template = with_unit(_event(mech, 1.0, p, batch_size, dataset_size, steps, epochs, sampling, phases, _WORDS),
                         unit_from(unit, records_per_user, user_sampling))
    with budgets.enforced(max_memory, timeout, "calibrate"):  # None, None: the budget in force stays
        cal = _calibrate_sigma(template, eps, d, accountant, rtol=rtol, options=options)
    return replace(cal, result=replace(cal.result, mechanism=template.with_sigma(cal.sigma)))


def epsilon(sigma: float | None = None, *, mech: str = "gaussian", delta: float | None = None,
            p: float | None = None, batch_size: int | None = None, dataset_size: int | None = None,
            steps: int | None = None, epochs: float | None = None, sampling: str = "poisson", phases=None,
            accountant: str | None = None, options=None, relation: NeighboringRelation | None = None,
            max_memory: int | str | None = None, timeout: float | None = None, unit: str = "example",
            records_per_user: int | None = None, user_sampling: str | None = None) -> EpsilonResult:
    """Upper bound on eps spent by noise ``sigma`` over the schedule, or by ``phases`` (``.epsilon``,
    ``.sigma``, ``.neighboring``). Shuffled epochs also carry ``.details["shuffle"]``: the Chua et al. lower
    bound and the eps a Poisson accountant would have quoted."""
    d = resolve_delta(mech, delta)
    m = with_unit(_event(mech, sigma, p, batch_size, dataset_size, steps, epochs, sampling, phases, _WORDS),
                  unit_from(unit, records_per_user, user_sampling))
    with budgets.enforced(max_memory, timeout, "epsilon"):
        res = _epsilon(m, d, accountant, options, relation)

        shuffled = context_for(m, d, res)
        if shuffled is not None:
            res = replace(res, details={**res.details, "shuffle": shuffled.to_json(res.epsilon)})
    return replace(res, mechanism=m)


def delta(sigma: float, eps: float, *, mech: str = "gaussian", p: float | None = None,
          batch_size: int | None = None, dataset_size: int | None = None, steps: int | None = None,
          epochs: float | None = None, sampling: str = "poisson", accountant: str | None = None, options=None,
          max_memory: int | str | None = None, timeout: float | None = None, unit: str = "example",
          records_per_user: int | None = None, user_sampling: str | None = None) -> DeltaResult:
    """Upper bound on delta at ``eps`` (``.delta``; exact where there is no subsampling; Monte-Carlo: with
    probability >= 1 - beta)."""
    m = with_unit(schedule(mech, sigma, p, batch_size, dataset_size, steps, epochs, sampling),
                  unit_from(unit, records_per_user, user_sampling))
    with budgets.enforced(max_memory, timeout, "delta"):
        return _delta(m, eps, accountant, options)


def max_steps(sigma: float, eps: float, *, mech: str = "gaussian", delta: float | None = None,
              p: float | None = None, batch_size: int | None = None, dataset_size: int | None = None,
              sampling: str = "poisson", accountant: str | None = None, options=None,
              max_memory: int | str | None = None, timeout: float | None = None, unit: str = "example",
              records_per_user: int | None = None, user_sampling: str | None = None) -> StepsAnswer:
    """Largest T with eps(T) <= ``eps`` (``.steps``, ``.epsilon``)."""
    d = resolve_delta(mech, delta)
    template = with_unit(schedule(mech, sigma, p, batch_size, dataset_size, 1, None, sampling),
                         unit_from(unit, records_per_user, user_sampling))
    with budgets.enforced(max_memory, timeout, "max_steps"):
        return _max_steps(template, eps, d, accountant, options)
