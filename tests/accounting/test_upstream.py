"""What dpaudit reads of dp-accounting beyond its documented API (pyproject pins the tested range): each field,
private function and constructor parameter the accountants use, checked by name, so an upstream release that
moves one fails here, naming it, before any bound is computed with it."""

import inspect

import pytest

pld_pmf = pytest.importorskip("dp_accounting.pld.pld_pmf")
from dp_accounting.pld import common, privacy_loss_distribution, privacy_loss_mechanism  # noqa: E402

# (module, name): used by accounting/pld/kernel.py, wor.py, allocation.py, shuffle.py, noises/
MODULE_NAMES = [
    (privacy_loss_distribution, "_create_pld_pmf_from_monotone_privacy_loss"),   # wor.py
    (privacy_loss_distribution, "_pld_for_subsampled_mechanism"),                # pld.py
    (common, "compute_self_convolve_bounds"),                                     # pld.py
    (common, "log_a_times_exp_b_plus_c"),                                         # noises/
    (privacy_loss_mechanism, "MonotonePrivacyLoss"),                              # wor.py
    (privacy_loss_mechanism, "ConnectDotsBounds"),
    (privacy_loss_mechanism, "TailPrivacyLossDistribution"),
    (privacy_loss_mechanism, "AdjacencyType"),
    (pld_pmf, "DensePLDPmf"),
    (pld_pmf, "SparsePLDPmf"),
]
# private fields of a dense PMF that pld.py and allocation.py read or pass to the constructor
DENSE_FIELDS = ["_discretization", "_lower_loss", "_probs", "_infinity_mass", "_pessimistic_estimate"]
DENSE_PARAMETERS = ["discretization", "lower_loss", "probs", "infinity_mass", "pessimistic_estimate"]
MONOTONE_ABSTRACT = {"mu_upper_cdf", "mu_lower_log_cdf", "get_delta_for_epsilon", "privacy_loss_tail",
                     "connect_dots_bounds", "privacy_loss", "inverse_privacy_loss"}


@pytest.mark.parametrize("module, name", MODULE_NAMES, ids=[f"{m.__name__}.{n}" for m, n in MODULE_NAMES])
def test_upstream_name_exists(module, name):
    assert hasattr(module, name), f"dp-accounting no longer has {module.__name__}.{name}, which dpaudit reads"


def test_dense_pmf_constructor_and_fields():
    params = list(inspect.signature(pld_pmf.DensePLDPmf.__init__).parameters)[1:]
    assert params[:5] == DENSE_PARAMETERS, f"DensePLDPmf(...) now takes {params}, dpaudit passes {DENSE_PARAMETERS}"
    pmf = pld_pmf.DensePLDPmf(0.1, -2, [0.25, 0.5, 0.25], 0.0, True)
    for field in DENSE_FIELDS:
        assert hasattr(pmf, field), f"DensePLDPmf has no {field}, which dpaudit reads"
    assert pmf._lower_loss == -2 and list(pmf._probs) == [0.25, 0.5, 0.25]  # noqa: SLF001


def test_monotone_privacy_loss_contract():
    abstract = set(getattr(privacy_loss_mechanism.MonotonePrivacyLoss, "__abstractmethods__", ()))
    assert abstract == MONOTONE_ABSTRACT, (f"MonotonePrivacyLoss now asks for {sorted(abstract)}; "
                                           f"accounting/wor.py implements {sorted(MONOTONE_ABSTRACT)}")
    params = inspect.signature(privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss).parameters
    for name in ("monotone_privacy_loss", "pessimistic_estimate", "value_discretization_interval",
                 "use_connect_dots"):
        assert name in params, f"_create_pld_pmf_from_monotone_privacy_loss lost its {name} parameter"


# a PrivacyLossDistribution's private fields that pld/kernel.py reads (``directions``, ``raw_directions``)
PLD_FIELDS = ["_pmf_remove", "_pmf_add", "_symmetric"]


def test_privacy_loss_distribution_fields():
    pld = privacy_loss_distribution.from_gaussian_mechanism(1.0, sampling_prob=0.5,
                                                            value_discretization_interval=0.1)
    for field in PLD_FIELDS:
        assert hasattr(pld, field), f"PrivacyLossDistribution has no {field}, which dpaudit's pld kernel reads"
    assert hasattr(pld._pmf_remove, "to_dense_pmf"), "a PLD's PMF has no to_dense_pmf"  # noqa: SLF001


def test_the_kernel_mirrors_the_pinned_release():
    """kernel.UPSTREAM names the minor release the kernel mirrors; pyproject pins that range."""
    import re
    from importlib.metadata import version
    from pathlib import Path

    from dpaudit.accounting.pld import kernel

    installed = version("dp-accounting")
    assert installed.startswith(kernel.UPSTREAM + "."), (f"dp-accounting {installed} is installed; the pld kernel "
                                                          f"mirrors {kernel.UPSTREAM}.x: read its internals again")
    pin = re.search(r'"dp-accounting([^"]*)"', (Path(__file__).parents[2] / "pyproject.toml").read_text()).group(1)
    assert f">={kernel.UPSTREAM}" in pin and "<" in pin, f"pyproject pins dp-accounting{pin}"


# private fields of dp-accounting's losses that vectorised_loss.py reads (the kernel's docstring lists them)
LOSS_FIELDS = [("GaussianPrivacyLoss", "_standard_deviation", (1.0,)), ("LaplacePrivacyLoss", "_parameter", (1.0,))]


@pytest.mark.parametrize("cls, field, args", LOSS_FIELDS, ids=[f"{c}.{f}" for c, f, _ in LOSS_FIELDS])
def test_loss_fields(cls, field, args):
    loss = getattr(privacy_loss_mechanism, cls)(*args, sampling_prob=0.5)
    assert hasattr(loss, field), f"{cls} has no {field}, which dpaudit's vectorised_loss reads"
    for public in ("sampling_prob", "adjacency_type", "sensitivity"):
        assert hasattr(loss, public), f"{cls} has no {public}"


def test_mixture_loss_internals():
    """vectorised_loss.MixtureLoss (ELS steps) overrides the mixture's bisection helper and reads its constants."""
    loss = privacy_loss_mechanism.MixtureGaussianPrivacyLoss(1.0, [0, 1, 2], [0.81, 0.18, 0.01])
    for name in ("_inverse_privacy_losses_with_range", "_precompute_privacy_loss_constants", "_variance",
                 "sensitivities"):
        assert hasattr(loss, name), f"MixtureGaussianPrivacyLoss has no {name}, which dpaudit reads"
    params = list(inspect.signature(loss._inverse_privacy_losses_with_range).parameters)  # noqa: SLF001
    assert params == ["privacy_losses", "bounds", "precision"], params
