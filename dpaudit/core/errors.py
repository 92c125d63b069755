"""The one exception type that the CLI turns into a single line and exit code 2."""


class DPAuditError(ValueError):
    """A user-facing error: bad input, an unusable config, an unreachable target."""


class Interrupted(Exception):
    """Ctrl-C during long work: the CLI prints the message (what was saved, how to go on) and exits 130."""
