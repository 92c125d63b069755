"""Whose each training record is, and the cap at k records a user that user-level accounting needs.

User-level DP (accounting/unit.py) bounds what one user's records change, so every user must contribute at most k
records to what trains. The cap keeps, of each user's records, k chosen at random by a generator seeded with
the run's public seed and the user's own id, in file order. It never reads a record's text, and it never
depends on another user's records: adding or removing one user changes the capped data by that user's (at most
k) records and nothing else, the user-level neighbouring relation. A cap drawn from one shared stream would not
do: removing a user would shift every later user's draw.

The user column: a JSONL field or a CSV column (``--user-field``), text or an integer; a record without it is
refused (a run cannot be user-level on records of unknown owners). Plain text files have no columns.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from dpaudit.core.errors import DPAuditError
from dpaudit.core.texts import csv_reader, physical_lines, read_file

MAX_USER_ID = 256  # characters of a user id


@dataclass(frozen=True)
class Capped:
    """The records kept (file order) and what the cap did: users, records read, records dropped."""
    texts: list[str]
    users: list[str]
    read: int

    @property
    def dropped(self) -> int:
        return self.read - len(self.texts)

    @property
    def user_count(self) -> int:
        return len(set(self.users))


def read_user_texts(path: Path, fmt: str, field: str, user_field: str) -> tuple[list[str], list[str]]:
    """(texts, user ids) of a dataset file, one each a record."""
    if fmt == "txt":
        raise DPAuditError(f"{path}: a plain text file has no user column; give JSONL or CSV with a --user-field")
    text = read_file(path)
    texts, users = [], []
    if fmt == "jsonl":
        for n, line in enumerate(physical_lines(text), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                raise DPAuditError(f"{path}:{n}: not a JSON record") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise DPAuditError(f"{path}:{n}: no text field {field!r} (choose it with --field)")
            texts.append(row[field])
            users.append(user_id(row.get(user_field), user_field, f"{path}:{n}"))
        return texts, users
    reader = csv_reader(text, field, path)
    if user_field not in (reader.fieldnames or []):
        raise DPAuditError(f"{path}: no column {user_field!r} to say whose each record is; choose it with --user-field")
    for n, row in enumerate(reader, 2):
        texts.append(row[field])
        users.append(user_id(row[user_field], user_field, f"{path}:{n}"))
    return texts, users


def user_id(value, field: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value).strip() == "":
        raise DPAuditError(f"{where}: no user id in {field!r} (every record of a user-level run needs its owner)")
    value = str(value)
    if len(value) > MAX_USER_ID:
        raise DPAuditError(f"{where}: a user id over {MAX_USER_ID} characters")
    return value


def capped_indices(users: list, k: int, seed: int = 0) -> list[int]:
    """The positions kept by the cap of ``k`` records a user, in order: those over k keep k of theirs at random (a
    generator seeded by ``seed`` and the user's id alone)."""
    rows = defaultdict(list)
    for i, user in enumerate(users):
        rows[str(user)].append(i)
    kept = set()
    for user, idx in rows.items():
        if len(idx) <= k:
            kept.update(idx)
            continue
        digest = hashlib.sha256(f"{seed}\0{user}".encode()).digest()
        kept.update(random.Random(int.from_bytes(digest[:8], "big")).sample(idx, k))
    return sorted(kept)


def cap_records(texts: list[str], users: list[str], k: int, seed: int = 0) -> Capped:
    """At most ``k`` records a user (``capped_indices``), in file order."""
    if len(texts) != len(users):
        raise DPAuditError("one user id a record is needed")
    order = capped_indices(users, k, seed)
    return Capped([texts[i] for i in order], [users[i] for i in order], len(texts))


def user_indices(users: list) -> tuple[list[int], int]:
    """(each record's user index, the number of users): users numbered in order of first appearance."""
    index: dict[str, int] = {}
    return [index.setdefault(str(u), len(index)) for u in users], len(index)
