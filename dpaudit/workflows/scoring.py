"""Score canaries on a model: the loss of the secret (the new token, or the span of existing tokens) given its
prefix, batched, on the secret only; score = -loss."""

from __future__ import annotations

import numpy as np

from dpaudit.canaries.hf import check_tokenizer_matches
from dpaudit.canaries.manifest import Manifest
from dpaudit.core.errors import DPAuditError
from dpaudit.core.progress import progress_bar


def secret_losses(model, tokenizer, manifest: Manifest, batch_size: int = 32, show_progress: bool = True,
                  description: str = "scoring canaries") -> np.ndarray:
    """Per-canary cross-entropy of the secret only (nats, summed over an existing canary's span), in manifest
    order."""
    import torch

    if manifest.kind == "existing":
        return span_losses(model, tokenizer, manifest, batch_size, show_progress, description)

    secret_ids = tokenizer.convert_tokens_to_ids(manifest.secrets)
    encoded = [tokenizer(c.text, add_special_tokens=False)["input_ids"] for c in manifest.canaries]
    positions = []
    for c, ids, sid in zip(manifest.canaries, encoded, secret_ids):
        where = [i for i, t in enumerate(ids) if t == sid]
        if not where or where[-1] == 0:
            raise DPAuditError(f"canary {c.index}: its secret is not a separate token after a prefix")
        positions.append(where[-1])
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    losses = np.empty(len(encoded))
    was_training = model.training
    model.eval()
    with torch.no_grad(), progress_bar(len(encoded), description, show_progress) as advance:
        for start in range(0, len(encoded), batch_size):
            chunk = range(start, min(start + batch_size, len(encoded)))
            width = max(positions[i] for i in chunk)  # the secret is predicted from position pos - 1
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(chunk):
                ids[row, :positions[i]] = torch.tensor(encoded[i][:positions[i]])
                mask[row, :positions[i]] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            last = torch.tensor([positions[i] - 1 for i in chunk], device=device)
            logp = torch.log_softmax(logits[torch.arange(len(chunk), device=device), last], dim=-1)
            target = torch.tensor([secret_ids[i] for i in chunk], device=device)
            losses[start:start + len(chunk)] = (-logp.gather(1, target[:, None])[:, 0]).cpu().numpy()
            advance(len(chunk))
    model.train(was_training)
    return losses


def score_checkpoint(model_dir, manifest: Manifest, *, score: str = "neg-loss", base=None,
                     **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """(scores, members), higher = member: score "neg-loss" is -loss of the secret on the model; "loss-vs-base"
    is its loss on ``base`` (the model before training) minus on the model, which removes how hard each
    canary's prefix makes its secret to begin with. Each tokenizer is checked against the manifest."""
    from dpaudit.models.loading import load_causal_lm

    def losses(where) -> np.ndarray:
        lm, tok = load_causal_lm(where)
        check_tokenizer_matches(tok, manifest, str(where))
        return secret_losses(lm, tok, manifest, **kwargs)

    members = np.array([c.member for c in manifest.canaries])
    if score == "neg-loss":
        return -losses(model_dir), members
    if score == "loss-vs-base":
        return losses(base) - losses(model_dir), members
    raise DPAuditError(f"unknown checkpoint score {score!r}; use neg-loss or loss-vs-base")


def span_losses(model, tokenizer, manifest: Manifest, batch_size: int = 32, show_progress: bool = True,
                description: str = "scoring canaries", contexts: list[str] | None = None) -> np.ndarray:
    """Per-canary cross-entropy of an existing canary's secret span given its prefix (or ``contexts[i]``: the text
    the trainer put before the secret, e.g. a chat template's), summed over the span's tokens (nats): the context
    is context only, so the score is on the secret alone."""
    import torch

    from dpaudit.canaries.generate import split_secret

    rows = []
    for i, c in enumerate(manifest.canaries):
        split = split_secret(tokenizer, c.prefix if contexts is None else contexts[i], c.secret)
        if split is None:
            raise DPAuditError(f"canary {c.index}: this tokenizer does not read its secret as the manifest's span")
        rows.append(split)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    losses = np.empty(len(rows))
    was_training = model.training
    model.eval()
    with torch.no_grad(), progress_bar(len(rows), description, show_progress) as advance:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            width = max(len(h) + len(t) for h, t in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, (h, t) in enumerate(chunk):
                ids[r, :len(h) + len(t)] = torch.tensor(h + t)
                mask[r, :len(h) + len(t)] = 1
            logp = torch.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), -1)
            for r, (h, t) in enumerate(chunk):
                at = torch.arange(len(h) - 1, len(h) + len(t) - 1, device=device)  # position j predicts token j + 1
                losses[start + r] = float(-logp[r, at, torch.tensor(t, device=device)].sum())
            advance(len(chunk))
    model.train(was_training)
    return losses
