"""Layer 0, core: what every layer uses and nothing of dpaudit's own beneath it: errors, atomic writes, folder
locks, safe JSON, the run-folder layout (run_folder), time and memory limits (limits), progress, plots, thread
settings and reading datasets of texts (texts). May import: nothing of dpaudit outside core.

The layers (tests/test_layers.py checks them from the source, no import executed), lowest first; a module
imports its own layer or lower ones only:
    core -> accounting -> audit (statistics) -> models, canaries -> training -> workflows -> integrations -> api, cli
"""
