"""Training texts from a dataset file: JSONL (a text field), plain text (one example per line) or CSV
(a column). Read by the trainers and by canary insertion (which writes the same formats back)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from dpaudit.core.errors import DPAuditError

FORMATS = ("jsonl", "txt", "csv")


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


def physical_lines(text: str) -> list[str]:
    """Physical lines, split on "\n" only (never on form feed, NEL or U+2028, which may sit inside a text);
    a carriage return stays on its line, so every line can be copied byte for byte."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def jsonl_text(line: str, field: str, path: Path, n: int) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DPAuditError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise DPAuditError(f"{path}:{n}: nested too deeply to be a training example") from None
    if not isinstance(row, dict) or field not in row:
        raise DPAuditError(f"{path}:{n}: no {field!r} field (choose it with --field)")
    if not isinstance(row[field], str):
        raise DPAuditError(f"{path}:{n}: field {field!r} is not text")
    return row[field]


def read_texts(path: Path, fmt: str, field: str = "text") -> list[str]:
    """The training texts of a dataset file (used by the trainer too)."""
    text = read_file(path)
    if fmt == "jsonl":
        return [jsonl_text(line, field, path, n) for n, line in enumerate(physical_lines(text), 1) if line.strip()]
    if fmt == "txt":
        return [line.rstrip("\r") for line in physical_lines(text) if line.strip()]
    try:
        return [row[field] for row in csv_reader(text, field, path)]
    except csv.Error as exc:
        raise DPAuditError(f"{path}: not readable as CSV ({exc})") from None


def csv_reader(text: str, field: str, path: Path) -> csv.DictReader:
    # A field may be as long as the file (csv's default cap, 128 KiB, would refuse a long example).
    csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if field not in (reader.fieldnames or []):
        raise DPAuditError(f"{path}: no column {field!r}; choose it with --field")
    return reader


def read_file(path: Path) -> str:
    if not path.is_file():
        raise DPAuditError(f"dataset not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DPAuditError(f"cannot read dataset {path}: {exc}") from None
