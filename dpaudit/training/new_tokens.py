"""New-token rows as their own trainable parameter, for LoRA runs (``--trainable lora``) and for runs that train
those rows alone (``--trainable new-tokens``).

Canaries are new tokens: their rows of the (usually tied) input and output embedding are what a model
memorises them in. LoRA on the linear layers leaves both embeddings frozen, so those rows would stay
at zero and the audit would measure nothing. peft's ``trainable_token_indices`` keeps the delta in a
layer Opacus cannot hook (its parameter is never called as a module, so no per-example norm), so the
rows live here in plain ``nn.Embedding`` / ``nn.Linear`` modules instead, which both DP-SGD routes
(ghost norms, tied pairs included; materialised per-example gradients) and DP-ZO handle:

- input:  e(x) = E(x) + R[slot(x)], slot(x) = 1 + (index of x among the new ids), 0 otherwise; row 0
  of R is the padding row (always zero, no gradient);
- output: logits = H(h), plus h R[1:]^T added into the new ids' columns. With tied embeddings the
  output uses the same R (one parameter, two uses); untied models get their own output rows.

R starts at zero, so the model is unchanged until trained; at export ``merge`` adds R into the base
rows and puts the original modules back.
"""

from __future__ import annotations

import torch
from torch import nn


def new_token_ids(tokenizer) -> list[int]:
    """Tokens added on top of the base vocabulary (canaries), special tokens excepted."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(tokenizer.vocab_size, len(tokenizer)) if i not in special]


class NewTokenEmbedding(nn.Module):
    def __init__(self, base: nn.Embedding, ids: list[int]):
        super().__init__()
        self.base = base
        self.rows = nn.Embedding(len(ids) + 1, base.embedding_dim, padding_idx=0,
                                 device=base.weight.device, dtype=base.weight.dtype)
        nn.init.zeros_(self.rows.weight)
        slot = torch.zeros(base.num_embeddings, dtype=torch.long, device=base.weight.device)
        slot[torch.as_tensor(ids, device=slot.device)] = torch.arange(1, len(ids) + 1, device=slot.device)
        self.register_buffer("slot", slot, persistent=False)
        self.register_buffer("ids", torch.as_tensor(ids, dtype=torch.long, device=slot.device), persistent=False)

    def forward(self, input_ids):
        slot = self.slot[input_ids]
        # Row 0 (every old token's slot) adds nothing, whatever it holds. padding_idx keeps its gradient at zero,
        # but DP-ZO perturbs and updates whole parameters: a moving row 0 shifted every token's input alike, a loss
        # change common to every example (it drowned the DP-ZO black box's signal), which ``merge``
        # then dropped from the exported model.
        return self.base(input_ids) + self.rows(slot) * (slot != 0).unsqueeze(-1).to(self.rows.weight.dtype)


class NewTokenHead(nn.Module):
    def __init__(self, base: nn.Linear, ids: list[int], tied_rows: nn.Parameter | None):
        super().__init__()
        self.base = base
        self.rows = nn.Linear(base.in_features, len(ids) + 1, bias=False,
                              device=base.weight.device, dtype=base.weight.dtype)
        nn.init.zeros_(self.rows.weight)
        if tied_rows is not None:
            self.rows.weight = tied_rows
        self.register_buffer("ids", torch.as_tensor(ids, dtype=torch.long, device=base.weight.device),
                             persistent=False)

    def forward(self, hidden):
        return self.base(hidden).index_add(-1, self.ids, self.rows(hidden)[..., 1:])


def add_new_token_rows(model, ids: list[int]) -> None:
    """Wrap ``model``'s input and output embeddings (in place) so that the rows of ``ids`` train."""
    if not ids:
        return
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    wrapped = NewTokenEmbedding(emb, ids)
    model.set_input_embeddings(wrapped)
    if isinstance(head, nn.Linear):
        model.set_output_embeddings(NewTokenHead(head, ids, wrapped.rows.weight if tied else None))


def new_token_parameters(model) -> list[nn.Parameter]:
    """The rows ``add_new_token_rows`` made (one parameter on a tied model, two on an untied one)."""
    out = []
    for m in (model.get_input_embeddings(), model.get_output_embeddings()):
        if isinstance(m, (NewTokenEmbedding, NewTokenHead)) and all(m.rows.weight is not p for p in out):
            out.append(m.rows.weight)
    return out


@torch.no_grad()
def merge(model) -> None:
    """Add the trained rows into the base embeddings and restore the original modules."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(head, NewTokenHead):
        shared = isinstance(emb, NewTokenEmbedding) and head.base.weight is emb.base.weight
        if not shared:  # a tied base weight gets its (tied) rows once, below
            head.base.weight[head.ids] += head.rows.weight[1:].to(head.base.weight.dtype)
        model.set_output_embeddings(head.base)
    if isinstance(emb, NewTokenEmbedding):
        emb.base.weight[emb.ids] += emb.rows.weight[1:].to(emb.base.weight.dtype)
        model.set_input_embeddings(emb.base)
