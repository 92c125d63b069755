"""The rows of a user's dataset for the Hugging Face callback (hf.py): read a ``datasets.Dataset`` or a list of
dicts, find where a canary goes (plain text, chat messages, prompt and completion), write canary rows in that
format, and say what text the trainer puts before each secret (the scoring context)."""

from __future__ import annotations

from dpaudit.core.errors import DPAuditError


def rows_of(dataset):
    """(rows as a list of dicts, column names, a function making rows back into the dataset's own kind)."""
    if isinstance(dataset, list):
        if not dataset or not all(isinstance(r, dict) for r in dataset):
            raise DPAuditError("the dataset must be a non-empty list of dicts (rows) or a datasets.Dataset")
        return [dict(r) for r in dataset], list(dataset[0]), lambda rows: rows
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):
        rows = dataset.to_list()
        if not rows:
            raise DPAuditError("the dataset is empty")
        kind = type(dataset)
        return rows, list(dataset.column_names), lambda new: kind.from_list(new)
    raise DPAuditError(f"cannot read rows of a {type(dataset).__name__}: give a datasets.Dataset or a list of dicts")


def row_format(rows, columns, text_field):
    if text_field is not None:
        if text_field not in columns:
            raise DPAuditError(f"the dataset has no column {text_field!r}; its columns: {', '.join(map(str, columns))}")
        return "text", text_field
    if "messages" in columns:
        return "messages", None
    if "prompt" in columns and "completion" in columns:
        return "prompt-completion", None
    if "text" in columns:
        return "text", "text"
    if "input_ids" in columns:
        raise DPAuditError("the dataset is already tokenised (input_ids): give prepare() the rows before tokenising "
                           "(text, messages, or prompt and completion)")
    raise DPAuditError(f"no column to put canaries in: expected text, messages, or prompt and completion; found "
                       f"{', '.join(map(str, columns)) or 'none'} (name the text column with text_field=)")


def canary_row(canary, row_format, text_field, columns, rows) -> dict:
    row = {c: None for c in columns}
    if row_format == "text":
        row[text_field] = canary.prefix + canary.secret
    elif row_format == "prompt-completion":
        conversational = isinstance(rows[0].get("prompt"), list)
        row["prompt"] = [{"role": "user", "content": canary.prefix}] if conversational else canary.prefix
        row["completion"] = [{"role": "assistant", "content": canary.secret}] if conversational else canary.secret
    else:
        row["messages"] = [{"role": "user", "content": canary.prefix}, {"role": "assistant", "content": canary.secret}]
    return row


def contexts(tokenizer, manifest, settings) -> list[str]:
    """The text the trainer puts before each canary's secret: the prefix, or the rendered chat up to the reply
    (prompt-completion rows, conversational or not, are scored on their plain prefix: TRL joins them alike)."""
    if settings.row_format != "messages":
        return [c.prefix for c in manifest.canaries]
    out = []
    for c in manifest.canaries:
        chat = [{"role": "user", "content": c.prefix}, {"role": "assistant", "content": c.secret}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        at = text.rfind(c.secret)
        if at < 0:
            raise DPAuditError("the chat template does not render the assistant's reply as written")
        out.append(text[:at])
    return out
