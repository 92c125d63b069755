import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _reference_dir() -> Path:
    for candidate in (REPO.parent / "shared" / "reference", REPO / "shared" / "reference"):
        if candidate.is_dir():
            return candidate
    return REPO.parent / "shared" / "reference"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    path = _reference_dir()
    if not path.is_dir():
        pytest.skip("../shared/reference is not present in this checkout")
    return path


os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded default architecture, built offline with a short pre-training (no downloads)."""
    from dpaudit.models.embedded import build_embedded_default

    return build_embedded_default(tmp_path_factory.mktemp("tiny") / "model", seed=0, pretrain_steps=20)
