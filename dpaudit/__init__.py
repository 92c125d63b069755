"""dpaudit: calibrate, account and audit differentially private training."""

from dpaudit.errors import DPAuditError

__version__ = "0.1.0"
__all__ = ["DPAuditError", "__version__"]
