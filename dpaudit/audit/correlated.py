"""White-box canaries in a BandMF run, read through the run's strategy.

Model. BandMF releases, each step, g_t = x_t + w_t with w = C^-1 z, z ~ N(0, sigma^2 C^2 I) i.i.d. over steps, C
lower-triangular banded Toeplitz with b bands and column norm 1; batches are cyclic Poisson: an example (a canary)
of group g takes part only at steps s = g + r b, each with probability q = p b. The releases are correlated across
steps, so the one-run audits that assume independent steps do not apply to them as they are.

Theorem (the view). Apply C to a canary's release sequence and read it along its own columns: for each of its
rounds r, with s = g + r b,

    v_r = < C e_s, C g > / C = sign_s a_r + < C e_s, z > / C,     a_r = 1 if sampled at s (member), else 0,

because C g = C x + z, x's only entries in the canary's coordinate are at its own participation steps, and the
columns C e_s of distinct rounds have disjoint supports (rows s .. s + b - 1) and norm 1. So < C e_s, z > are
i.i.d. N(0, sigma^2) over the rounds, and the signed views x_r = sign_s v_r are exactly the family audit's model
(family.py): x_r = a_r + sigma xi_r, a Poisson-subsampled Gaussian at rate q over R rounds. Only rounds whose column
lies wholly inside the run are read (s + b <= T), the same R for every canary (exchangeable scores); dropping rounds
is post-processing, and the family at R rounds is below the run's own eps, so the bound stays a lower bound.

Validity is tested by simulating the exact mechanism (tests/audit/test_correlated_audit.py: 200 audits at the true claim).
Written here: no library audits a correlated-noise run.
"""

from __future__ import annotations


import numpy as np
from scipy.signal import lfilter

from dpaudit.audit import family
from dpaudit.audit.gaussian import mu_lower_bound
from dpaudit.accounting.matrix.toeplitz import optimal_banded


def rounds(steps: int, bands: int) -> int:
    """R: the rounds every group has wholly inside the run (s = g + r b, s + b <= T, for g up to b - 1)."""
    return max(0, (steps - 2 * bands + 1) // bands + 1) if steps >= 2 * bands - 1 else 0


def round_view(releases: np.ndarray, signs: np.ndarray, coefs: np.ndarray, groups: np.ndarray,
               clip: float = 1.0) -> np.ndarray:
    """(R, m): each canary's signed views x_r (units of C) from the (T, m) releases at its coordinates, the public
    (T, m) signs, the strategy's b coefficients (norm 1) and each canary's group (0..b-1)."""

    coefs = np.asarray(coefs, float)
    bands = coefs.size
    steps, m = releases.shape
    strategy_out = lfilter(coefs, [1.0], np.asarray(releases, float), axis=0)       # C g, per canary
    # <C e_s, C g> = sum_k c_k (C g)_{s+k}: the strategy's outputs read along column s
    along = np.zeros_like(strategy_out)
    for k, c in enumerate(coefs):
        along[:steps - k] += c * strategy_out[k:]
    n_rounds = rounds(steps, bands)
    at = groups[None, :] + bands * np.arange(n_rounds)[:, None]                      # (R, m) steps s
    cols = np.arange(m)[None, :]
    return signs[at, cols] * along[at, cols] / clip


def scored(views: np.ndarray, rate: float):
    """(family.ScoreModel, scores): each canary's sum over its rounds of the family's likelihood ratio at (rate, R),
    at the views' robust scale (1.4826 x their median absolute deviation: blind to membership, the same for every
    canary, so the scores stay exchangeable)."""
    centre = float(np.median(views))
    scale = 1.4826 * float(np.median(np.abs(views - centre)))
    model = family.likelihood_ratio(rate, views.shape[0], scale)
    return model, model.step(views).sum(0)


def audit(views: np.ndarray, members: np.ndarray, rate: float, delta: float, alpha: float = 0.05,
          bound: bool = True) -> dict:
    """The family audit (family.py) of the round views: the likelihood-ratio score at the views' robust scale
    (blind to membership), its (1 - alpha) lower confidence limit on the standardised shift, and (``bound``) the
    largest eps of the Poisson-subsampled Gaussian at (q, R) it refutes."""
    model, scores = scored(views, rate)
    n_rounds, scale = model.steps, model.scale
    inside, outside = scores[members], scores[~members]
    mu_lb, _ = mu_lower_bound(inside, outside, alpha)
    eps, sigma = (family.epsilon_lower_bound(model, mu_lb, inside.size, outside.size, delta) if bound
                  else (None, None))
    return {"epsilon_lower_bound": eps, "sigma_star": sigma, "mu_lower_bound": mu_lb, "scale": scale,
            "rounds": n_rounds, "rate": rate, "model": model, "counts": (inside.size, outside.size)}


def refuted(result: dict, sigma: float) -> bool:
    """Whether the audit refutes the family member at ``sigma`` (its shift below the confidence limit): the event
    whose probability the theorem bounds by alpha when the run is that member."""
    shift = family.standardised_shift(result["model"], sigma, *result["counts"])[0]
    return bool(shift < result["mu_lower_bound"])


def separation_violations(batches, bands: int) -> list[tuple[int, int, int]]:
    """The sampler side of the cyclic assumption, checked exactly on a batch log (one index array a step): every
    (example, step, earlier step) where an example took part twice less than b steps apart. BandMF's accounting
    (and the round view above) needs none; any one is a VIOLATION of the claim, with certainty."""
    last, found = {}, []
    for step, batch in enumerate(batches):
        for i in np.asarray(batch, int).tolist():
            if i in last and step - last[i] < bands:
                found.append((i, step, last[i]))
            last[i] = step
    return found


def simulate(m: int, steps: int, bands: int, rate: float, sigma: float, seed: int, coefs=None,
             cycle: int | None = None, independent: bool = False):
    """A BandMF run's canary transcript, exactly: (releases (T, m), signs, members, groups, coefs). ``cycle``: the
    period the batches really cycle with (a planted bug when < bands); ``independent``: N(0, sigma^2) per step
    instead of C^-1 z (the other planted bug)."""

    rng = np.random.default_rng(seed)
    coefs = optimal_banded(max(steps, bands), bands) if coefs is None else np.asarray(coefs, float)
    cycle = cycle or bands
    members = rng.random(m) < 0.5
    groups = np.arange(m) % bands
    actual = np.arange(m) % cycle
    signs = rng.choice([-1.0, 1.0], size=(steps, m))
    z = rng.normal(0.0, sigma, size=(steps, m))
    noise = z if independent else lfilter([1.0], coefs, z, axis=0)
    turn = (np.arange(steps)[:, None] % cycle) == actual[None, :]
    sampled = turn & members[None, :] & (rng.random((steps, m)) < rate)
    releases = signs * sampled + noise
    return releases, signs, members, groups, coefs
