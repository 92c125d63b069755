"""The user-bug zoo: every script x bug x claimed eps, one probed run each, and the correct scripts over
many seeds; writes the table into docs/auditing.md (between the user-bugs markers) and prints it.

    .venv/bin/python benchmarks/user_bugs/run.py [--seeds 20] [--workers 2] [--eps 1 4]
A bug that changes the released noise, the clipping or the claim is caught when its one run ends in
VIOLATION; the sampler bug when the sampler audit refuses the run's batches.
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

SCRIPTS = {"plain": ("plain_train.py", []), "opacus-hooks": ("opacus_train.py", ["--mode", "hooks"]),
           "opacus-ghost": ("opacus_train.py", ["--mode", "ghost"])}
SAMPLER_BUGS = {"shuffle-as-poisson"}
PLAIN_ONLY = {"batch-sum-clipping"}  # a loop's own clipping: Opacus clips each example itself
MARK = ("<!-- user-bugs:start -->", "<!-- user-bugs:end -->")


def one(script: str, bug: str, eps: float, seed: int, root: Path) -> dict:
    name, extra = SCRIPTS[script]
    out = root / f"{script}-{bug}-{eps:g}-{seed}"
    done = subprocess.run([sys.executable, str(HERE / name), "--bug", bug, "--eps", str(eps), "--seed", str(seed),
                           "--out", str(out), *extra], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"script": script, "bug": bug, "eps": eps, "seed": seed, "error": done.stderr.strip()[-300:]}
    return json.loads(lines[-1])


def caught(row: dict) -> str:
    if "error" in row:
        return "error"
    if row["bug"] in SAMPLER_BUGS:
        return "yes (sampler audit)" if not row["sampler_ok"] else "no"
    return "yes" if row["violation"] else "no"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--scripts", nargs="+", default=list(SCRIPTS))
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="user-bugs-"))
    jobs = [(s, b, e, 0) for s in args.scripts for b in BUGS if b != "none" and (s == "plain" or b not in PLAIN_ONLY)
            for e in args.eps]
    jobs += [(s, "none", args.eps[0], seed) for s in args.scripts[:2] for seed in range(args.seeds)]
    with ThreadPoolExecutor(args.workers) as pool:
        rows = list(pool.map(lambda j: one(*j, root), jobs))
    lines = ["| script | bug | claimed eps | eps lower bound | verdict | sampler audit | caught | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["bug"] == "none":
            continue
        if "error" in r:
            lines.append(f"| {r['script']} | {r['bug']} | {r['eps']:g} | - | error: {r['error'][:80]} | - | error | - |")
            continue
        lines.append(f"| {r['script']} | {BUGS[r['bug']]} | {r['eps']:g} | {r['bound']:.3g} | "
                     f"{r['verdict'].split(':')[0]} | {r['sampler']} | {caught(r)} | {r['seconds']:.0f} |")
    lines += ["", "| script (no bug) | claimed eps | seeds | false alarms (VIOLATION) | sampler refusals | "
                  "largest bound | median s |", "|---|---|---|---|---|---|---|"]
    for s in args.scripts[:2]:
        good = [r for r in rows if r["script"] == s and r["bug"] == "none" and "error" not in r]
        if good:
            secs = sorted(r["seconds"] for r in good)
            lines.append(f"| {s} | {args.eps[0]:g} | {len(good)} | {sum(r['violation'] for r in good)} | "
                         f"{sum(not r['sampler_ok'] for r in good)} | {max(r['bound'] for r in good):.3g} | "
                         f"{secs[len(secs) // 2]:.0f} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        docs = HERE.parents[1] / "docs" / "auditing.md"
        text = docs.read_text()
        start, end = text.index(MARK[0]) + len(MARK[0]), text.index(MARK[1])
        docs.write_text(text[:start] + "\n" + table + "\n" + text[end:])


if __name__ == "__main__":
    main()
