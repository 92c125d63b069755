"""Tokenised training examples and the per-example loss both trainers use.

Examples are stored right-padded whatever the tokenizer's own ``padding_side``: ``batch`` keeps the first
columns, so a left-padded store would hand the trainer padding only and mask every target (Gemma 3
and the SentencePiece Llama family pad on the left in transformers 5). ``tokenize`` pads by itself, on the right,
so neither the tokenizer's padding side nor its pad token matters (many causal LMs have none: GPT-2, Llama, and
SmolLM2 as transformers 5.17 reads its GGUF); the attention mask marks the padding, which is never attended or
trained. It refuses data with no target token at all (nothing would train)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpaudit.core.errors import DPAuditError


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
    """``texts`` tokenised, truncated on the right to ``max_length`` and right-padded to it (the tokenizer's
    truncation side is set for the call and restored). The padding id is the tokenizer's pad token, else its
    end of sequence, else 0: any id does, since the mask hides it."""

    side = getattr(tokenizer, "truncation_side", None)
    try:
        tokenizer.truncation_side = "right"
        rows = tokenizer(texts, truncation=True, max_length=max_length, add_special_tokens=False)["input_ids"]
    finally:
        tokenizer.truncation_side = side
    pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if isinstance(i, int)), 0)
    ids = torch.full((len(rows), max_length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), max_length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    data = TokenizedDataset(ids, mask)
    if len(data) and data.target_tokens() == 0:
        raise DPAuditError(f"none of the {len(data)} training examples has a token to predict (each is at most one "
                           "token long after tokenisation): nothing would train")
    return data


def split(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """The batch in consecutive chunks of at most ``size`` examples (0: one chunk)."""
    n = batch["input_ids"].shape[0]
    size = size or max(1, n)
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, n, size)] or [batch]


def split_users(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """The batch in consecutive chunks of whole users (``batch["user"]``, each user's rows adjacent), at most
    ``size`` rows a chunk unless one user alone holds more (0: one chunk): a user clipped as one must have all its
    rows in one chunk, or each part would be clipped on its own."""
    n = batch["input_ids"].shape[0]
    if not size or n <= size:
        return [batch]
    users = batch["user"].tolist()
    ends = [i for i in range(1, n) if users[i] != users[i - 1]] + [n]   # where each user's rows end
    cuts = [0]
    for before, end in zip([0] + ends, ends):   # a user's rows: before..end
        if end - cuts[-1] > size and before > cuts[-1]:
            cuts.append(before)                  # the chunk so far is full: this user starts the next
    cuts.append(n)
    return [{k: v[a:b] for k, v in batch.items()} for a, b in zip(cuts, cuts[1:])]


def user_sums(values: torch.Tensor, inverse: torch.Tensor, count: int) -> torch.Tensor:
    """[count, ...]: the rows of ``values`` [n, ...] summed over each user (``inverse`` [n]: each row's user index)."""
    return values.new_zeros((count, *values.shape[1:])).index_add_(0, inverse.to(values.device), values)


def user_means(values: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` [n, ...] over each user's rows (``users`` [n]), one row a user present, in the order
    of ``torch.unique``."""
    _, inverse = torch.unique(users, return_inverse=True)
    count = int(inverse.max()) + 1 if inverse.numel() else 0
    rows = torch.bincount(inverse, minlength=count).to(values.device, values.dtype)
    return user_sums(values, inverse, count) / rows.view(-1, *([1] * (values.dim() - 1)))


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


def token_losses(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy at each position from ``logits`` [N, L-1, V] (float32), and the targets
    [N, L-1] (-100 where there is none: padding)."""
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    return tok.view(target.shape), target


def per_example_loss(model, batch: dict[str, torch.Tensor], micro_batch: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy of each example (padding ignored), in float32; ``micro_batch``:
    at most that many examples per forward pass."""
    if micro_batch and batch["input_ids"].shape[0] > micro_batch:
        return torch.cat([per_example_loss(model, chunk) for chunk in split(batch, micro_batch)])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    tok, target = token_losses(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), ids, mask)
    return tok.sum(1) / (target != -100).sum(1).clamp(min=1)
