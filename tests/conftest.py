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


@pytest.fixture(scope="session")
def llama_like_dir(tmp_path_factory) -> Path:
    """A Llama-family-like checkpoint: no bias terms, tied embeddings, untrained (no downloads)."""
    from dpaudit.atomic import save_model_folder
    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_model, build_tokenizer

    tok = build_tokenizer(sentences(500, seed=7))
    model = build_model(tok, seed=1, attention_bias=False, mlp_bias=False)
    return save_model_folder(tmp_path_factory.mktemp("llama") / "model", model, tok)


# The fast tier (`pytest -m "not slow"`: accounting, statistics, CLI and input handling, about 3 minutes on
# 2 cores) leaves out whatever builds or trains a model, launches torchrun or trains with Opacus. CI runs
# everything.
SLOW_FIXTURES = {"tiny_model_dir", "llama_like_dir"}
SLOW_MODULES = {"test_distributed", "test_probe", "test_whitebox", "test_audit_run", "test_gguf_e2e",
                "test_audit_e2e", "test_trainers", "test_faults", "test_lora_new_tokens", "test_dp_sgd_clipping",
                "test_mc_scale", "test_threads", "test_memory", "test_opacus_accountant"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: builds or trains a model (left out of the fast tier)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
