"""What the two user scripts share: the embedded model and data, the bugs they can plant, and how a user
would compute sigma (Opacus' get_noise_multiplier, fed what the user believes)."""

from __future__ import annotations

import argparse
import json
import math
import time

N, B, T, SEQ, DELTA, M = 1000, 64, 200, 32, 1e-5, 1000

# Modelled on real reports; each changes the released noise, the clipping or the claim, except the last two.
BUGS = {
    "none": "correct",
    "sigma-over-batch": "noise multiplier divided by the batch size",
    "noise-other-clip": "noise scaled to C/10 while clipping at C",
    "accountant-n-10x": "accountant told N ten times too large (p/10)",
    "accountant-per-epoch": "accountant stepped once per epoch",
    "no-clipping": "clipping disabled (max_grad_norm = inf), noise for C",
    "batch-sum-clipping": "the batch's summed gradient clipped to C instead of each example's (plain only; "
                          "sensitivity 2C: the true eps is sigma/2's)",
    "shuffle-as-poisson": "fixed-size shuffled batches accounted as Poisson (opacus#80)",
    "floor-normalisation": "opacus#819: the average taken over floor(N p)",
    "lora-group-left-out": "an adapter group left out of the noised parameters (opacus#820)",
    "batch-reused-4x": "each Poisson batch used for 4 optimizer steps (hooks only)",
    "aux-step": "an unclipped, un-noised step on the batch after each DP step (hooks only)",
}
PIPELINE_BUGS = {"batch-reused-4x", "aux-step"}  # upstream of the optimizer: only the opacus-hooks script plants them


def arguments(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--bug", default="none", choices=sorted(BUGS))
    ap.add_argument("--eps", type=float, default=1.0, help="the eps the run claims (sigma calibrated to it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="probe folder")
    ap.add_argument("--steps", type=int, default=T)
    ap.add_argument("--m", type=int, default=M)
    ap.add_argument("--mode", default="hooks", help="Opacus grad_sample_mode (opacus script)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=0.05, help="PipelineProbe's share of the wall time")
    ap.add_argument("--batches", action="store_true", help="PipelineProbe: give observe() each step's batch")
    ap.add_argument("--watch", action="store_true", help="the optimizer probe audits as the run trains (looks at "
                    "16, 32, ... steps, on_violation='warn'): the step of the first alarm is reported")
    ap.add_argument("--probe", default="optimizer", choices=["optimizer", "pipeline"],
                    help="WhiteBoxProbe at the optimizer, or PipelineProbe canaries in the data (opacus script)")
    return ap.parse_args()


def data_and_model(seed: int, untie: bool = False, pipeline: dict | None = None):
    """The embedded architecture (RMSNorm weights frozen: Opacus' hooks do not cover them; ``untie``: the
    output layer gets its own copy of the embedding, as Opacus' ghost clipping refuses tied weights), N
    synthetic sentences, tokenized. ``pipeline``: PipelineProbe's arguments; its member canaries join the
    sentences (the probe is the fourth thing returned, else None)."""
    import torch

    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_model, build_tokenizer
    from dpaudit.training.data import tokenize

    corpus = sentences(N, seed=1)
    tok = build_tokenizer(sentences(2000, seed=0))
    torch.manual_seed(seed)
    model = build_model(tok, seed=seed)
    model.config.use_cache = False
    if untie:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)
    probe = None
    if pipeline is not None:
        from dpaudit import PipelineProbe

        probe = PipelineProbe(model, tok, **pipeline)
        corpus = probe.insert(corpus)
    data = tokenize(tok, corpus, SEQ)
    full = data.batch(range(len(corpus)))
    return model, full["input_ids"], full["attention_mask"], probe


def noise_multiplier(bug: str, eps: float, steps: int, n: int = N) -> tuple[float, float, int]:
    """(sigma, the sample rate the accountant is told, the steps it is told): what the user computes for a
    dataset of ``n`` examples."""
    from opacus.accountants.utils import get_noise_multiplier

    p, told_steps = B / n, steps
    if bug == "accountant-n-10x":
        p = B / (10 * n)
    if bug == "accountant-per-epoch":
        told_steps = max(1, math.ceil(steps * B / N))  # one accountant step an epoch
    sigma = get_noise_multiplier(target_epsilon=eps, target_delta=DELTA, sample_rate=p, steps=told_steps,
                                 accountant="prv")
    return sigma, p, told_steps


def report(args, script: str, result, seconds: float, extra: dict | None = None) -> None:
    print(json.dumps({"script": script, "probe": getattr(args, "probe", "optimizer") + (
                          "+batches" if getattr(args, "batches", False) else ""), "bug": args.bug, "eps": args.eps, "seed": args.seed,
                      "bound": result.epsilon_lower_bound, "claimed": result.claimed_epsilon,
                      "headline": result.headline,
                      "violation": result.violation, "verdict": result.verdict, "seconds": round(seconds, 1),
                      **(watched(args) if getattr(args, "watch", False) else {}), **(extra or {})}))


def watched(args) -> dict:
    """The looks of a watched probe (its running.jsonl): the step of the first that read VIOLATION, or None."""
    from pathlib import Path

    path = Path(args.out) / "running.jsonl"
    looks = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    alarm = next((x["step"] for x in looks if x.get("violation")), None)
    final = next((x.get("epsilon_lower_bound") for x in looks if x.get("final")), None)
    return {"looks": len(looks), "alarm_step": alarm, "planned_steps": args.steps, "final_look_bound": final}


def clock() -> float:
    return time.perf_counter()
