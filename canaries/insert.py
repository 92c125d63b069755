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

from dpaudit.core.atomic import atomic_write_text, guard_new_file
from dpaudit.canaries.manifest import CANARY_USER, Manifest, is_canary_user
from dpaudit.core.errors import DPAuditError
from dpaudit.core.texts import detect_format, jsonl_text, physical_lines, read_file

@dataclass(frozen=True)
class InsertSummary:
    output: Path
    original_examples: int
    inserted: int
    repeats: int


def _csv_records(text: str, field: str, path: Path) -> tuple[list[str], list[str], list[str]]:
    """(header lines, one raw chunk of lines per record, column names): records located by the csv parser
    (a quoted field may span lines), their bytes kept as they were."""
    lines = physical_lines(text)
    reader = csv.reader(line + "\n" for line in lines)
    try:
        header = next(reader)
    except StopIteration:
        raise DPAuditError(f"{path} is empty") from None
    if field not in header:
        raise DPAuditError(f"{path}: no column {field!r}; choose it with --field")
    head_end, chunks = reader.line_num, []
    start = head_end
    try:
        for _ in reader:
            chunks.append("\n".join(lines[start:reader.line_num]))
            start = reader.line_num
    except csv.Error as exc:
        raise DPAuditError(f"{path}: not valid CSV ({exc})") from None
    return lines[:head_end], chunks, header


def insert_canaries(manifest: Manifest, data: Path, output: Path, *, fmt: str | None = None, field: str = "text",
                    repeats: int = 1, seed: int = 0, force: bool = False, user_field: str | None = None) -> InsertSummary:
    """``user_field``: the user column of a user-level dataset; each inserted record carries its canary user's id
    there (CANARY_USER, refused where the data already uses one), so a run caps and samples it as that user."""
    data, output = Path(data), Path(output)
    fmt = detect_format(data, fmt)
    if user_field is not None and fmt == "txt":
        raise DPAuditError(f"{data}: a plain text file has no user column; give JSONL or CSV for --user-field")
    if repeats < 1:
        raise DPAuditError(f"--repeat must be >= 1, got {repeats}")
    if output.resolve() == data.resolve():
        raise DPAuditError("the output must be a new file: the input dataset is never modified in place")
    guard_new_file(output, force)
    members = manifest.members
    if not members:
        raise DPAuditError("the manifest has no member canaries to insert")
    rows = [(t, CANARY_USER.format(c.index)) for c in members for t in c.texts for _ in range(repeats)]
    canary_texts = [t for t, _ in rows]   # a canary user: all its records
    text = read_file(data)
    rng = np.random.default_rng(seed)
    # Every original line is copied byte for byte (parsed only to validate and find the text); the
    # canaries are new lines, shuffled in among the original records.
    crlf = text.count("\r\n") * 2 > text.count("\n")
    end = "\r" if crlf else ""
    header: list[str] = []
    if fmt == "jsonl":
        records = physical_lines(text)
        for n, line in enumerate(records, 1):
            if line.strip():
                jsonl_text(line, field, data, n)
                if user_field is not None and is_canary_user(json.loads(line).get(user_field)):
                    raise DPAuditError(f"{data}:{n}: a record's user id is a canary user's ({CANARY_USER.format('N')})")
        new = [json.dumps({field: t, **({user_field: u} if user_field else {})}, ensure_ascii=False) + end
               for t, u in rows]
    elif fmt == "txt":
        if any(ch in t for t in canary_texts for ch in "\r\n"):
            raise DPAuditError("a canary spans several lines and cannot go into a one-example-per-line file")
        records = physical_lines(text)
        new = [t + end for t in canary_texts]
    else:
        header, records, columns = _csv_records(text, field, data)
        if user_field is not None:
            if user_field not in columns:
                raise DPAuditError(f"{data}: no column {user_field!r} to say whose each record is (--user-field)")
            at = columns.index(user_field)
            if any(is_canary_user(row[at]) for row in csv.reader(records) if len(row) > at):
                raise DPAuditError(f"{data}: a record's user id is a canary user's ({CANARY_USER.format('N')})")
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, restval="", lineterminator="\n")
        writer.writerows({field: t, **({user_field: u} if user_field else {})} for t, u in rows)
        new = [line + end for line in buf.getvalue().rstrip("\n").split("\n")] if canary_texts else []
        if any("\n" in t for t in canary_texts):
            raise DPAuditError("a canary spans several lines; CSV insertion keeps one line per canary")
    n = sum(1 for r in records if r.strip())
    body = "\n".join(header + _shuffled(records + new, rng)) + "\n"
    atomic_write_text(output, body)
    return InsertSummary(output=output, original_examples=n, inserted=len(canary_texts), repeats=repeats)


def _shuffled(items: list, rng: np.random.Generator) -> list:
    return [items[i] for i in rng.permutation(len(items))]
