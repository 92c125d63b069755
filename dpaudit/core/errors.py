"""The one exception type that the CLI turns into a single line and exit code 2."""


class DPAuditError(ValueError):
    """A user-facing error: bad input, an unusable config, an unreachable target."""


class PrivacyViolation(RuntimeError):
    """A watched probe's look read VIOLATION and was told to raise (``on_violation="raise"``): ``result`` is the
    AuditResult of that look, whose report is written."""

    def __init__(self, message: str, result=None) -> None:
        super().__init__(message)
        self.result = result


class Interrupted(Exception):
    """Ctrl-C during long work: the CLI prints the message (what was saved, how to go on) and exits 130."""
