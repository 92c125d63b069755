"""`dpaudit canaries make|insert|extend`: new-token canaries, into a dataset and into a model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dpaudit.core.atomic import guard_new_file, guard_new_folder, refuse_overlap, save_model_folder
from dpaudit.cli.common import LONG_TIMEOUT, ForceOpt, JsonOpt, ThreadsOpt, bounded, emit
from dpaudit.canaries.manifest import NEW_TOKEN_PREFIX, load_manifest
from dpaudit.core.threads import set_threads
from dpaudit.canaries.generate import make_canaries
from dpaudit.canaries.hf import check_base_tokenizer, extend_model
from dpaudit.canaries.insert import insert_canaries
from dpaudit.models.embedded import embedded_marker
from dpaudit.models.hf import load_tokenizer
from dpaudit.models.loading import load_causal_lm

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=False, help="Make new-token canaries and put them into data and models.")
ManifestOpt = Annotated[Path, typer.Option("--canaries", "-c", help="Canary manifest (JSON) from `canaries make`.")]


@app.command("make")
@bounded("dpaudit canaries make", LONG_TIMEOUT, None)
def make(
    tokenizer: Annotated[Path, typer.Option("--tokenizer", "-t", help="Local tokenizer or model: a Hugging Face folder, a hub-cache folder or a .gguf file.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Manifest to write (JSON).")],
    m: Annotated[int, typer.Option("-m", "--count", help="Number of canaries.")] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Public seed for secrets and prefixes (membership is drawn "
                                                     "from OS entropy: the bounds' guarantee is over its draw).")] = 0,
    prefix_length: Annotated[int, typer.Option("--prefix-length", help=(
        "Random prefix tokens per canary (default 1: a longer prefix is more loss to learn, whose gradient crowds "
        "the secret's row out of the clipped norm)."))] = NEW_TOKEN_PREFIX,
    template: Annotated[Optional[str], typer.Option(
        "--template", help="Use this text as every canary's prefix instead of random tokens. `canaries extend` "
                           "then starts every canary's row at the model's expected output row after it, so when "
                           "your run trains the whole model (or LoRA with the canaries' rows) a canary's gradient "
                           "starts on its own row: audit run's layout there.")] = None,
    records: Annotated[int, typer.Option(
        "--records", help="Canary users of this many records (distinct random prefixes, one secret), for a "
                          "user-level audit: at most the run's --records-per-user.")] = 1,
    held_out: Annotated[int, typer.Option(
        "--held-out", help="Held-out records of each canary user, never inserted: the user-inference score "
                           "(audit checkpoint --score user-inference) reads them.")] = 0,
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Generate m canaries (secret = one new token), each a member with probability 1/2; write the manifest."""

    set_threads(threads)  # a GGUF tokenizer is converted (with its model) on first use
    refuse_overlap(output, {"tokenizer": tokenizer})
    guard_new_file(output, force)
    manifest = make_canaries(load_tokenizer(tokenizer), m, seed, prefix_length, template, name_or_path=str(tokenizer),
                             records=records, held_out=held_out)
    manifest.save(output)
    summary = {"command": "canaries make", "manifest": str(output), "m": m, "members": len(manifest.members),
               "seed": seed, "tokenizer": manifest.tokenizer.name_or_path, "example": manifest.canaries[0].text}
    emit(summary, as_json, f"wrote {m} canaries ({len(manifest.members)} members) to {output}; "
                           f"e.g. {manifest.canaries[0].text!r}")


@app.command("insert")
@bounded("dpaudit canaries insert", LONG_TIMEOUT, None)
def insert(
    canaries: ManifestOpt,
    data: Annotated[Path, typer.Option("--data", "-d", help="Dataset: .jsonl, .txt (one example per line) or .csv.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="New dataset file to write.")],
    fmt: Annotated[Optional[str], typer.Option("--format", help="jsonl, txt or csv (default: from the name).")] = None,
    field: Annotated[str, typer.Option("--field", help="JSONL field or CSV column with the text.")] = "text",
    repeat: Annotated[int, typer.Option("--repeat", "-r", help="Copies of each member canary.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Shuffle seed.")] = 0,
    user_field: Annotated[Optional[str], typer.Option(
        "--user-field", help="A user-level dataset's user column: each canary record carries its canary user's id "
                             "there (dpaudit-canary-N), so `train --unit user` caps and samples it as that user.")] = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Shuffle the member canaries into a copy of a dataset (the input file is never modified)."""

    refuse_overlap(output, {"canary manifest": canaries, "dataset": data})
    s = insert_canaries(load_manifest(canaries), data, output, fmt=fmt, field=field, repeats=repeat, seed=seed,
                        force=force, user_field=user_field)
    summary = {"command": "canaries insert", "output": str(s.output), "original_examples": s.original_examples,
               "inserted": s.inserted, "repeats": s.repeats}
    emit(summary, as_json, f"wrote {s.output}: {s.original_examples} examples + {s.inserted} canary copies "
                           f"({s.repeats} per member)")


@app.command("extend")
@bounded("dpaudit canaries extend", LONG_TIMEOUT, None)
def extend(
    model: Annotated[Path, typer.Option("--model", help="Local causal LM: a Hugging Face folder, a hub-cache folder or a .gguf file.")],
    canaries: ManifestOpt,
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the extended model.")],
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Add the canary tokens to a model's tokenizer and embeddings (new output rows zero, or behind a --template
    prefix at the model's expected row after it; ties kept)."""

    set_threads(threads)
    refuse_overlap(output, {"model": model, "canary manifest": canaries}, folder_output=True)
    guard_new_folder(output, force)
    manifest = load_manifest(canaries)
    lm, tok = load_causal_lm(model)
    check_base_tokenizer(tok, manifest, str(model))
    ids = extend_model(lm, tok, manifest)
    save_model_folder(output, lm, tok, embedded_marker(model))
    summary = {"command": "canaries extend", "output": str(output), "added_tokens": len(ids),
               "vocab_size": len(tok)}
    emit(summary, as_json, f"wrote {output}: {len(ids)} canary tokens added, vocabulary {len(tok)}")
