"""The sampler audit: Poisson batches pass (no more false alarms than alpha allows), and every common
non-Poisson sampler is named and refused; the CLI (`audit sampler`, `check --sampler-log`) exits 1 on them."""

import json

import numpy as np
import pytest
from scipy import stats

from cli_helpers import assert_one_line_error, dpaudit
from dpaudit import SamplerAudit
from dpaudit.audit.sampler import analyse_batches
from dpaudit.errors import DPAuditError

N, B, T = 1000, 50, 200
P = B / N


def poisson(rng):
    return [np.flatnonzero(rng.random(N) < P) for _ in range(T)]


def fixed(rng):
    return [rng.choice(N, B, replace=False) for _ in range(T)]


def shuffled(rng):
    out = []
    while len(out) < T:
        perm = rng.permutation(N)
        out += [perm[i:i + B] for i in range(0, N, B)]
    return out[:T]


def cyclic(rng):
    perm = rng.permutation(N)
    return [perm[(i * B) % N:(i * B) % N + B] for i in range(T)]


def balls_in_bins(rng):
    out, k = [], N // B
    while len(out) < T:
        step = rng.integers(0, k, N)
        out += [np.flatnonzero(step == j) for j in range(k)]
    return out[:T]


def with_replacement(rng):
    return [rng.integers(0, N, B) for _ in range(T)]


def fixed_count_poisson(rng):
    """jax_privacy#121: a 'Poisson' sampler that drew a fixed count (B indices, independent each step)."""
    return [np.sort(rng.permutation(N)[:B]) for _ in range(T)]


@pytest.mark.parametrize("sampler, looks", [
    (fixed, "fixed-size batches drawn without replacement"), (shuffled, "shuffled epochs"),
    (cyclic, "cyclic pass"), (balls_in_bins, "balls-in-bins"), (with_replacement, "with replacement"),
    (fixed_count_poisson, "fixed-size batches drawn without replacement")])
def test_non_poisson_samplers_are_named_and_refused(sampler, looks):
    verdict = analyse_batches(sampler(np.random.default_rng(1)), N, P)
    assert looks in verdict.looks_like and not verdict.poisson_accounting_valid
    assert "NOT POISSON" in verdict.verdict


def test_poisson_batches_raise_no_more_false_alarms_than_alpha_allows():
    alarms = sum(not analyse_batches(poisson(np.random.default_rng(100 + s)), N, P).poisson_accounting_valid
                 for s in range(100))
    # At most alpha = 0.05 a run (Bonferroni over four tails); 100 runs exceed 11 alarms with prob. < 1%.
    assert alarms <= stats.binom.ppf(0.99, 100, 0.05), alarms
    estimated = sum(not analyse_batches(poisson(np.random.default_rng(300 + s))).poisson_accounting_valid
                    for s in range(40))
    assert estimated <= stats.binom.ppf(0.99, 40, 0.05)


def test_samplers_are_drawn_from_a_dataloader_or_opacus():
    import torch
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    opacus = SamplerAudit(UniformWithReplacementSampler(num_samples=N, sample_rate=P), steps=T, dataset_size=N,
                          sample_rate=P).run()
    assert opacus.poisson_accounting_valid
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(N, 1)), batch_size=B,
                                         shuffle=True)
    shuffled_loader = SamplerAudit(loader, steps=T, sample_rate=P).run()  # N from the loader's dataset
    assert shuffled_loader.dataset_size == N and "shuffled epochs" in shuffled_loader.looks_like


def _log(path, batches):
    path.write_text("".join(json.dumps([int(i) for i in b]) + "\n" for b in batches))
    return path


def test_the_cli_exits_1_on_a_sampler_that_is_not_poisson(tmp_path):
    good = dpaudit("audit", "sampler", "--log", _log(tmp_path / "p.jsonl", poisson(np.random.default_rng(5))),
                   "-N", N, "--p", P, "--json")
    assert good.returncode == 0 and json.loads(good.stdout)["looks_like"] == "Poisson"
    bad = dpaudit("audit", "sampler", "--log", _log(tmp_path / "s.jsonl", shuffled(np.random.default_rng(5))),
                  "-N", N, "--p", P)
    assert bad.returncode == 1 and "shuffled epochs" in bad.stdout
    plain = tmp_path / "s.txt"
    plain.write_text("".join(" ".join(map(str, b)) + "\n" for b in shuffled(np.random.default_rng(6))))
    assert dpaudit("audit", "sampler", "--log", plain, "-N", N).returncode == 1
    (tmp_path / "x.txt").write_text("1 2 three\n")
    assert_one_line_error(dpaudit("audit", "sampler", "--log", tmp_path / "x.txt"))
    assert_one_line_error(dpaudit("audit", "sampler", "--log", tmp_path / "missing.txt"))


def test_check_gates_the_sampler_too(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"mechanism: gaussian\nnoise_multiplier: 2.0\nbatch_size: {B}\ndataset_size: {N}\n"
                      f"steps: {T}\ndelta: 1.0e-5\ntarget_epsilon: 8\n")
    assert dpaudit("check", config).returncode == 0
    good = dpaudit("check", config, "--sampler-log", _log(tmp_path / "p.jsonl", poisson(np.random.default_rng(8))))
    assert good.returncode == 0, good.stdout
    bad = dpaudit("check", config, "--sampler-log", _log(tmp_path / "f.jsonl", fixed(np.random.default_rng(8))),
                  "--json")
    report = json.loads(bad.stdout)
    assert bad.returncode == 1 and not report["passed"] and "fixed-size" in report["sampler"]["looks_like"]


def test_bad_input():
    with pytest.raises(DPAuditError, match="at least 2 batches"):
        analyse_batches([[1, 2]], N, P)
    with pytest.raises(DPAuditError, match="beyond the dataset size"):
        analyse_batches([[1, 2], [5000]], N, P)
    with pytest.raises(DPAuditError, match="outside"):
        analyse_batches([[1, -2], [3]], N, P)
