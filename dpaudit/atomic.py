"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from dpaudit.errors import DPAuditError


def check_replaceable(path: Path) -> None:
    """Only a regular file is ever replaced: never a device, FIFO, socket, folder or symbolic link."""
    path = Path(path)
    if path.is_symlink():
        raise DPAuditError(f"{path} is a symbolic link; refusing to replace it (write to a plain path)")
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file (a device, FIFO or socket)"
        raise DPAuditError(f"{path} is {kind}; refusing to replace it")


def guard_new_file(path: Path, force: bool) -> None:
    """Refuse to replace a file the user already has, unless told to; never replace anything but a file."""
    path = Path(path)
    check_replaceable(path)
    if path.exists() and not force:
        raise DPAuditError(f"{path} exists; pass --force to replace it")


def guard_new_folder(path: Path, force: bool) -> None:
    """Refuse to write into a non-empty folder the user already has, unless told to; --force only ever
    reuses a folder dpaudit made (it holds the marker), never one of the user's."""
    from dpaudit.lock import LOCK, MARKER, is_marked

    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise DPAuditError(f"{path} is not a plain folder")
    if path.exists() and any(p.name not in (MARKER, LOCK) for p in path.iterdir()):
        if not force:
            raise DPAuditError(f"{path} is not empty; pass --force to write into it")
        if not is_marked(path):
            raise DPAuditError(f"{path} is not empty and was not made by dpaudit; --force only replaces dpaudit's "
                               "own folders (use a new folder)")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the user's usual mode
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: Path, data: object) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


@contextmanager
def atomic_folder(path: Path):
    """Build a folder beside ``path`` and rename it into place at the end: a failure (disk full, a kill)
    leaves no half-written folder, only the old one (if any), untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the user's usual mode
    try:
        yield tmp
        old = None
        if path.exists():
            if path.is_symlink() or not path.is_dir():
                raise DPAuditError(f"{path} is not a plain folder; refusing to replace it")
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "x")
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_model_folder(path: Path, model, tokenizer, extra_json: dict | None = None, state_dict=None) -> Path:
    """A Hugging Face model folder (safetensors, plus ``extra_json`` files), written whole or not at all,
    marked as dpaudit's. ``state_dict``: the weights to write instead of the model's own."""
    from dpaudit.lock import mark

    with atomic_folder(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for name, data in (extra_json or {}).items():
            atomic_write_json(tmp / name, data)
        mark(tmp)
    return Path(path)
