"""How each step's batch is drawn, and the neighbouring relation an accountant answers for under it.

One small record per scheme, one module per scheme in this package (``SCHEME = Scheme(...)``, found at import,
as the noises are), so that accountants and commands ask ``scheme(name).<fact>`` instead of branching on the
name: the relation, the sensitivity of a clipped sum under it, the accountants that cover it, dp-accounting's
event for one step (where its RDP accountant covers the scheme), and the words for people. A new sampler is one
module here (or ``register_scheme`` from outside code); tests/training/test_extension.py adds one and accounts with it.

The schemes: ``poisson`` (poisson.py), ``fixed`` (fixed.py), ``shuffle`` (shuffle.py; its accountant is
accounting/shuffle.py) and ``balls-in-bins`` (balls_in_bins.py; accounting/allocation.py).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from dpaudit.accounting.result import ADD_REMOVE, SINGLE_RELEASE, NeighboringRelation
from dpaudit.core.errors import DPAuditError


@dataclass(frozen=True)
class Scheme:
    name: str
    relation: NeighboringRelation  # the relation every accountant answers for under this scheme
    needs_sizes: bool              # B and N must be given (p alone does not describe the scheme)
    words: str                     # for the assumptions line: "{words}" with B, N, p, T filled in
    relation_words: str | None = None  # how the relation is covered, in words (None: add/remove's, per event)
    accountants: tuple[str, ...] = ()  # its own accountants, the first that answers is the default (): pld's rule
    independent_steps: bool = False    # each step takes an example with probability p, independently of the rest
    epochs: bool = False               # epochs of N // B batches (--epochs counts those)
    whole_epochs: bool = False         # --epochs must be a whole number (each epoch allocates every example)
    refused: str | None = None     # why no accountant answers it (a scheme named only to say why)
    sensitivity: float = 1.0       # how far one neighbour moves a clipped sum, in units of C (replace-one: 2)
    # (mech, one unsampled step's DpEvent) -> dp-accounting's DpEvent of one sampled step (rdp covers the scheme)
    rdp_event: Callable | None = None
    rdp_note: str = ""             # what the RDP bound assumes of this scheme, for its guarantee line
    # how the sampler audit's verdict (audit/sampler.py) names a log this scheme accounts (a cyclic pass puts each
    # example in one batch an epoch too, so the shuffle bound, which needs no randomness of the permutation, holds)
    looks_like: tuple[str, ...] = ()
    rank: int = 100                # order in lists and help


def _discover() -> dict[str, Scheme]:
    found = {}
    for module in pkgutil.iter_modules(__path__):
        record = getattr(importlib.import_module(f"{__name__}.{module.name}"), "SCHEME", None)
        if isinstance(record, Scheme):
            found[record.name] = record
    return dict(sorted(found.items(), key=lambda kv: (kv[1].rank, kv[0])))


SCHEMES: dict[str, Scheme] = _discover()
SAMPLINGS = tuple(SCHEMES)  # the schemes found at import (``names()`` includes any registered since)


def observed_as(verdict: str) -> str | None:
    """The scheme a sampler audit's verdict (its ``looks_like`` words) is accounted as, or None."""
    return next((s.name for s in SCHEMES.values() for start in s.looks_like if verdict.startswith(start)), None)


def names() -> tuple[str, ...]:
    return tuple(SCHEMES)


def register_scheme(record: Scheme) -> None:
    """Add a sampler from outside code (Opacus' registry style). Refuses a name already taken."""
    if record.name in SCHEMES:
        raise DPAuditError(f"a sampler named {record.name!r} exists already")
    SCHEMES[record.name] = record


def scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise DPAuditError(f"unknown sampling {name!r}; choose one of {', '.join(SCHEMES)}") from None


def relation_of(mech) -> str:
    """How the neighbouring relation is covered for ``mech`` (a Mechanism or Phases), in words."""
    words = scheme(mech.sampling).relation_words
    return words or (SINGLE_RELEASE if mech.is_single_release else ADD_REMOVE)
