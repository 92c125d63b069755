"""The embedded default model: a small Llama-architecture causal LM and a byte-level BPE tokenizer,
both built offline from a config and the synthetic corpus, then briefly pre-trained so it is a
language model before anyone fine-tunes it. Deterministic for a given seed."""

from __future__ import annotations

from pathlib import Path
import json

from dpaudit.core.atomic import save_model_folder
from dpaudit.models.hf import require_transformers
from dpaudit.models.corpus import sentences

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
MARKER = "dpaudit_model.json"  # written beside the weights of every embedded-default folder


def is_embedded(folder) -> bool:
    """Whether ``folder`` holds a model dpaudit built (the embedded default), not a pretrained one."""
    return Path(folder).is_dir() and (Path(folder) / MARKER).is_file()


def embedded_marker(folder) -> dict:
    """The marker to carry into a folder derived from ``folder`` (``canaries extend``): an extended embedded
    default is still the embedded default (its learning rates, not a pretrained model's), so it keeps the marker,
    noting the derivation; any other model gets none."""

    if not is_embedded(folder):
        return {}
    try:
        marker = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {MARKER: {**marker, "extended_with_canary_tokens": True}} if isinstance(marker, dict) else {}


DEFAULT_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 4}


def build_tokenizer(corpus: list[str], vocab_size: int = 512):
    require_transformers()  # quiets the library
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS, UNK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def build_model(tokenizer, seed: int = 0, **sizes):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Biases for DP-BiTFiT; sizes may override anything (a larger vocabulary for benchmarks, no biases
    # for a Llama-like test model).
    cfg = LlamaConfig(**{"vocab_size": len(tokenizer), "attention_bias": True, "mlp_bias": True, **DEFAULT_SIZES,
                         **sizes}, max_position_embeddings=128, tie_word_embeddings=True,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def pretrain(model, tokenizer, corpus: list[str], steps: int = 150, batch_size: int = 32, lr: float = 3e-3,
             seed: int = 0) -> float:
    """A short non-private pre-training on public synthetic text; returns the last loss."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = float("nan")
    for _ in range(steps):
        idx = torch.randint(len(corpus), (batch_size,), generator=gen).tolist()
        batch = tokenizer([corpus[i] for i in idx], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        out = model(**batch, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        loss = float(out.loss.detach())
    model.eval()
    return loss


def build_embedded_default(out_dir: Path, seed: int = 0, pretrain_steps: int = 150) -> Path:
    """Write a loadable Hugging Face checkpoint directory (safetensors) for the embedded default."""
    out_dir = Path(out_dir)
    corpus = sentences(4000, seed=1000 + seed)
    tokenizer = build_tokenizer(corpus)
    model = build_model(tokenizer, seed)
    loss = pretrain(model, tokenizer, corpus, steps=pretrain_steps, seed=seed) if pretrain_steps else None
    return save_model_folder(out_dir, model, tokenizer, {MARKER: {
        "kind": "embedded-default", "seed": seed, "pretrain_steps": pretrain_steps, "pretrain_loss": loss,
        "corpus": "dpaudit.models.corpus.sentences(4000, seed=1000+seed)"}})
