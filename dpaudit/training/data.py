"""Tokenised training examples and the per-example loss both trainers use.

Examples are stored right-padded whatever the tokenizer's own ``padding_side``: ``batch`` keeps the first
columns, so a left-padded store would hand the trainer padding only and mask every target (issue 36: Gemma 3
and the SentencePiece Llama family pad on the left in transformers 5). ``tokenize`` asks for right padding
and checks that it got it, and refuses data with no target token at all (nothing would train)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TokenizedDataset:
    input_ids: torch.Tensor       # [N, L], right-padded
    attention_mask: torch.Tensor  # [N, L]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, indices) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        mask = self.attention_mask[idx]
        width = max(1, int(mask.sum(1).max())) if len(idx) else 1
        return {"input_ids": self.input_ids[idx, :width], "attention_mask": mask[:, :width]}


    def target_tokens(self, indices=None) -> int:
        """Next-token targets (real tokens after the first) of the examples at ``indices`` (default: all)."""
        mask = self.attention_mask if indices is None else self.attention_mask[torch.as_tensor(indices, dtype=torch.long)]
        return int((mask.sum(1) - 1).clamp(min=0).sum())


def tokenize(tokenizer, texts: list[str], max_length: int = 64) -> TokenizedDataset:
    """``texts`` tokenised, truncated and right-padded to ``max_length`` (the tokenizer's own padding and
    truncation sides are set for the call and restored)."""
    from dpaudit.core.errors import DPAuditError

    sides = getattr(tokenizer, "padding_side", None), getattr(tokenizer, "truncation_side", None)
    try:
        tokenizer.padding_side, tokenizer.truncation_side = "right", "right"
        enc = tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=max_length,
                        add_special_tokens=False)
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = sides
    data = TokenizedDataset(enc["input_ids"], enc["attention_mask"])
    mask = data.attention_mask
    if (mask[:, 1:] > mask[:, :-1]).any():  # a real token after padding: not right-padded
        raise DPAuditError("the tokenizer padded on the left although right padding was asked for; dpaudit would "
                           "train on padding: use a tokenizer that honours padding_side='right'")
    if len(data) and data.target_tokens() == 0:
        raise DPAuditError(f"none of the {len(data)} training examples has a token to predict (each is at most one "
                           "token long after tokenisation): nothing would train")
    return data


def split(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """The batch in consecutive chunks of at most ``size`` examples (0: one chunk)."""
    n = batch["input_ids"].shape[0]
    size = size or max(1, n)
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, n, size)] or [batch]


def padded_chunks(batch: dict[str, torch.Tensor], size: int, passes: int) -> list[tuple[dict, bool]]:
    """(chunk, real) pairs: the batch's chunks of at most ``size`` examples, then placeholder chunks (one
    example, no target token, its result ignored) up to ``passes`` in all. Ranks of a sharded model
    gather weights in every pass, so each runs the same number of passes whatever its share."""
    n, width = batch["input_ids"].shape
    chunks = [(chunk, True) for chunk in split(batch, size)] if n else []
    if len(chunks) > passes:
        raise ValueError(f"{len(chunks)} chunks exceed the {passes} passes every rank runs")
    ids = torch.zeros((1, width), dtype=batch["input_ids"].dtype, device=batch["input_ids"].device)
    mask = torch.zeros_like(ids)
    mask[:, 0] = 1
    placeholder = {"input_ids": ids, "attention_mask": mask}
    return chunks + [(placeholder, False)] * (passes - len(chunks))


def per_example_loss(model, batch: dict[str, torch.Tensor], micro_batch: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy of each example (padding ignored), in float32; ``micro_batch``:
    at most that many examples per forward pass."""
    if micro_batch and batch["input_ids"].shape[0] > micro_batch:
        return torch.cat([per_example_loss(model, chunk) for chunk in split(batch, micro_batch)])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    tok = tok.view(target.shape)
    return tok.sum(1) / (target != -100).sum(1).clamp(min=1)
