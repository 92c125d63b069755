"""Make m new-token canaries (Panda et al. 2024): a random prefix, then one new vocabulary token as the secret.

Each canary is a member independently with probability 1/2. Secrets, prefixes and membership come from
three separate seeded streams, so neither the secret nor the prefix says anything about membership.
"""

from __future__ import annotations

import numpy as np

from dpaudit.canaries.hf import tokenizer_identity
from dpaudit.canaries.manifest import MAX_CANARIES, Canary, Manifest
from dpaudit.core.errors import DPAuditError

SECRET_ALPHABET = np.array(list("abcdefghijklmnopqrstuvwxyz0123456789"))
SECRET_LENGTH = 12


def _secrets(m: int, rng: np.random.Generator, vocab: dict) -> list[str]:
    secrets: list[str] = []
    seen = set(vocab)
    while len(secrets) < m:
        s = "<canary-" + "".join(rng.choice(SECRET_ALPHABET, SECRET_LENGTH)) + ">"
        if s not in seen:
            seen.add(s)
            secrets.append(s)
    return secrets


def _prefix_pool(tokenizer) -> np.ndarray:
    """Ordinary base-vocabulary tokens (no special tokens) that decode to whole printable characters,
    so prefixes survive a one-example-per-line file and read as text."""
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(tokenizer.vocab_size) if i not in special and _clean(tokenizer.decode([i]))]
    if not pool:
        raise DPAuditError("the tokenizer has no ordinary tokens to draw prefixes from")
    return np.array(pool)


def _clean(text: str) -> bool:
    return bool(text.strip()) and text.isprintable() and "\ufffd" not in text and "<" not in text


def make_canaries(tokenizer, m: int, seed: int = 0, prefix_length: int = 8, template: str | None = None,
                  name_or_path: str | None = None) -> Manifest:
    if m < 2:
        raise DPAuditError(f"need at least 2 canaries, got m={m}")
    if m > MAX_CANARIES:
        raise DPAuditError(f"at most {MAX_CANARIES} canaries, got m={m} (an audit's power saturates far below)")
    if template is None and prefix_length < 1:
        raise DPAuditError(f"prefix length must be >= 1, got {prefix_length}")
    secret_rng, prefix_rng, member_rng = (np.random.default_rng([seed, stream]) for stream in range(3))
    secrets = _secrets(m, secret_rng, tokenizer.get_vocab())
    if template is None:
        pool = _prefix_pool(tokenizer)
        prefixes = [tokenizer.decode(prefix_rng.choice(pool, prefix_length).tolist()) for _ in range(m)]
    else:
        prefixes = [template] * m
    membership = member_rng.random(m) < 0.5
    canaries = [Canary(i, s, p, bool(b)) for i, (s, p, b) in enumerate(zip(secrets, prefixes, membership))]
    return Manifest(seed=seed, tokenizer=tokenizer_identity(tokenizer, name_or_path),
                    prefix_kind="template" if template is not None else "random-tokens",
                    prefix_length=None if template is not None else prefix_length, canaries=canaries)
