"""Correlated noise as the event carries it: a ``Strategy`` (which matrix C the noise goes through), parsed from
``--noise`` / a config's ``noise:``, and what it costs in error.

Noise convention, as jax_privacy's and the papers': ``sigma`` is the noise multiplier *relative to the strategy's
sensitivity*. The mechanism adds N(0, (sigma C sens)^2) per coordinate to the strategy's outputs C x, where C is the
clip norm and sens the strategy's L2 sensitivity under the participation accounted (a banded strategy normalised to
column norm 1 under cyclic sampling: sens = 1). So epsilon depends on sigma and the schedule; the strategy decides
the error at that epsilon: the expected squared error of the released prefix sums, sigma^2 sens^2 error(C) in units
of C^2 per coordinate (DP-SGD, C = I: sigma^2 T at step T). ``expected_error`` gives it so users can choose.

Families:
* ``bandmf,b=B``: the banded Toeplitz strategy with B bands that minimises the max error for the run's T
  (``toeplitz.optimal_banded``); b = 1 is DP-SGD exactly.
* ``blt,theta=t1:t2,omega=w1:w2``: a buffered-linear-Toeplitz strategy (Dvijotham et al. 2024): C's coefficients
  1, then sum_j omega_j theta_j^(k-1). Add ``order=fixed`` when epochs go through the data in one fixed order
  (the participations are then exactly N // B steps apart); otherwise any two may be adjacent.
* ``blt,buffers=d``: the d-buffer BLT with the least max error for the run's T and participation
  (``toeplitz.optimal_blt``), found when the mechanism is built (``resolve``), so every answer names its theta and
  omega.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache

from dpaudit.accounting.samplers import scheme
from dpaudit.core.errors import DPAuditError

FAMILIES = ("bandmf", "blt")
MAX_SPEC = 200          # characters of a --noise spec
MAX_BANDS = 100_000
MAX_BUFFERS = 8   # toeplitz.MAX_BLT_BUFFERS (the search's), kept equal by a test
INDEPENDENT = ("independent", "iid", "none", "")


@dataclass(frozen=True)
class Strategy:
    family: str
    bands: int = 1
    theta: tuple[float, ...] = ()
    omega: tuple[float, ...] = ()
    fixed_order: bool = False
    buffers: int = 0   # blt,buffers=d: theta and omega are searched for the run (resolve); 0: given

    def spec(self) -> str:
        if self.family == "bandmf":
            return f"bandmf,b={self.bands}"
        if not self.theta:
            text = f"blt,buffers={self.buffers}"
        else:
            text = ("blt,theta=" + ":".join(f"{t:.12g}" for t in self.theta) + ",omega="
                    + ":".join(f"{w:.12g}" for w in self.omega))
        return text + (",order=fixed" if self.fixed_order else "")

    def words(self) -> str:
        if self.family == "bandmf":
            return (f"banded matrix factorisation (BandMF) with b = {self.bands} bands, the max-error-optimal banded "
                    "Toeplitz strategy at column norm 1")
        if not self.theta:
            return f"buffered-linear-Toeplitz (BLT) strategy with {self.buffers} buffers, to be optimised for the run"
        searched = ", the max-error-optimal for the run's T and participation" if self.buffers else ""
        return (f"buffered-linear-Toeplitz (BLT) strategy with {len(self.theta)} buffers{searched} (theta "
                f"{', '.join(f'{t:.6g}' for t in self.theta)}; omega {', '.join(f'{w:.6g}' for w in self.omega)})")

    def rational(self, steps: int):
        """(num, den) of C's generating function for a run of ``steps`` steps."""
        from dpaudit.accounting.matrix import toeplitz

        if self.family == "bandmf":
            return banded_coefs(steps, self.bands), (1.0,)
        return toeplitz.blt_rational(self.theta, self.omega)

    def coefs(self, steps: int):
        """C's first column (Toeplitz coefficients), length ``steps``."""
        from dpaudit.accounting.matrix import toeplitz

        num, den = self.rational(steps)
        return toeplitz.series(num, den, steps)


@lru_cache(maxsize=32)
def _banded(steps: int, bands: int) -> tuple[float, ...]:
    from dpaudit.accounting.matrix import toeplitz

    if steps > toeplitz.MAX_OPTIMISE:
        raise DPAuditError(f"the banded strategy is optimised for T <= {toeplitz.MAX_OPTIMISE}; got T = {steps}")
    return tuple(toeplitz.optimal_banded(steps, min(bands, steps)))


def banded_coefs(steps: int, bands: int):
    import numpy as np

    return np.array(_banded(steps, bands))


def participation(mech) -> tuple[int, int, str]:
    """(k, min_sep, words): how often and how close together one example can take part, from the sampler.
    Epoch samplers: once an epoch; in one fixed order (``order=fixed``) exactly an epoch apart, otherwise as close
    as adjacent steps (across an epoch's end). Other samplers: any step, so k = T, separation 1."""
    facts = scheme(mech.sampling)
    if facts.epochs:
        per_epoch = mech.steps_per_epoch
        k = math.ceil(mech.steps / per_epoch)
        if mech.strategy.fixed_order:
            return k, per_epoch, f"k = {k} participations (one an epoch), {per_epoch} steps apart (fixed order)"
        return k, 1, f"k = {k} participations (one an epoch), possibly adjacent (order not fixed)"
    return mech.steps, 1, f"k = T = {mech.steps} participations (any step; no amplification is used)"


def sensitivity_squared(mech) -> float:
    """The strategy's squared L2 sensitivity (per unit clip norm) under the sampler's participation."""
    from dpaudit.accounting.matrix import toeplitz

    k, sep, _ = participation(mech)
    if mech.strategy.family == "bandmf" and mech.strategy.bands <= sep:
        return float(k)   # columns of norm 1 with disjoint supports: k of them add in squares, no coefficients needed
    return toeplitz.minsep_sensitivity_squared(mech.strategy.coefs(mech.steps), sep, k)  # banded: already norm 1


def expected_error(mech, sensitivity2: float = 1.0) -> float:
    """sigma^2 sens^2 error(C): the expected squared error of the last released prefix sum, per coordinate, in
    units of C^2 (the largest over the run: Toeplitz)."""
    from dpaudit.accounting.matrix import toeplitz

    if mech.strategy is None:
        return mech.sigma ** 2 * mech.steps
    num, den = mech.strategy.rational(mech.steps)
    return mech.sigma ** 2 * sensitivity2 * toeplitz.max_error(num, den, mech.steps)


def parse(text: str | None) -> Strategy | None:
    """``--noise`` or a config's ``noise:``: independent (None), ``bandmf,b=B`` or
    ``blt,theta=..,omega=..[,order=fixed]``. Refusals never echo the text (configs are untrusted)."""
    if text is None:
        return None
    if not isinstance(text, str) or len(text) > MAX_SPEC:
        raise DPAuditError(f"--noise must be a short text (at most {MAX_SPEC} characters)")
    parts = [s.strip() for s in text.strip().lower().split(",")]
    family, keys = parts[0], {}
    if family in INDEPENDENT and len(parts) == 1:
        return None
    if family not in FAMILIES:
        raise DPAuditError(f"unknown noise family; choose independent, {', '.join(FAMILIES)}")
    for item in parts[1:]:
        if "=" not in item:
            raise DPAuditError("the noise spec takes key=value items after the family (bandmf,b=4)")
        key, value = (s.strip() for s in item.split("=", 1))
        if key in keys:
            raise DPAuditError("the noise spec gives a key twice")
        keys[key] = value
    if family == "bandmf":
        bands = keys.pop("b", keys.pop("bands", None))
        if keys:
            raise DPAuditError("bandmf takes b= only")
        if bands is None or not re.fullmatch(r"\d{1,7}", bands) or not 1 <= int(bands) <= MAX_BANDS:
            raise DPAuditError(f"bandmf needs b = the number of bands, a whole number in [1, {MAX_BANDS}] (bandmf,b=4)")
        return Strategy("bandmf", bands=int(bands))
    order = keys.pop("order", "any")
    if order not in ("any", "fixed"):
        raise DPAuditError("blt order must be fixed or any")
    buffers = keys.pop("buffers", keys.pop("d", None))
    if buffers is not None:
        if keys:
            raise DPAuditError("blt,buffers=d takes order= only beside it (theta and omega are searched)")
        if not re.fullmatch(r"\d", buffers) or not 1 <= int(buffers) <= MAX_BUFFERS:
            raise DPAuditError(f"blt buffers must be a whole number in [1, {MAX_BUFFERS}] (blt,buffers=3)")
        return Strategy("blt", fixed_order=order == "fixed", buffers=int(buffers))
    theta, omega = (_floats(keys.pop(k, None), k) for k in ("theta", "omega"))
    if keys:
        raise DPAuditError("blt takes theta=, omega= and order=, or buffers= and order=")
    if len(theta) != len(omega) or not 1 <= len(theta) <= MAX_BUFFERS:
        raise DPAuditError(f"blt needs as many theta as omega values, 1 to {MAX_BUFFERS} (blt,theta=0.9:0.5,"
                           "omega=0.3:0.2)")
    if not all(0 < t < 1 for t in theta) or not all(w > 0 for w in omega) or sum(omega) > 1:
        raise DPAuditError("blt needs 0 < theta < 1, omega > 0 and sum(omega) <= 1 (non-negative, non-increasing "
                           "coefficients, which its sensitivity formula needs)")
    return Strategy("blt", theta=theta, omega=omega, fixed_order=order == "fixed")


def resolve(mech):
    """``mech``'s strategy with a searched BLT's theta and omega found (``toeplitz.optimal_blt`` at the mechanism's T
    and participation: cached, deterministic); any other strategy as it is."""

    strategy = mech.strategy
    if strategy is None or strategy.family != "blt" or strategy.theta:
        return strategy
    k, sep, _ = participation(mech)
    return replace(strategy, **_searched_blt(mech.steps, strategy.buffers, sep, k))


@lru_cache(maxsize=32)
def _searched_blt(steps: int, buffers: int, sep: int, k: int) -> dict:
    from dpaudit.accounting.matrix import toeplitz

    if steps > toeplitz.MAX_BLT_OPTIMISE:
        raise DPAuditError(f"blt,buffers=d is searched for T <= {toeplitz.MAX_BLT_OPTIMISE}; got T = {steps} (give "
                           "theta= and omega=)")
    theta, omega = toeplitz.optimal_blt(steps, buffers, sep, k)
    return {"theta": theta, "omega": omega}


def _floats(text: str | None, key: str) -> tuple[float, ...]:
    if text is None:
        raise DPAuditError(f"blt needs {key}= (values separated by ':')")
    try:
        values = tuple(float(x) for x in text.split(":"))
    except ValueError:
        raise DPAuditError(f"blt {key} must be numbers separated by ':'") from None
    if not all(math.isfinite(v) for v in values):
        raise DPAuditError(f"blt {key} must be finite")
    return values


def error_summary(mech, accountant: str) -> dict:
    """What a user compares strategies on: the noise std added per step and the expected squared error of the
    last released prefix sum (per coordinate, units of C^2), at the event's sigma. The amplified BandMF route
    normalises C to column norm 1 (its participations are in the accounting), the matrix route scales the noise
    by the sensitivity under the sampler's participation; independent noise is DP-SGD's sigma^2 T."""
    if mech.strategy is None:
        return {"noise": "independent", "noise_std": mech.sigma, "expected_error": mech.sigma ** 2 * mech.steps}
    sens2 = 1.0 if accountant == "bandmf" else sensitivity_squared(mech) * scheme(mech.sampling).sensitivity ** 2
    try:
        error = expected_error(mech, sens2)
    except DPAuditError:   # a banded strategy is optimised up to toeplitz.MAX_OPTIMISE steps: eps stands, error not
        error = None
    return {"noise": mech.strategy.spec(), "noise_std": mech.sigma * math.sqrt(sens2), "expected_error": error}
