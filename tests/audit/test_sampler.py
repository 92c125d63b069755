"""The sampler audit: Poisson batches pass (no more false alarms than alpha allows), and every common
non-Poisson sampler is named and refused; the CLI (`audit sampler`, `check --sampler-log`) exits 1 on them."""

import json

import numpy as np
import pytest
from scipy import stats

from cli_helpers import assert_one_line_error, dpaudit
from dpaudit import SamplerAudit
from dpaudit.audit.sampler import analyse_batches
from dpaudit.core.errors import DPAuditError

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

    # seeded: the audit tests at alpha, so an unseeded draw would fail this test in about one run in twenty
    drawn = UniformWithReplacementSampler(num_samples=N, sample_rate=P, generator=torch.Generator().manual_seed(0))
    opacus = SamplerAudit(drawn, steps=T, dataset_size=N, sample_rate=P).run()
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


# (N, p, T): T p from 0.05 to 50, where a chi-square null raised 22-50 % false alarms at small T p (issue 36)
FALSE_ALARM_GRID = [(10_000, 0.001, 50), (10_000, 0.001, 100), (10_000, 0.001, 300), (2_000, 0.01, 100),
                    (2_000, 0.02, 250), (1_000, 0.1, 500)]


def test_correct_poisson_logs_raise_alarms_at_alpha_across_t_p():
    """>= 200 correct logs over T p in 0.05..50, p given and p estimated: each rate within alpha's binomial band."""
    runs = 34
    given = estimated = 0
    for j, (n, p, t) in enumerate(FALSE_ALARM_GRID):
        for s in range(runs):
            rng = np.random.default_rng(10_000 * j + s)
            batches = [np.flatnonzero(rng.random(n) < p) for _ in range(t)]
            given += not analyse_batches(batches, n, p).poisson_accounting_valid
            estimated += not analyse_batches(batches, n).poisson_accounting_valid
    total = runs * len(FALSE_ALARM_GRID)
    assert total >= 200
    band = stats.binom.ppf(0.995, total, 0.05)
    assert given <= band and estimated <= band, (given, estimated, band)


def test_small_t_p_logs_the_chi_square_null_flagged_pass():
    """The instance of issue 36: N = 10,000, p = 0.001, T = 100 flagged 10 of 20 correct logs."""
    alarms = 0
    for s in range(20):
        rng = np.random.default_rng(77 + s)
        alarms += not analyse_batches([np.flatnonzero(rng.random(10_000) < 0.001) for _ in range(100)],
                                      10_000, 0.001).poisson_accounting_valid
    assert alarms <= 4, alarms


def test_one_oversampled_example_is_caught():
    """N = 60,000, B = 256, T = 2,000, one example drawn at 10x p: the maximum-count test names it."""
    n, p, t = 60_000, 256 / 60_000, 2_000
    for s in range(4):
        rng = np.random.default_rng(500 + s)
        batches = []
        for _ in range(t):
            batch = np.flatnonzero(rng.random(n) < p)
            batch = batch[batch != 123]
            batches.append(np.append(batch, 123) if rng.random() < 10 * p else batch)
        verdict = analyse_batches(batches, n, p)
        assert not verdict.poisson_accounting_valid and "oversamples" in verdict.looks_like
        assert verdict.tests["most inclusions of one example"]["example"] == 123


def test_the_period_search_is_linear():
    """A crafted log whose first batch recurs everywhere but never periodically took 90 s (O(T^2))."""
    import time

    batches = [[0]] * 40_000 + [[1]]
    start = time.perf_counter()
    verdict = analyse_batches(batches, 10)
    assert time.perf_counter() - start < 10
    assert verdict.tests["period of repeating batches"] is None
    assert analyse_batches([[1, 2], [3, 4], [5]] * 5, 6).tests["period of repeating batches"] == 3


def test_check_gates_each_phase_and_the_log_s_step_count(tmp_path):
    """Issue 36: a 1990-step p = 0.001 + 10-step p = 0.05 config passed with a log of 2000 steps all at
    p = 0.05; a 20-step config passed with a 2000-step log; a log matching the phased config failed."""
    n = 2_000
    config = tmp_path / "c.yaml"
    config.write_text(f"mechanism: gaussian\nnoise_multiplier: 1.0\ndataset_size: {n}\ndelta: 1.0e-5\n"
                      "target_epsilon: 20\nphases:\n  - {sampling_rate: 0.001, steps: 1990}\n"
                      "  - {sampling_rate: 0.05, steps: 10}\n")
    rng = np.random.default_rng(3)
    matching = [np.flatnonzero(rng.random(n) < 0.001) for _ in range(1990)] + \
               [np.flatnonzero(rng.random(n) < 0.05) for _ in range(10)]
    good = dpaudit("check", config, "--sampler-log", _log(tmp_path / "ok.jsonl", matching), "--json")
    assert good.returncode == 0, good.stdout
    assert [p["consistent_with_config"] for p in json.loads(good.stdout)["sampler"]["phases"]] == [True, True]
    all_high = [np.flatnonzero(rng.random(n) < 0.05) for _ in range(2000)]
    bad = dpaudit("check", config, "--sampler-log", _log(tmp_path / "high.jsonl", all_high))
    assert bad.returncode == 1 and "phase 1" in bad.stdout
    short = tmp_path / "short.yaml"
    short.write_text(f"mechanism: gaussian\nnoise_multiplier: 2.0\nsampling_rate: 0.05\ndataset_size: {n}\n"
                     "steps: 20\ndelta: 1.0e-5\ntarget_epsilon: 8\n")
    longer = dpaudit("check", short, "--sampler-log", _log(tmp_path / "long.jsonl", all_high), "--json")
    report = json.loads(longer.stdout)
    assert longer.returncode == 1 and report["sampler"]["steps_logged"] == 2000 and not report["passed"]
    assert "more than the 20 steps" in report["sampler"]["verdict"]


def test_the_sampler_audit_stays_within_max_memory(tmp_path):
    """Issue 36: --max-memory 300M was not enforced (1.7 GB RSS for a 3-line log naming index 99,999,999)."""
    log = tmp_path / "huge.log"
    log.write_text("1 2 3\n99999999\n4 5\n")
    out = dpaudit("audit", "sampler", "--log", log, "--max-memory", "300M")
    assert_one_line_error(out)
    assert "memory budget" in out.stderr


def test_a_sampler_audit_s_log_reads_back_as_the_same_verdict(tmp_path):
    """SamplerAudit.write_log (public: a CI job logs its loader's batches for `check --sampler-log`) writes what
    read_log reads: the same batches, the same verdict, from the command line too."""
    from dpaudit.audit.sampler import read_log

    batches = shuffled(np.random.default_rng(4))
    audit = SamplerAudit(batches, steps=T, dataset_size=N, sample_rate=P)
    log = audit.write_log(tmp_path / "batches.log")
    assert [list(b) for b in read_log(log)] == [[int(i) for i in b] for b in batches]
    assert analyse_batches(read_log(log), N, P).looks_like == audit.run().looks_like
    out = dpaudit("audit", "sampler", "--log", log, "-N", N, "--p", P)
    assert out.returncode == 1 and "shuffled epochs" in out.stdout
