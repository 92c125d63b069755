"""Privacy accounting core: mechanisms, accountants and calibration. No torch in here."""

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.registry import ACCOUNTANTS, default_accountant, epsilon, get_accountant
from dpaudit.accounting.calibrate import calibrate_sigma, max_steps

__all__ = [
    "ACCOUNTANTS",
    "Mechanism",
    "calibrate_sigma",
    "default_accountant",
    "epsilon",
    "get_accountant",
    "max_steps",
]
