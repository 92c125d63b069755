"""The Hugging Face callback's pre-flight (hf.py, ``on_train_begin``): on the live model, the Trainer's own dataset
and its collator (never by drawing from its data loader, which would move the user's random state), why the
canaries would not train, each in one line naming the cause and the fix. The dataset is read once, row by row,
each secret span indexed by its first token (O(tokens)); only rows holding a member are collated."""

from __future__ import annotations

from dpaudit.integrations.hf_rows import contexts
from dpaudit.canaries.generate import split_secret
from dpaudit.training.new_tokens import NewTokenEmbedding, NewTokenHead


def preflight_problems(model, tokenizer, manifest, settings, train_dataloader) -> list[str]:
    """Why the canaries would not train, each in one line with its fix (empty: they will)."""
    problems = []
    if manifest.kind == "new-token":
        ids = tokenizer.convert_tokens_to_ids(manifest.secrets)
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            problems.append("the new-token canaries are not in the tokenizer: extend the model first "
                            "(audit.extend(model), or dpaudit canaries extend), or use kind='existing'")
        elif not rows_train(model, ids):
            problems.append("the new-token canaries' embedding and output rows are frozen (a standard LoRA config "
                            "freezes them), so the canaries never train and the audit would read 'consistent' with "
                            "nothing behind it: call audit.extend(model) after get_peft_model (it makes their rows "
                            "train), add trainable_token_indices (or modules_to_save=['embed_tokens', 'lm_head']) to "
                            "the LoRA config, or use kind='existing'")
    dataset = getattr(train_dataloader, "dataset", None)
    collate = getattr(train_dataloader, "collate_fn", None)
    if dataset is None or collate is None:
        return problems + ["the Trainer's data loader has no dataset and collator to check: the canaries' labels, "
                           "truncation and presence were not checked"]
    problems += _check_rows(dataset, collate, tokenizer, manifest, settings, _batch_size(train_dataloader))
    return problems


def _batch_size(loader) -> int:
    """The batch the Trainer's loader forms (per device), read from it, never by drawing from it."""
    for source in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(source, "batch_size", None)
        if isinstance(size, int) and size >= 1:
            return size
    return 8


def rows_train(model, ids) -> bool:
    """Whether a trainable parameter holds the rows of token ``ids`` (input or output side): a whole trainable
    embedding or output matrix (also PEFT's modules_to_save copy), PEFT trainable tokens covering them, or rows of
    their own (training/new_tokens.py, as ``DPAuditCallback.extend`` makes them on a LoRA)."""
    vocab = max(ids) + 1
    for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
        if layer is None:
            continue
        if isinstance(layer, (NewTokenEmbedding, NewTokenHead)) and layer.rows.weight.requires_grad and \
                set(ids) <= set(layer.ids.tolist()):
            return True
        if any(p.requires_grad and p.dim() == 2 and p.shape[0] >= vocab for p in layer.parameters()):
            return True
        indices = getattr(getattr(layer, "token_adapter", None), "token_indices", None) or {}
        if any(set(ids) <= set(v) for v in indices.values()):
            return True
    return False


MAX_SCAN_ROWS = 200_000
BATCH_SAMPLE = 32   # members collated inside a full batch (with the longest other rows): a bounded sample


def _check_rows(dataset, collate, tokenizer, manifest, settings, batch_size: int = 8) -> list[str]:
    """Find the member canaries in the dataset the Trainer iterates, count their copies against what prepare()
    inserted, collate their rows with its own collator, alone and inside a batch as the Trainer forms them, and
    check that each secret span survives (not cut) with its labels on."""

    spans, heads = {}, {}
    for c, context in zip(manifest.canaries, contexts(tokenizer, manifest, settings)):
        split = split_secret(tokenizer, context, c.secret) if c.member else None
        if split is not None:
            heads[c.index], spans[c.index] = split
    if len(dataset) > MAX_SCAN_ROWS:
        return [f"the dataset has {len(dataset)} rows, more than the {MAX_SCAN_ROWS} the pre-flight scans: not checked"]
    found, cut, lengths = _scan(dataset, tokenizer, manifest, spans, heads)
    if cut:
        return [f"{cut} member canaries are cut by truncation or packing (their secret span is split): raise "
                "max_length, or pack with a strategy that keeps examples whole"]
    if not found:
        return ["none of the inserted member canaries is in the dataset the Trainer iterates: give the Trainer the "
                "dataset prepare() returned (after any map or filter, the canary rows must remain)"]
    missing = len(spans) - len(found)
    problems = [] if not missing else [f"{missing} of {len(spans)} member canaries are not in the Trainer's dataset "
                                       "(filtered out?): the audit would count them as members that never trained"]
    problems += _check_copies(found, settings.repeats)
    holding = {i for rows in found.values() for i in rows}
    companions = sorted((i for i in range(len(dataset)) if i not in holding), key=lambda i: -lengths[i])
    alone = _check_labels(dataset, collate, found, spans)
    batched = [] if alone or batch_size < 2 else _check_labels(
        dataset, collate, dict(list(found.items())[:BATCH_SAMPLE]), spans, companions[:batch_size - 1])
    return alone + batched + problems


def _check_copies(found: dict, repeats: list[int]) -> list[str]:
    """Each member's copies in the dataset the Trainer iterates against what prepare() inserted (canary i: repeats[i
    mod tiers]). More copies (the dataset concatenated after prepare) hold a tier to a group smaller than its
    exposure, a false alarm in waiting; fewer (duplicate rows dropped) collapse the tiers."""
    want = {i: repeats[i % len(repeats)] for i in found}
    more = [i for i, rows in found.items() if len(rows) > want[i]]
    fewer = [i for i, rows in found.items() if len(rows) < want[i]]
    problems = []
    if more:
        i = max(more, key=lambda i: len(found[i]))
        problems.append(f"{len(more)} member canaries are in the Trainer's dataset more often than prepare() put them "
                        f"(e.g. {len(found[i])} copies of a {want[i]}x canary: the dataset was concatenated or "
                        "repeated after prepare()): each tier would be held to a group smaller than its exposure; "
                        "repeat the data before prepare(), or use num_train_epochs")
    if fewer:
        i = min(fewer, key=lambda i: len(found[i]))
        problems.append(f"{len(fewer)} member canaries are in the Trainer's dataset fewer times than prepare() put "
                        f"them (e.g. {len(found[i])} of {want[i]} copies: duplicate rows dropped after prepare()?): the "
                        "exposure tiers collapse; de-duplicate before prepare(), or prepare with repeats=1")
    return problems


def _scan(dataset, tokenizer, manifest, spans, heads) -> tuple[dict, int, list[int]]:
    """({canary index: the rows holding its secret span, a row once for each copy}, how many rows end cut inside a
    member's secret, each row's length in tokens or characters)."""
    found, cut, lengths = {}, 0, []
    starts = {}  # a span's first token -> the spans starting with it: each row is read once, O(its tokens)
    for index, span in spans.items():
        starts.setdefault(span[0], []).append(index)
    ends = {tuple(heads[index][-4:]): index for index in spans}  # the prefix's last tokens: where a cut starts
    longest = max(map(len, spans.values()), default=0)
    for i in range(len(dataset)):
        row = dataset[i]
        ids = _ids_of(row, tokenizer)
        if ids is None:  # raw rows, tokenised by the collator: find the secret's text
            strings = [v for v in _strings(row) if isinstance(v, str)]
            lengths.append(sum(map(len, strings)))
            for index in spans:
                if any(manifest.canaries[index].secret in v for v in strings):
                    found.setdefault(index, []).append(i)
            continue
        lengths.append(len(ids))
        for j, token in enumerate(ids):
            for index in starts.get(token, ()):
                if ids[j:j + len(spans[index])] == spans[index]:
                    found.setdefault(index, []).append(i)
        for k in range(4, min(len(ids), 4 + longest) + 1):
            index = ends.get(tuple(ids[len(ids) - k:len(ids) - k + 4]))
            if index is not None and _cut_at_end(ids, heads[index], spans[index]) and i not in found.get(index, ()):
                cut += 1
    return found, cut, lengths


def _check_labels(dataset, collate, found, spans, companions=None) -> list[str]:
    """Each found member's row through the Trainer's collator: its secret span still whole, its labels on. With
    ``companions`` (the longest other rows), each is collated first in a batch of the Trainer's size with them: a
    collator that caps a batch's tokens, or pads and cuts by the batch, shows only there."""
    cut = masked = 0
    where = "in collation" if companions is None else f"when collated in a batch of {1 + len(companions)}"
    for index, rows in found.items():
        batch = collate([dataset[rows[0]]] + [dataset[c] for c in companions or ()])
        labels, ids = batch.get("labels"), batch.get("input_ids")
        if labels is None or ids is None:
            return ["the collator gives no labels to check: the canaries' loss masking was not checked"]
        ids, labels = ids[0].tolist(), labels[0].tolist()
        at = _find(ids, spans[index])
        if at is None:
            cut += 1
        elif any(label == -100 for label in labels[at:at + len(spans[index])]):
            masked += 1
    problems = []
    if cut:
        problems.append(f"{cut} member canaries lose their secret span {where} (truncation, max_length or a cap on "
                        "the batch's tokens): raise the limit")
    if masked:
        problems.append(f"{masked} of {len(found)} member canaries have their secret's labels masked (-100) {where} "
                        "(completion-only loss or a chat template masks that part): the secret must be in "
                        "the trained part of the row (the completion, the assistant's reply)")
    return problems


def _strings(row):
    """Every string in a row, chat messages included."""
    values = list(row.values()) if isinstance(row, dict) else [row]
    while values:
        v = values.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            values.extend(v.values())
        elif isinstance(v, (list, tuple)):
            values.extend(v)


def _cut_at_end(ids, head, span) -> bool:
    """The row ends with the canary's context and the first tokens of its secret, or none of them (its last
    tokens): truncation or packing cut the secret off."""
    tail = head[-4:]  # the prefix's last tokens: random, so an ordinary row never ends with them
    return any(ids[len(ids) - len(tail) - k:] == tail + span[:k] for k in range(0, len(span))
               if len(ids) >= len(tail) + k)


def _ids_of(row, tokenizer):
    if isinstance(row, dict) and "input_ids" in row:
        ids = row["input_ids"]
        return ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return None


def _find(haystack, needle):
    k = len(needle)
    if not k:
        return None
    first = needle[0]
    for j in range(len(haystack) - k + 1):
        if haystack[j] == first and haystack[j:j + k] == needle:
            return j
    return None
