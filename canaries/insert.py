"""Insert the member canaries into a user's dataset: JSONL (a text field), plain text (one example per
line) or CSV (a column). Members may be repeated r times; all are shuffled in with a seed. The input file
is never modified: the result goes to a new file, written atomically."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpaudit.atomic import atomic_write_text, guard_new_file
from dpaudit.canaries.manifest import Manifest
from dpaudit.errors import DPAuditError

FORMATS = ("jsonl", "txt", "csv")


@dataclass(frozen=True)
class InsertSummary:
    output: Path
    original_examples: int
    inserted: int
    repeats: int


def detect_format(path: Path, fmt: str | None) -> str:
    if fmt:
        if fmt not in FORMATS:
            raise DPAuditError(f"unknown dataset format {fmt!r}; use one of {', '.join(FORMATS)}")
        return fmt
    suffix = path.suffix.lower().lstrip(".")
    if suffix in ("jsonl", "ndjson"):
        return "jsonl"
    if suffix in ("txt", "text"):
        return "txt"
    if suffix == "csv":
        return "csv"
    raise DPAuditError(f"cannot tell the format of {path} from its name; pass --format jsonl|txt|csv")


def _read_jsonl(text: str, field: str, path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DPAuditError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or field not in row:
            raise DPAuditError(f"{path}:{n}: no {field!r} field (choose it with --field)")
        rows.append(row)
    return rows


def read_texts(path: Path, fmt: str, field: str = "text") -> list[str]:
    """The training texts of a dataset file (used by the trainer too)."""
    text = _read(path)
    if fmt == "jsonl":
        return [str(r[field]) for r in _read_jsonl(text, field, path)]
    if fmt == "txt":
        return [line for line in text.splitlines() if line.strip()]
    return [row[field] for row in _csv_reader(text, field, path)]


def _csv_reader(text: str, field: str, path: Path) -> csv.DictReader:
    reader = csv.DictReader(io.StringIO(text))
    if field not in (reader.fieldnames or []):
        raise DPAuditError(f"{path}: no column {field!r} (columns: {reader.fieldnames}); choose it with --field")
    return reader


def _read(path: Path) -> str:
    if not path.is_file():
        raise DPAuditError(f"dataset not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DPAuditError(f"cannot read dataset {path}: {exc}") from None


def insert_canaries(manifest: Manifest, data: Path, output: Path, *, fmt: str | None = None, field: str = "text",
                    repeats: int = 1, seed: int = 0, force: bool = False) -> InsertSummary:
    data, output = Path(data), Path(output)
    fmt = detect_format(data, fmt)
    if repeats < 1:
        raise DPAuditError(f"--repeat must be >= 1, got {repeats}")
    if output.resolve() == data.resolve():
        raise DPAuditError("the output must be a new file: the input dataset is never modified in place")
    guard_new_file(output, force)
    members = manifest.members
    if not members:
        raise DPAuditError("the manifest has no member canaries to insert")
    canary_texts = [c.text for c in members for _ in range(repeats)]
    text = _read(data)
    rng = np.random.default_rng(seed)
    if fmt == "jsonl":
        rows = [json.dumps(r, ensure_ascii=False) for r in _read_jsonl(text, field, data)]
        new = [json.dumps({field: t}, ensure_ascii=False) for t in canary_texts]
        n = len(rows)
        out = _shuffled(rows + new, rng)
        body = "\n".join(out) + "\n"
    elif fmt == "txt":
        if any("\n" in t for t in canary_texts):
            raise DPAuditError("a canary spans several lines and cannot go into a one-example-per-line file")
        rows = [line for line in text.splitlines() if line.strip()]
        n = len(rows)
        body = "\n".join(_shuffled(rows + canary_texts, rng)) + "\n"
    else:
        reader = _csv_reader(text, field, data)
        rows = list(reader)
        n = len(rows)
        new = [{field: t} for t in canary_texts]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=reader.fieldnames, restval="")
        writer.writeheader()
        writer.writerows(_shuffled(rows + new, rng))
        body = buf.getvalue()
    atomic_write_text(output, body)
    return InsertSummary(output=output, original_examples=n, inserted=len(canary_texts), repeats=repeats)


def _shuffled(items: list, rng: np.random.Generator) -> list:
    return [items[i] for i in rng.permutation(len(items))]
