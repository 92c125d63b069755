"""`dpaudit model embedded|convert`: a plain Hugging Face model folder to start from (what `train`, `canaries make
-t`, `audit checkpoint` and a Trainer's ``reference=`` take), without running an audit for its side effect."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dpaudit.cli.common import MODEL_TIMEOUT, ForceOpt, JsonOpt, ThreadsOpt, bounded, emit
from dpaudit.core.atomic import guard_new_folder, refuse_overlap
from dpaudit.core.threads import set_threads
from dpaudit.core.errors import DPAuditError
from dpaudit.models.embedded import build_embedded_default
from dpaudit.models.gguf import convert_to, gguf_file_in

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=False,
                  help="Get a plain model folder: the embedded default, or a GGUF file converted.")


@app.command("embedded")
@bounded("dpaudit model embedded", MODEL_TIMEOUT, None)
def embedded(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the model.")],
    seed: Annotated[int, typer.Option("--seed", help="Public seed of its tokenizer corpus and weights.")] = 0,
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Build the embedded default (a small causal LM, offline, about 20 s on 2 cores): the model `audit run`
    trains when given none."""

    set_threads(threads)
    guard_new_folder(output, force)
    build_embedded_default(output, seed=seed)
    emit({"command": "model embedded", "output": str(output), "seed": seed}, as_json,
         f"wrote the embedded default model to {output}")


@app.command("convert")
@bounded("dpaudit model convert", MODEL_TIMEOUT, None)
def convert(
    source: Annotated[Path, typer.Argument(help="A .gguf file (or a folder holding exactly one).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the plain model.")],
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Convert a GGUF checkpoint (llama.cpp's format, dequantised) into a plain Hugging Face folder (safetensors and
    its tokenizer): for a Trainer or TRL run (`save_pretrained` refuses a GGUF-loaded model) and for the HF
    callback's ``reference=``. The header is checked before any library reads the file."""

    set_threads(threads)
    gguf = gguf_file_in(Path(source))
    if gguf is None:
        raise DPAuditError(f"{source} is not a .gguf file (nor a folder holding exactly one)")
    refuse_overlap(output, {"GGUF file": gguf}, folder_output=True)
    guard_new_folder(output, force)
    convert_to(gguf, output)
    emit({"command": "model convert", "source": str(gguf), "output": str(output)}, as_json,
         f"converted {gguf} to {output}")
