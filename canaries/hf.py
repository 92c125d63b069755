"""Hugging Face side of the canaries: tokenizer identity, and extending a tokenizer and causal LM."""

from __future__ import annotations

import hashlib

from dpaudit.core.errors import DPAuditError
from dpaudit.canaries.manifest import Manifest, TokenizerIdentity
from dpaudit.models.extension import add_tokens, add_zero_tokens


def tokenizer_identity(tokenizer, name_or_path: str | None = None) -> TokenizerIdentity:
    """Fingerprint of the base vocabulary (ids below vocab_size), so added canary tokens do not change it."""
    base = sorted((tok, idx) for tok, idx in tokenizer.get_vocab().items() if idx < tokenizer.vocab_size)
    digest = hashlib.sha256(repr(base).encode("utf-8")).hexdigest()
    return TokenizerIdentity(name_or_path=str(name_or_path or tokenizer.name_or_path),
                             base_vocab_size=int(tokenizer.vocab_size), fingerprint=digest)

def check_base_tokenizer(tokenizer, manifest: Manifest, where: str) -> None:
    """Refuse a tokenizer whose base vocabulary is not the one the manifest was made for."""
    ident = tokenizer_identity(tokenizer)
    if ident.fingerprint != manifest.tokenizer.fingerprint:
        raise DPAuditError(
            f"the canary manifest was made for another tokenizer ({manifest.tokenizer.name_or_path}, "
            f"{manifest.tokenizer.base_vocab_size} tokens) than the one in {where} ({ident.base_vocab_size} tokens)")

def check_tokenizer_matches(tokenizer, manifest: Manifest, where: str) -> None:
    """Refuse a tokenizer that is not the manifest's, or that lacks the canary tokens."""
    check_base_tokenizer(tokenizer, manifest, where)
    if manifest.kind == "existing":  # secrets are spans of the base vocabulary, checked above
        return
    vocab = tokenizer.get_vocab()
    missing = [s for s in manifest.secrets if s not in vocab]
    if missing:
        raise DPAuditError(f"{len(missing)} of {len(manifest.secrets)} canary tokens are absent from {where} "
                           f"(e.g. {missing[0]}); was the model extended with these canaries?")

def extend_tokenizer(tokenizer, manifest: Manifest) -> list[int]:
    """Add each secret as one new token; returns their ids."""
    return add_tokens(tokenizer, list(manifest.secrets))


def extend_model(model, tokenizer, manifest: Manifest) -> list[int]:
    """Add the canary tokens and resize the embeddings: new output rows start at zero, ties are kept."""
    return add_zero_tokens(model, tokenizer, list(manifest.secrets))


