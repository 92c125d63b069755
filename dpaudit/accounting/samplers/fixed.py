"""Fixed-size batches: B examples drawn without replacement each step, independently across steps.

N is public, so neighbours replace one example (replace-one). Accounted as a PLD of the symmetrised dominating
pair of sampling without replacement (accounting/wor.py, where it is proved; the same bound holds under
add/remove), with dp-accounting's
``SampledWithoutReplacementDpEvent`` (Renyi DP, Wang, Balle & Kasiviswanathan 2019) as the fallback and
cross-check. Under replace-one a clipped
sum moves by up to 2C, not C (``sensitivity`` 2).
"""

from dpaudit.accounting.result import REPLACE_ONE_WORDS, NeighboringRelation
from dpaudit.accounting.samplers import Scheme


def _rdp_event(mech, step):
    import dp_accounting

    return dp_accounting.SampledWithoutReplacementDpEvent(mech.dataset_size, mech.batch_size, step)


SCHEME = Scheme("fixed", NeighboringRelation.REPLACE_ONE, True,
                "fixed-size batches: B = {B} of N = {N} drawn without replacement each step (p = {p:.4g}), T = {T} steps",
                REPLACE_ONE_WORDS, accountants=("wor-pld", "rdp", "pure"), independent_steps=True, sensitivity=2.0,
                rdp_event=_rdp_event,
                rdp_note="fixed-size batches: dp-accounting's sampled-without-replacement event, replace-one, "
                         "sensitivity 2C", looks_like=("fixed-size batches drawn without replacement",), rank=1)
