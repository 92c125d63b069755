"""dpaudit: calibrate, account and audit differentially private training."""

from dpaudit.core.errors import DPAuditError

__version__ = "0.1.0"
__all__ = ["CanaryScoreAuditor", "DPAuditError", "SamplerAudit", "WhiteBoxProbe", "PipelineProbe", "Mechanism", "NeighboringRelation", "__version__", "calibrate",
           "delta", "epsilon", "max_steps"]
_API = {"calibrate", "delta", "epsilon", "max_steps", "Mechanism", "NeighboringRelation"}


def __getattr__(name: str):
    # Lazily: `import dpaudit` stays cheap for the CLI.
    if name == "CanaryScoreAuditor":
        from dpaudit.audit.auditor import CanaryScoreAuditor

        return CanaryScoreAuditor
    if name == "SamplerAudit":
        from dpaudit.audit.sampler import SamplerAudit

        return SamplerAudit
    if name == "WhiteBoxProbe":
        from dpaudit.probes.probe import WhiteBoxProbe

        return WhiteBoxProbe
    if name == "PipelineProbe":
        from dpaudit.probes.pipeline_probe import PipelineProbe

        return PipelineProbe
    if name in _API:
        from dpaudit import api

        return getattr(api, name)
    raise AttributeError(f"module 'dpaudit' has no attribute {name!r}")
