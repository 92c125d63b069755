"""Layer 1, the privacy accounting core: mechanisms, accountants and calibration. No torch in here. May import:
core.

The names below are loaded on first use (PEP 562), so importing one accounting module does not import them all
(the package's eager imports had made every submodule import pass through registry and calibrate)."""

import importlib

__all__ = [
    "ACCOUNTANTS",
    "Mechanism",
    "calibrate_sigma",
    "default_accountant",
    "epsilon",
    "get_accountant",
    "max_steps",
]
_WHERE = {"Mechanism": "mechanism", "ACCOUNTANTS": "registry", "default_accountant": "registry", "epsilon": "registry",
          "get_accountant": "registry", "calibrate_sigma": "calibrate", "max_steps": "calibrate"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"dpaudit.accounting.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dpaudit.accounting' has no attribute {name!r}")
