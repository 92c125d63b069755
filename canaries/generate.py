"""Make m canaries: a random prefix, then the secret.

- ``new-token`` (Panda et al. 2024): the secret is one new vocabulary token (the model is extended with it).
- ``existing``: the secret is a random span of the model's own ordinary tokens (no vocabulary resize, so a LoRA
  that freezes the embeddings still trains it), as memaudit's default and Carlini et al.'s random-sequence
  canaries. Prefix and secret are drawn so that the tokenizer gives back exactly the prefix's tokens followed by
  the secret's, so the secret span is known at scoring, whatever the tokenizer merges.

Each canary is a member independently with probability 1/2. Secrets and prefixes come from the public seed;
membership comes from secret randomness (OS entropy, or ``membership_seed`` for tests), never from the public
seed: a one-run bound's guarantee is over the draw of membership, so one draw shared by every run with the same
seed would make its error rate that draw's. (It was: seed 0 drew 555 members of 1000, and on scores of pure
noise the one-sided headline then exceeded 0 in 19 % of 200 runs against 1 % with fresh draws.)
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from dpaudit.canaries.hf import tokenizer_identity
from dpaudit.canaries.manifest import MAX_CANARIES, MAX_USER_RECORDS, NEW_TOKEN_PREFIX, Canary, Manifest
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


def shared_prefix(tokenizer, seed: int = 0) -> str:
    """One prefix for every canary (a template): a token of the prefix pool drawn from the public seed. Behind one
    shared prefix, new-token canaries' rows can start where a run that trains the whole model keeps each canary's
    gradient on its own row (canaries/hf.expected_row)."""
    pool = _prefix_pool(tokenizer)
    return tokenizer.decode([int(pool[np.random.default_rng([seed, 3]).integers(len(pool))])])


def _clean(text: str) -> bool:
    return bool(text.strip()) and text.isprintable() and "\ufffd" not in text and "<" not in text


SECRET_TOKENS = 6  # an existing canary's secret span: 6 tokens of a ~50k vocabulary is ~94 bits


def membership(m: int, membership_seed: int | None = None) -> np.ndarray:
    """m independent fair coins from secret randomness (OS entropy unless ``membership_seed``, for tests)."""
    secret = membership_seed if membership_seed is not None else int.from_bytes(os.urandom(8), "little")
    return np.random.default_rng([secret, 0x6d656d62]).random(m) < 0.5


def redraw_membership(manifest: Manifest, membership_seed: int | None = None, *, mixed: bool = False) -> Manifest:
    """``manifest`` with every canary's membership drawn afresh (``membership``), secrets and prefixes kept: a
    rerun that reuses canaries (and the model extended for them) must not reuse their coins. ``mixed``: coins that
    came up all members or all non-members turn the first canary's, since an audit needs both (small m only; at
    m = 1000 that has probability 2^-999)."""
    coins = membership(len(manifest.canaries), membership_seed)
    if mixed and len(coins) > 1 and (coins.all() or not coins.any()):
        coins[0] = not coins[0]
    return replace(manifest, canaries=[replace(c, member=bool(b)) for c, b in zip(manifest.canaries, coins)])


def make_existing_canaries(tokenizer, m: int, seed: int = 0, prefix_length: int = 8,
                           secret_length: int = SECRET_TOKENS, name_or_path: str | None = None,
                           membership_seed: int | None = None) -> Manifest:
    """m canaries whose secret is ``secret_length`` random ordinary tokens of the tokenizer's own vocabulary."""
    _check_count(m)
    if prefix_length < 1 or secret_length < 1:
        raise DPAuditError(f"prefix and secret lengths must be >= 1, got {prefix_length} and {secret_length}")
    pool = _prefix_pool(tokenizer)
    if len(pool) < 256:
        raise DPAuditError(f"the tokenizer has {len(pool)} ordinary tokens ({tokenizer.vocab_size} in all); existing-"
                           "vocabulary canaries need at least 256 to make secrets no one guesses (use new-token canaries)")
    secret_rng, prefix_rng = (np.random.default_rng([seed, stream, 1]) for stream in range(2))
    canaries, seen = [], set()
    while len(canaries) < m:
        prefix = tokenizer.decode(prefix_rng.choice(pool, prefix_length).tolist())
        secret = tokenizer.decode(secret_rng.choice(pool, secret_length).tolist())
        if secret in seen or not split_secret(tokenizer, prefix, secret):
            continue  # the tokenizer merges across the boundary: draw again (rare)
        seen.add(secret)
        canaries.append(Canary(len(canaries), secret, prefix, False))
        if len(seen) > 50 * m + 1000:
            raise DPAuditError("the tokenizer merges most drawn canaries across their prefix: use new-token canaries")
    canaries = [Canary(c.index, c.secret, c.prefix, bool(b)) for c, b in zip(canaries, membership(m, membership_seed))]
    return Manifest(seed=seed, tokenizer=tokenizer_identity(tokenizer, name_or_path), prefix_kind="random-tokens",
                    prefix_length=prefix_length, canaries=canaries, kind="existing", secret_length=secret_length)


def split_secret(tokenizer, prefix: str, secret: str) -> tuple[list[int], list[int]] | None:
    """(prefix ids, secret ids) when the tokenizer reads prefix + secret as the prefix's tokens followed by the
    secret's (and gives the text back unchanged), else None."""
    head = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    full = tokenizer(prefix + secret, add_special_tokens=False)["input_ids"]
    if full[:len(head)] != head or len(full) == len(head):
        return None
    if tokenizer.decode(full) != prefix + secret:
        return None
    return head, full[len(head):]


def _check_count(m: int) -> None:
    if m < 2:
        raise DPAuditError(f"need at least 2 canaries, got m={m}")
    if m > MAX_CANARIES:
        raise DPAuditError(f"at most {MAX_CANARIES} canaries, got m={m} (an audit's power saturates far below)")


def make_canaries(tokenizer, m: int, seed: int = 0, prefix_length: int = NEW_TOKEN_PREFIX, template: str | None = None,
                  name_or_path: str | None = None, membership_seed: int | None = None, records: int = 1,
                  held_out: int = 0) -> Manifest:
    """``records`` > 1 or ``held_out``: canary users, each of ``records`` records (its prefixes differ, its secret is
    one) and ``held_out`` further prefixes kept out of the data for the user-inference score; their prefixes are
    drawn after every canary's first, so a canary's first record is the same whatever the user's size."""
    _check_count(m)
    if template is None and prefix_length < 1:
        raise DPAuditError(f"prefix length must be >= 1, got {prefix_length}")
    if records < 1 or held_out < 0 or records + held_out > MAX_USER_RECORDS + 1:
        raise DPAuditError(f"a canary user holds 1 to {MAX_USER_RECORDS + 1} records and held-out records in all, "
                           f"got {records} and {held_out}")
    if template is not None and records + held_out > 1:
        raise DPAuditError("canary users draw a random prefix for each record; a template is one prefix")
    secret_rng, prefix_rng = (np.random.default_rng([seed, stream]) for stream in range(2))
    secrets = _secrets(m, secret_rng, tokenizer.get_vocab())
    if template is None:
        pool = _prefix_pool(tokenizer)
        prefixes = [tokenizer.decode(prefix_rng.choice(pool, prefix_length).tolist()) for _ in range(m)]
    else:
        prefixes = [template] * m
    extra = ([[tokenizer.decode(prefix_rng.choice(pool, prefix_length).tolist()) for _ in range(records + held_out - 1)]
              for _ in range(m)] if records + held_out > 1 else [[] for _ in range(m)])
    coins = membership(m, membership_seed)
    canaries = [Canary(i, s, p, bool(b), tuple(more[:records - 1]), tuple(more[records - 1:]))
                for i, (s, p, b, more) in enumerate(zip(secrets, prefixes, coins, extra))]
    return Manifest(seed=seed, tokenizer=tokenizer_identity(tokenizer, name_or_path),
                    prefix_kind="template" if template is not None else "random-tokens",
                    prefix_length=None if template is not None else prefix_length, canaries=canaries)
