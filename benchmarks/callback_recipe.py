"""Black box of ``DPAuditCallback`` on a user's own DP LoRA run through ``opacus_trainer`` (issue 70 item 1): the
schedule of `benchmarks/user_recipe.py` (the embedded default, its 1000 examples plus the member canaries, Poisson
batches of expected size 64, T 300, claimed eps 4, m 1000 single-copy canaries, AdamW) with LoRA r 8 on every linear
layer, trained by the Hugging Face Trainer and audited by the callback. Prints one line a run (the black box's bound,
AUC, the score) and the median, beside the schedule's ceiling (`user_recipe.py --ceiling`: 1.014).

    .venv/bin/python benchmarks/callback_recipe.py [--kind new-token|existing] [--seeds 1,2,3,4,5] [--lr drift|2e-4]

``--kind existing``: the callback's default canaries (random spans of the vocabulary after random prefixes, scored
against the base through ``disable_adapter``). ``--kind new-token``: new tokens behind one shared prefix, each row at
the base's expected row, made trainable beside the adapters by ``audit.extend(model)``. ``--lr drift``: the rate
`audit run` picks where the body trains (``drift_rate``: the noise walks each weight 1/16 of the base's typical
weight over the run); a number: that rate. ``--schedule``: the Trainer's rate schedule (default linear decay, the
Trainer's own; ``constant`` as `audit run`). The Trainer's other defaults are kept (AdamW, no warm-up, no weight decay).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="new-token", choices=("new-token", "existing"))
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--lr", default="drift")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--m", type=int, default=1000)
    ap.add_argument("--eps", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schedule", default="linear", help="the Trainer's lr_scheduler_type (its default: linear)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    from peft import LoraConfig, get_peft_model
    from callback_whitebox import train   # a sibling script (benchmarks/ is the script's own folder)
    from transformers import logging

    from dpaudit.api import calibrate
    from dpaudit.integrations.hf import DPAuditCallback
    from dpaudit.models.corpus import sentences
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.workflows.audit_run import BODY_DRIFT, drift_rate, embedded_default, weight_scale

    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    delta, bounds = 1e-5, []
    with tempfile.TemporaryDirectory() as tmp:
        base = embedded_default(Path(tmp) / "base", 0)
        rows = [{"text": s} for s in sentences(1000, seed=1)]
        for seed in [int(s) for s in args.seeds.split(",")]:
            start = time.perf_counter()
            model, tok = load_causal_lm(base)
            lr = drift_rate(weight_scale(model), args.steps, BODY_DRIFT, 1.0) if args.lr == "drift" else float(args.lr)
            audit, data = DPAuditCallback.prepare(tok, rows, m=args.m, kind=args.kind, out=Path(tmp) / f"audit{seed}",
                                                  repeats=1, controls=0, canary_budget=1.0, claimed_eps=args.eps,
                                                  delta=delta, secret_seed=seed, white_box_m=0, on_violation="off")
            torch.manual_seed(seed)
            model.train()
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                     target_modules="all-linear", task_type="CAUSAL_LM"))
            if args.kind == "new-token":
                audit.extend(model)
            rate = args.batch / len(data)
            sigma = calibrate(args.eps, delta=delta, p=rate, steps=args.steps).sigma
            train(model, tok, data, audit, Path(tmp) / f"out{seed}", batch=args.batch, steps=args.steps, lr=lr,
                  sigma=sigma, seed=seed, lr_scheduler_type=args.schedule)
            result = audit.result
            bounds.append(result.epsilon_lower_bound)
            print(json.dumps({"kind": args.kind, "seed": seed, "lr": float(f"{lr:.4g}"), "schedule": args.schedule,
                              "sigma": round(sigma, 4), "p": round(rate, 4),
                              "bound": round(result.epsilon_lower_bound, 3),
                              "auc": round(result.roc.auc, 3), "score": result.score.name,
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    print(f"{args.kind} canaries, lr {args.lr} ({args.schedule}): median bound of {len(bounds)} "
          f"{statistics.median(bounds):.3f} (the schedule's ceiling 1.014: user_recipe.py --ceiling)")


if __name__ == "__main__":
    main()
