"""How each step's batch is drawn, and the neighbouring relation an accountant answers for under it.

One small record per scheme, so that accountants and commands ask ``scheme(name).<fact>`` instead of
branching on the name:

* ``poisson``: each example joins each step's batch independently with probability p = B / N. Add/remove
  neighbours: the dominating pairs of the add and the remove direction differ, and both are composed.
* ``fixed``: B examples drawn without replacement each step, independently across steps. N is public, so
  neighbours replace one example (replace-one); dp-accounting accounts this as ``SampledWithoutReplacementDpEvent``
  (Renyi DP, Wang, Balle & Kasiviswanathan 2019). Under replace-one a clipped sum moves by up to 2C, not C.
* ``shuffle``: a fresh permutation each epoch, cut into N // B batches of B. Neighbours replace one example by a
  null one whose clipped contribution is 0 (zero-out; dp-accounting's REPLACE_SPECIAL), the relation under
  which Chua et al. (ICML 2024) compare shuffling with Poisson sampling. See ``shuffle.py`` for the bound.
* ``balls-in-bins`` (random allocation: each example is put in one of the epoch's batches uniformly at
  random; Chua et al. 2025, Feldman & Shenfeld 2025): named so that it can be refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpaudit.accounting.result import (
    ADD_REMOVE, REPLACE_ONE_WORDS, SINGLE_RELEASE, ZERO_OUT_WORDS, NeighboringRelation,
)
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
    refused: str | None = None     # why no accountant answers it (a scheme named only to say why)


SCHEMES: dict[str, Scheme] = {s.name: s for s in [
    Scheme("poisson", NeighboringRelation.ADD_OR_REMOVE_ONE, False,
           "Poisson sampling with rate p = {p:g}, T = {T} steps", independent_steps=True),
    Scheme("fixed", NeighboringRelation.REPLACE_ONE, True,
           "fixed-size batches: B = {B} of N = {N} drawn without replacement each step (p = {p:.4g}), T = {T} steps",
           REPLACE_ONE_WORDS, accountants=("rdp", "pure"), independent_steps=True),
    Scheme("shuffle", NeighboringRelation.REPLACE_SPECIAL, True,
           "shuffled epochs: a fresh permutation of N = {N} each epoch, cut into batches of B = {B}, T = {T} steps",
           ZERO_OUT_WORDS, accountants=("shuffle",), epochs=True),
    Scheme("balls-in-bins", NeighboringRelation.REPLACE_SPECIAL, True,
           "balls-in-bins: each example in one random batch of each epoch (B = {B} on average, N = {N}), T = {T} steps",
           ZERO_OUT_WORDS, epochs=True,
           refused="balls-in-bins (random allocation) is not accounted: the published methods (Chua et al. 2025; "
                   "Feldman & Shenfeld 2025) give a Monte-Carlo estimate, not a bound that holds, or an upper bound "
                   "whose computation does not fit the time and memory budgets here; account it as shuffle "
                   "(valid: each example meets at most one batch an epoch) or switch to Poisson sampling"),
]}
SAMPLINGS = tuple(SCHEMES)


def scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise DPAuditError(f"unknown sampling {name!r}; choose one of {', '.join(SCHEMES)}") from None


def relation_of(mech) -> str:
    """How the neighbouring relation is covered for ``mech`` (a Mechanism or Phases), in words."""
    words = scheme(mech.sampling).relation_words
    return words or (SINGLE_RELEASE if mech.is_single_release else ADD_REMOVE)
