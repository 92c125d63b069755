"""White-box scores from a run's transcript (torch-free): what the auditor computes from the releases.

Canary i's score is the correlation of the released noisy sums with its public sign pattern s[i, t],
in units of C: a member sampled at step t adds +C (after clipping) to s[i, t] x release_t, everything
else (noise, data, other canaries) enters with a random sign. Over T steps a member's score is about
N(pT, T v) and a non-member's N(0, T v): a sum of many canary-aligned signals, so the continuous
Gaussian audit applies.
- DP-SGD: release_t[i] is the released noisy gradient sum at canary i's coordinate (the transcript).
- DP-ZO: release_t = 2 phi B x s_t, the noisy sum behind the logged scalar, shared by all canaries.
  A second statistic replays, for each step, the noise a generator seeded with that step's *public*
  seed would draw, and subtracts it: it finds nothing in a correct run (the noise is secret) and the
  whole sum when a run's noise is public. alpha is split over the two statistics (Bonferroni).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpaudit import run_folder
from dpaudit.errors import DPAuditError


def _run_config(run_dir: Path) -> dict:
    """What the scoring needs of a run folder (run_config.json), or of a probe's folder (probe.json)."""
    if run_folder.is_probe_folder(run_dir):
        from dpaudit.training.probe import read_spec

        spec = read_spec(run_dir)
        method = "dp-sgd" if spec["kind"] == "gradient" else "scalar-sum"
        return {"config": {"method": method, "clip": spec["clip"]}, "probe": spec}
    return run_folder.run_config(run_dir)


def public_noise(seeds: np.ndarray, kind: str, scale: float) -> np.ndarray:
    """The noise each step's public seed would give (what a trainer that misuses it adds)."""
    from dpaudit.accounting.noise import noise

    draw = noise(kind).draw
    return np.array([draw(np.random.default_rng(int(s)), scale) for s in seeds])


def transcript_scores(run_dir: Path, meta: dict | None = None
                      ) -> tuple[dict[str, np.ndarray], np.ndarray, str, dict]:
    """({statistic: scores}, members, score name, facts) for a white-box run folder (``meta``: its
    ``_run_config``, when the caller has read it)."""
    from dpaudit.training.whitebox import TRANSCRIPT, WhiteBoxCanaries, step_signs

    run_dir = Path(run_dir)
    meta = meta if meta is not None else _run_config(run_dir)
    cfg = meta["config"]
    canaries = WhiteBoxCanaries.load(run_dir)
    clip, method = float(cfg["clip"]), cfg["method"]
    probe = meta.get("probe")
    if probe is not None:
        if canaries.run_id != probe["run_id"] or canaries.m != probe["m"]:
            raise DPAuditError(f"{run_dir}: the canary manifest and probe.json come from different probe runs")
    if method == "scalar-sum":  # a probe of scalar releases: one noisy sum a step
        sums = np.fromfile(run_dir / TRANSCRIPT, dtype="<f4").astype(float) if (run_dir / TRANSCRIPT).is_file() \
            else np.zeros(0)
        steps = len(sums)
        signs = np.stack([step_signs(canaries.seed, t, canaries.m) for t in range(steps)]) if steps else None
        stats = {"correlation": signs.T @ sums / clip} if steps else {}
        name = "white-box-dp-zo"
    elif method == "dp-sgd":
        raw = np.fromfile(run_dir / TRANSCRIPT, dtype="<f4") if (run_dir / TRANSCRIPT).is_file() else np.zeros(0)
        if raw.size % canaries.m:
            raise DPAuditError(f"{run_dir / TRANSCRIPT} is truncated")
        releases = raw.reshape(-1, canaries.m).astype(float)
        steps = releases.shape[0]
        signs = np.stack([step_signs(canaries.seed, t, canaries.m) for t in range(steps)])
        stats = {"alignment": (signs * releases).sum(0) / clip}
        name = "white-box-dp-sgd"
    else:
        seeds, scalars = run_folder.zo_log(run_dir)
        steps = len(scalars)
        batch = float(meta.get("expected_batch_size") or cfg["batch_size"])
        sums = scalars * 2 * float(cfg["phi"]) * batch
        signs = np.stack([step_signs(canaries.seed, t, canaries.m) for t in range(steps)])
        stats = {"correlation": signs.T @ sums / clip}
        sigma = meta.get("sigma")
        if sigma:
            known = public_noise(seeds, cfg["mechanism"], clip * float(sigma))
            stats["correlation, public-seed noise removed"] = signs.T @ (sums - known) / clip
        name = "white-box-dp-zo"
    if steps == 0:
        raise DPAuditError(f"{run_dir} has no released steps to audit")
    return stats, canaries.members, name, {"steps": steps, "white-box canaries": canaries.m, "canary gain (x C)": canaries.gain}


def audit_run_folder(run_dir: Path, *, claimed_epsilon: float | None, delta: float, alpha: float = 0.05,
                     headline: str = "auto"):
    """The white-box audit of a run folder: (AuditResult of the chosen statistic, scores, members, facts).
    With several statistics each gets alpha / their number, and the larger headline is kept."""
    from dpaudit.audit.analysis import analyse

    meta = _run_config(Path(run_dir))  # read once
    stats, members, name, facts = transcript_scores(run_dir, meta)
    share = alpha / len(stats)
    mechanism = meta["config"].get("mechanism")
    results = {k: analyse(v, members, claimed_epsilon=claimed_epsilon, delta=delta, alpha=share, score=name,
                          mechanism=mechanism if isinstance(mechanism, str) else None,
                          headline=headline) for k, v in stats.items()}
    best = max(results, key=lambda k: results[k].epsilon_lower_bound)
    facts = {**facts, "statistic": best, "statistics tried": len(stats),
             "alpha per statistic": share,
             "other statistics": {k: r.epsilon_lower_bound for k, r in results.items() if k != best}}
    result = results[best]
    result.alpha = alpha  # the family-wise level; each bound inside was computed at alpha / len(stats)
    unprotected = (meta.get("probe") or {}).get("unprotected_parameters") or []
    result.unprotected = tuple(str(n) for n in unprotected)
    return result, stats[best], members, facts
