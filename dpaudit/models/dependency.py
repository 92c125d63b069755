"""The optional transformers dependency, imported quietly (a module of its own: hf.py and gguf.py both need it,
and importing it from hf.py had made the two import each other)."""

from __future__ import annotations

import warnings

from dpaudit.core.errors import DPAuditError


def require_transformers():
    try:
        import transformers
    except ImportError:  # the base install is accounting-only
        raise DPAuditError("this command needs the training extras: pip install 'dpaudit[train]'") from None

    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # deprecation chatter
    transformers.logging.set_verbosity_error()  # library chatter would bury our one-line messages
    transformers.utils.logging.disable_progress_bar()
    return transformers
