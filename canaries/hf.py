"""Hugging Face side of the canaries: tokenizer identity, and extending a tokenizer and causal LM."""

from __future__ import annotations

import hashlib

from dpaudit.core.errors import DPAuditError
from dpaudit.canaries.manifest import Manifest, TokenizerIdentity
from dpaudit.models.extension import add_tokens, add_new_tokens


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
    """Add the canary tokens and resize the embeddings, ties kept; returns their ids. New output rows start at zero,
    or, where every canary has one shared prefix (a template), each at ``expected_row`` after it."""
    row = expected_row(model, tokenizer, manifest.canaries[0].prefix) \
        if manifest.prefix_kind == "template" and manifest.kind == "new-token" and manifest.canaries else None
    return add_new_tokens(model, tokenizer, list(manifest.secrets), row)


def expected_row(model, tokenizer, prefix: str):
    """E_{j ~ p(. | prefix)} w_j: the base model's output rows averaged by its next-token distribution after
    ``prefix``. A new token's loss after the prefix has gradient sum_j p_j w_j - w_secret with respect to the final
    hidden state, which is zero when every new row starts here (the new tokens' own probability then averages the
    same row), so at the start a canary's whole gradient lies on the output rows, nearly all on its own (the others
    take p_j h each): a run that trains the whole model keeps each canary on its own coordinates, as a new-token-only
    run does, instead of spending most of its clipped norm on the shared body (on the embedded default, the median
    share of a canary's gradient norm on its own row: 0.27 with zero rows after random 1-token prefixes, 0.999
    after one shared prefix with rows here). A public function of the base model and the prefix, the same for
    members and non-members."""
    ids = tokenizer(prefix, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    was = model.training
    model.eval()
    logits = model(input_ids=ids).logits[0, -1].detach().float()  # one short forward; nothing is stepped
    model.train(was)
    weight = model.get_output_embeddings().weight.detach().float()
    return (logits[:weight.shape[0]].softmax(-1) @ weight).cpu()


