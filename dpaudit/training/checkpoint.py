"""A run's resume checkpoint: written beside the old one, swapped in, and verified before it is trusted.

A checkpoint folder holds the weights, the tokenizer, optionally ``optimizer.pt``, ``trainer_state.json``
(the step) and, written last, ``checkpoint_manifest.json``: the step and the SHA-256 and size of every
other file. A folder is *intact* when its manifest reads and every file it lists is there with that size
and hash; nothing else in a checkpoint is trusted (a kill, a full disk or a hand-edited file make a folder
that is not intact, and ``--resume`` passes it over).

Saving: build ``.checkpoint.tmp``, then ``checkpoint`` -> ``.checkpoint.old``, ``.checkpoint.tmp`` ->
``checkpoint``, then remove ``.checkpoint.old``. A kill between any two of these leaves at least one intact
copy, and ``newest_intact`` finds the one with the highest step among the three names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from dpaudit.core.atomic import atomic_write_json, follow_umask
from dpaudit.core.errors import DPAuditError
from dpaudit.core.run_record import CheckpointState, stamped, unstamped

FINAL, TMP, OLD = "checkpoint", ".checkpoint.tmp", ".checkpoint.old"
MANIFEST = "checkpoint_manifest.json"
STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"


def sha256_of(path: Path) -> str:
    """SHA-256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def seal(folder: Path, step: int) -> None:
    """Write the manifest of everything in ``folder`` (its last file: a folder without one is not intact)."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
             for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != MANIFEST}
    atomic_write_json(Path(folder) / MANIFEST, stamped(MANIFEST, {"step": int(step), "files": files}))


def intact_step(folder: Path) -> int | None:
    """The step of an intact checkpoint folder, or None (missing, unsealed, or any file changed)."""
    folder = Path(folder)
    try:
        if folder.is_symlink() or not folder.is_dir() or (folder / MANIFEST).stat().st_size > 1 << 20:
            return None
        manifest = unstamped(MANIFEST, json.loads((folder / MANIFEST).read_text(encoding="utf-8")), folder / MANIFEST)
        step, files = manifest["step"], manifest["files"]
        if type(step) is not int or step < 1 or not isinstance(files, dict) or STATE not in files:
            return None
        for name, facts in files.items():
            f = folder / name
            if Path(name).name != name or f.is_symlink() or not f.is_file():
                return None
            if f.stat().st_size != facts["bytes"] or sha256_of(f) != facts["sha256"]:
                return None
        state = CheckpointState.from_json(json.loads((folder / STATE).read_text(encoding="utf-8")), folder / STATE)
        return step if state.step == step else None
    except (OSError, ValueError, KeyError, TypeError, RecursionError, DPAuditError):
        return None


def save(run_dir: Path, step: int, write) -> None:
    """``write(folder)`` fills a new checkpoint folder; it is sealed and swapped in so that a crash at any
    point leaves an intact copy (the new one or the last)."""
    run_dir = Path(run_dir)
    tmp, final, old = run_dir / TMP, run_dir / FINAL, run_dir / OLD
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    follow_umask(tmp)
    seal(tmp, step)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def newest_intact(run_dir: Path) -> tuple[Path, int] | None:
    """The intact checkpoint with the highest step, moved to ``checkpoint`` if it had another name (the
    others removed), or None when there is none."""
    run_dir = Path(run_dir)
    found = [(step, run_dir / name) for name in (FINAL, TMP, OLD)
             if (step := intact_step(run_dir / name)) is not None]
    if not found:
        return None
    step, best = max(found, key=lambda f: f[0])
    final = run_dir / FINAL
    if best != final:
        if final.exists() or final.is_symlink():
            if final.is_symlink() or not final.is_dir():
                raise DPAuditError(f"{final} is not a checkpoint folder; move it away to resume")
            shutil.rmtree(final)
        os.replace(best, final)
    for name in (TMP, OLD):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return final, step


def remove(run_dir: Path) -> None:
    for name in (FINAL, TMP, OLD):
        shutil.rmtree(Path(run_dir) / name, ignore_errors=True)
