"""JSON from files a user handed us (manifests, configs, run files): size-capped before reading, depth
errors and malformed text turned into one line that names the file and never echoes its content."""

from __future__ import annotations

import json
from pathlib import Path

from dpaudit.core.errors import DPAuditError

MAX_BYTES = 64 << 20


def count_newlines(path: Path, what: str) -> int:
    """Newlines in a file, counted in 1 MiB blocks before anything is parsed (bounded memory)."""
    try:
        with open(path, "rb") as fh:
            return sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 20), b""))
    except OSError as exc:
        raise DPAuditError(f"cannot read {what} {path}: {exc.strerror or type(exc).__name__}") from None


def loads(text: str | bytes, what: str):
    """Parse ``text``; a malformed or absurdly nested document is one DPAuditError naming ``what``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise DPAuditError(f"{what} is nested too deeply to be a file dpaudit reads") from None
    except (ValueError, TypeError) as exc:
        where = f" (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise DPAuditError(f"{what} is not valid JSON{where}") from None


def load_json_file(path: Path, what: str, max_bytes: int = MAX_BYTES):
    """Read and parse the JSON file ``path`` (at most ``max_bytes``)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise DPAuditError(f"{path} ({what}) is {size} bytes, over the {max_bytes} bytes a {what} may have")
        data = path.read_bytes()
    except OSError as exc:
        raise DPAuditError(f"cannot read {path} ({what}): {exc.strerror or type(exc).__name__}") from None
    return loads(data, f"{path} ({what})")
