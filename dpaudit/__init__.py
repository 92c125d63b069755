"""dpaudit: calibrate, account and audit differentially private training."""

from dpaudit.errors import DPAuditError

__version__ = "0.1.0"
__all__ = ["CanaryScoreAuditor", "DPAuditError", "__version__"]


def __getattr__(name: str):
    if name == "CanaryScoreAuditor":  # lazily: `import dpaudit` stays cheap for the CLI
        from dpaudit.audit.auditor import CanaryScoreAuditor

        return CanaryScoreAuditor
    raise AttributeError(f"module 'dpaudit' has no attribute {name!r}")
