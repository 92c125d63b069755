"""The pipeline-bug table: a user's Opacus script (hooks, claimed eps 4) with bugs upstream of the optimizer and
at it, each probed by WhiteBoxProbe.attach (canaries at the optimizer) and by PipelineProbe (canaries in the data);
then the correct script over many seeds under each probe (false alarms must stay within alpha).

    .venv/bin/python benchmarks/user_bugs/pipeline_table.py [--seeds 20] [--workers 2] [--eps 4] [--bugs all]
        [--probes pipeline+batches] [--null-probes pipeline+batches]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import BUGS  # noqa: E402

TABLE_BUGS = ("batch-reused-4x", "aux-step", "no-clipping", "sigma-over-batch", "accountant-n-10x")
# probe: (its canaries m, extra arguments); "pipeline+batches" also gives observe() each step's batch
PROBES = {"optimizer": (1000, []), "pipeline": (500, []), "pipeline+batches": (500, ["--batches"])}


def one(bug: str, probe: str, eps: float, seed: int, root: Path) -> dict:
    out = root / f"{probe}-{bug}-{seed}"
    done = subprocess.run([sys.executable, str(HERE / "opacus_train.py"), "--bug", bug, "--eps", str(eps),
                           "--seed", str(seed), "--out", str(out), "--probe", probe.split("+")[0],
                           "--m", str(PROBES[probe][0]), *PROBES[probe][1]],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"bug": bug, "probe": probe, "seed": seed, "error": done.stderr.strip()[-300:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--eps", type=float, default=4.0)
    ap.add_argument("--probes", nargs="+", default=list(PROBES), choices=list(PROBES))
    ap.add_argument("--bugs", nargs="+", default=list(TABLE_BUGS),
                    help="the bugs to plant (\"all\": every bug the Opacus hooks script plants)")
    ap.add_argument("--null-probes", nargs="*", default=["pipeline+batches"], choices=list(PROBES),
                    help="the probes run over --seeds correct runs")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pipeline-bugs-"))
    print(f"runs in {root}", flush=True)
    bugs = [b for b in BUGS if b not in ("none", "batch-sum-clipping")] if args.bugs == ["all"] else args.bugs
    jobs = [(b, p, args.eps, 0) for b in bugs for p in args.probes]
    jobs += [("none", p, args.eps, s) for p in args.null_probes for s in range(args.seeds)]
    with ThreadPoolExecutor(args.workers) as pool:
        rows = list(pool.map(lambda j: one(*j, root), jobs))
    print(f"| bug (opacus hooks, claimed eps {args.eps:g}) | probe | eps lower bound | verdict |")
    print("|---|---|---|---|")
    for r in rows:
        if r["bug"] != "none":
            verdict = r.get("error", "")[:80] or r["verdict"].split(":")[0] + (
                " (sampler)" if "not sampled as accounted" in r["verdict"] else "")
            print(f"| {BUGS[r['bug']]} | {r['probe']} | {r.get('bound', float('nan')):.3g} | {verdict} "
                  f"({r.get('headline', '?')}) |")
    print()
    print("| probe (no bug) | seeds | false alarms (VIOLATION) | median bound | largest bound | probe share of wall time "
          "| read through the run's family |")
    print("|---|---|---|---|---|---|---|")
    for p in args.null_probes:
        good = [r for r in rows if r["bug"] == "none" and r["probe"] == p and "error" not in r]
        if good:
            bounds = sorted(r["bound"] for r in good)
            share = [r["probe_s"] / r["seconds"] for r in good if "probe_s" in r]
            family = sum(r.get("headline") == "gaussian-run" for r in good)
            print(f"| {p} | {len(good)} | {sum(r['violation'] for r in good)} | {bounds[len(bounds) // 2]:.3g} | "
                  f"{bounds[-1]:.3g} | {f'{max(share):.1%} at most' if share else '-'} | {family} |")
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"\n{len(errors)} runs failed, e.g. {errors[0]['error']}")


if __name__ == "__main__":
    main()
