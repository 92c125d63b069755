"""Score canaries on a model: the loss of the secret (the new token, or the span of existing tokens) given its
prefix, batched, on the secret only; score = -loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpaudit.canaries.hf import check_tokenizer_matches
from dpaudit.canaries.manifest import Manifest
from dpaudit.core.errors import DPAuditError
from dpaudit.core.progress import progress_bar
from dpaudit.canaries.generate import split_secret
from dpaudit.core import run_record
from dpaudit.models.loading import load_causal_lm


def secret_losses(model, tokenizer, manifest: Manifest, batch_size: int = 32, show_progress: bool = True,
                  description: str = "scoring canaries", contexts: list[str] | None = None) -> np.ndarray:
    """Per-canary cross-entropy of the secret only (nats; summed over an existing canary's span), in manifest
    order. ``contexts[i]``: the text a trainer put before canary i's secret (a chat template's rendering), in place
    of its prefix (existing canaries)."""
    rows = _new_token_rows(tokenizer, manifest) if manifest.kind == "new-token" else \
        _span_rows(tokenizer, manifest, contexts)
    return _loss_of_tails(model, tokenizer, rows, batch_size, show_progress, description)


def _new_token_rows(tokenizer, manifest: Manifest, held_out: bool = False) -> list[tuple[list[int], list[int]]]:
    """(the ids before the secret token, [its id]) per canary; ``held_out``: per held-out record of each canary
    user, canary by canary."""
    rows = []
    for c, sid in zip(manifest.canaries, tokenizer.convert_tokens_to_ids(manifest.secrets)):
        for text in ([p + c.secret for p in c.held_out] if held_out else [c.text]):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            where = [i for i, t in enumerate(ids) if t == sid]
            if not where or where[-1] == 0:
                raise DPAuditError(f"canary {c.index}: its secret is not a separate token after a prefix")
            rows.append((ids[:where[-1]], [sid]))
    return rows


def held_out_losses(model, tokenizer, manifest: Manifest, batch_size: int = 32, show_progress: bool = True) -> np.ndarray:
    """[m, h]: the secret's loss after each of a canary user's h held-out prefixes (records never trained)."""
    h = len(manifest.canaries[0].held_out)
    if manifest.kind != "new-token" or not h:
        raise DPAuditError("the user-inference score needs new-token canary users with held-out records "
                           "(audit run --unit user, or --held-out)")
    rows = _new_token_rows(tokenizer, manifest, held_out=True)
    return _loss_of_tails(model, tokenizer, rows, batch_size, show_progress,
                          "scoring held-out records").reshape(len(manifest.canaries), h)


def _span_rows(tokenizer, manifest: Manifest, contexts) -> list[tuple[list[int], list[int]]]:
    """(the context's ids, the secret span's ids) per existing canary, as the tokenizer reads context + secret."""

    rows = []
    for i, c in enumerate(manifest.canaries):
        split = split_secret(tokenizer, c.prefix if contexts is None else contexts[i], c.secret)
        if split is None:
            raise DPAuditError(f"canary {c.index}: this tokenizer does not read its secret as the manifest's span")
        rows.append(split)
    return rows


def _loss_of_tails(model, tokenizer, rows, batch_size: int, show_progress: bool, description: str) -> np.ndarray:
    """Sum over each row's tail of -log p(token | everything before it), batched and right-padded; the head is
    context only."""
    import torch

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    losses = np.empty(len(rows))
    was_training = model.training
    model.eval()
    with torch.no_grad(), progress_bar(len(rows), description, show_progress) as advance:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            width = max(len(h) + len(t) - 1 for h, t in chunk)  # the last token is predicted, never read
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, (h, t) in enumerate(chunk):
                seen = (h + t)[:-1]
                ids[r, :len(seen)] = torch.tensor(seen)
                mask[r, :len(seen)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            for r, (h, t) in enumerate(chunk):
                at = torch.arange(len(h) - 1, len(h) + len(t) - 1, device=device)  # position j predicts token j + 1
                logp = torch.log_softmax(logits[r, at].float(), dim=-1)
                losses[start + r] = float(-logp[torch.arange(len(t), device=device), torch.tensor(t, device=device)].sum())
            advance(len(chunk))
    model.train(was_training)
    return losses


def score_checkpoint(model_dir, manifest: Manifest, *, score: str = "neg-loss", base=None,
                     **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """(scores, members), higher = member: score "neg-loss" is -loss of the secret on the model; "loss-vs-base"
    is its loss on ``base`` (the model before training) minus on the model, which removes how hard each
    canary's prefix makes its secret to begin with; "user-inference" (canary users) is the mean over each user's
    held-out records, never trained, of that difference: the user-inference statistic of Kandpal et al. (2023),
    the likelihood ratio of a user's other records under the model against a reference (``base``). Each tokenizer
    is checked against the manifest."""

    def losses(where, of=secret_losses) -> np.ndarray:
        lm, tok = load_causal_lm(where)
        check_tokenizer_matches(tok, manifest, str(where))
        return of(lm, tok, manifest, **kwargs)

    members = np.array([c.member for c in manifest.canaries])
    if score == "user-inference":   # Kandpal et al. 2023: a user's unseen records, model against reference
        return (losses(base, held_out_losses) - losses(model_dir, held_out_losses)).mean(axis=1), members
    if score == "neg-loss":
        return -losses(model_dir), members
    if score == "loss-vs-base":
        return losses(base) - losses(model_dir), members
    raise DPAuditError(f"unknown checkpoint score {score!r}; use neg-loss, loss-vs-base or user-inference")


def score_for(trainable: str | None) -> str:
    """The score of a model that trained ``trainable``: new-token rows start equal, so the base loss is each
    prefix's own difficulty, which ``loss-vs-base`` removes and ``neg-loss`` would keep."""
    return "loss-vs-base" if trainable == "new-tokens" else "neg-loss"


def run_score(model_dir) -> tuple[str, object, str | None]:
    """(score, base, why) for ``audit checkpoint`` without --score: the score ``audit run`` gave the model it trained.
    ``score_for`` the run's trainable subset; ``loss-vs-base`` (new-token rows) against the extended model beside
    the run."""

    run = Path(model_dir).parent
    try:
        record = run_record.read(run, required=False) if Path(model_dir).is_dir() else None
    except DPAuditError:  # not a run dpaudit wrote: nothing to follow
        record = None
    base = run.parent / "extended_model"
    if record and score_for(record.settings.trainable) == "loss-vs-base" and (base / "config.json").is_file():
        return "loss-vs-base", base, (f"loss-vs-base against {base}: the run trained only the canaries' new-token "
                                      "rows, and its own report scored them so")
    return "neg-loss", None, None
