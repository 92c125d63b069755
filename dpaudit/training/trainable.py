"""Which parameters train: all of them, LoRA adapters (peft), bias terms only (DP-BiTFiT), the token embeddings
only (input and output rows; one matrix on a tied model), or only the rows of the tokens added for canaries.

Where a new-token canary's clipped gradient goes decides what a black-box audit can see of it: full training
spreads it over every weight (5 % of it on the canary's row, measured on the embedded default); the embeddings
give the row about half (the prefix token's row takes the rest); ``new-tokens`` gives it all of it, and with the
body frozen the secret's logit then moves along one fixed direction, so the final model's logit is the sum of
every step's release along it (the black-box audit run's default; the claim is the same whatever trains)."""

from __future__ import annotations

from dpaudit.core.errors import DPAuditError
from dpaudit.training.new_tokens import add_new_token_rows, merge, new_token_parameters

SUBSETS = ("full", "lora", "bias", "embeddings", "new-tokens")


def select_trainable(model, subset: str, lora_rank: int = 8, new_tokens: list[int] = ()):
    """Return the (possibly peft-wrapped) model with requires_grad set for the chosen subset. With LoRA,
    the rows of ``new_tokens`` (canaries) train too (training/new_tokens.py); full and bias training
    reach them anyway (full) or never (bias: DP-BiTFiT's recipe trains biases only); ``new-tokens`` trains those rows
    alone."""
    if subset not in SUBSETS:
        raise DPAuditError(f"unknown trainable subset {subset!r}; use one of {', '.join(SUBSETS)}")
    if subset == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                                 target_modules="all-linear", bias="none"))

        add_new_token_rows(model.get_base_model(), list(new_tokens))  # after peft: no adapters on them
    if subset == "new-tokens":
        if not new_tokens:
            raise DPAuditError("--trainable new-tokens: the tokenizer has no added tokens (canaries) to train")

        add_new_token_rows(model, list(new_tokens))
    rows = set()
    if subset == "embeddings":
        rows = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    elif subset == "new-tokens":
        rows = {id(p) for p in new_token_parameters(model)}
    for name, p in model.named_parameters():
        if subset == "full":
            p.requires_grad_(True)
        elif subset == "bias":
            p.requires_grad_(name.endswith(".bias"))
        elif subset in ("embeddings", "new-tokens"):
            p.requires_grad_(id(p) in rows)
    if not any(p.requires_grad for p in model.parameters()):
        raise DPAuditError(f"the model has no parameters in the {subset!r} subset (no bias terms?)")
    return model


def trainable_parameters(model) -> list:
    """Trainable parameters in a fixed order (shared storage counted once)."""
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def merged(model):
    """The plain model to save: new-token rows and LoRA adapters merged into the base weights."""

    if hasattr(model, "merge_and_unload"):
        merge(model.get_base_model())
        return model.merge_and_unload()
    merge(model)  # --trainable new-tokens; nothing to do otherwise
    return model
