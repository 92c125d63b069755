"""What DP-SGD and the audit add to a Hugging Face ``Trainer`` run (issue 54, item 3): the plain ``Trainer``,
``opacus_trainer`` (ghost clipping) and the same with ``DPAuditCallback`` (m canaries, repeats=1: the white-box
probe on the DP optimizer, the black-box scoring and the report), on the same random-weight Llama, data, batch
and steps, one after the other in one process. The callback's run is split: its end-of-run work (scoring,
audits, report: ``on_train_end``) is timed on its own, and what is left over the DP run is the per-step cost.

    .venv/bin/python benchmarks/hf_trainer_cost.py [--hidden 512 --layers 8 --batch 64 --steps 200]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=0)  # 0: the embedded tokenizer's (512): 34.1 M parameters
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--m", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from dpaudit.integrations.hf import DPAuditCallback, opacus_trainer
    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_model, build_tokenizer

    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    corpus = sentences(4000, seed=0)
    tok = build_tokenizer(corpus)
    rows = [{"text": " ".join(corpus[i:i + 3])} for i in range(4000)]

    def model():
        torch.manual_seed(0)
        return build_model(tok, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab or len(tok))

    def tokenised(data):
        return [dict(tok(r["text"], truncation=True, max_length=args.seq)) for r in data]

    def run(kind: str, folder: Path, steps: int | None = None) -> dict:
        data, callbacks, audit = rows, [], None
        if kind == "callback":
            audit, data = DPAuditCallback.prepare(tok, rows, m=args.m, out=folder / "audit", repeats=1, controls=0,
                                                  claimed_eps=8.0, delta=1e-5, secret_seed=3, canary_budget=1.0)
            callbacks = [audit]
            end = audit.on_train_end
            timed = {}

            def on_train_end(*a, **k):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = end(*a, **k)
                timed["end"] = time.perf_counter() - start
                return out
            audit.on_train_end = on_train_end
        settings = TrainingArguments(output_dir=str(folder / "out"), per_device_train_batch_size=args.batch,
                                     max_steps=steps or args.steps, learning_rate=1e-4, logging_steps=10**6, save_strategy="no",
                                     report_to=[], disable_tqdm=True, seed=0, use_cpu=not cuda)
        common = dict(model=model(), args=settings, train_dataset=tokenised(data),
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=callbacks)
        trainer = Trainer(**common) if kind == "plain" else opacus_trainer(noise_multiplier=1.0, max_grad_norm=1.0,
                                                                           **common)
        start = time.perf_counter()
        trainer.train()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        return {"kind": kind, "seconds": wall, "end_seconds": timed["end"] if audit else 0.0,
                "parameters": sum(p.numel() for p in common["model"].parameters())}

    with tempfile.TemporaryDirectory() as tmp:
        run("plain", Path(tmp) / "warm-up", steps=2)  # one-time costs (CUDA context, kernels, imports) apart
        out = {kind: run(kind, Path(tmp) / kind) for kind in ("plain", "opacus", "callback")}
    plain, dp, cb = out["plain"]["seconds"], out["opacus"]["seconds"], out["callback"]
    per_step = cb["seconds"] - cb["end_seconds"]
    table = {"device": torch.cuda.get_device_name() if cuda else "cpu", "parameters": out["plain"]["parameters"],
             "plain_s": plain, "opacus_s": dp, "callback_s": cb["seconds"], "callback_end_s": cb["end_seconds"],
             "opacus_over_plain": dp / plain, "callback_steps_over_opacus": per_step / dp,
             "callback_over_plain": cb["seconds"] / plain}
    if args.json:
        print(json.dumps(table))
        return
    print(f"{table['parameters'] / 1e6:.1f} M parameters, batch {args.batch} x {args.seq}, {args.steps} steps, "
          f"{table['device']}")
    print(f"plain Trainer {plain:.1f} s; opacus_trainer {dp:.1f} s ({dp / plain:.2f}x, goal <= 1.5x); "
          f"with DPAuditCallback {cb['seconds']:.1f} s ({cb['seconds'] / plain:.2f}x): its steps "
          f"{per_step:.1f} s ({per_step / dp - 1:+.1%} over opacus_trainer's, goal <= +5 %), "
          f"its end-of-run scoring and report {cb['end_seconds']:.1f} s")


if __name__ == "__main__":
    main()
