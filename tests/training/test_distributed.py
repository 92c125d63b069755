"""A 2-process gloo run (torchrun) gives the same weights as one process with the same seeds,
for DP-ZO and DP-SGD, data parallel or sharded (--shard, FSDP2): neither changes the released
quantities nor the accounting."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpaudit.models.loading import load_causal_lm
from dpaudit.workflows.replay import max_weight_difference

WORKER = Path(__file__).resolve().parents[1] / "distributed_worker.py"


def launch(model, run, method, procs, *options):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
           str(WORKER), str(model), str(run), method, *options]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # gloo, on CPU
    stopped = any(o.startswith("stop=") for o in options)
    assert (out.returncode != 0) if stopped else (out.returncode == 0), out.stderr[-3000:]


def weights_gap(run_a, run_b, base):
    """(largest weight change of run a, largest difference between the two runs' models)."""
    a, _ = load_causal_lm(run_a / "model")
    b, _ = load_causal_lm(run_b / "model")
    return max_weight_difference(a, load_causal_lm(base)[0]), max_weight_difference(b, a)


def zo_log(run):
    return [json.loads(x) for x in (run / "zo_steps.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["dp-zo", "dp-sgd"])
def test_two_gloo_processes_match_one(tiny_model_dir, tmp_path, method):
    launch(tiny_model_dir, tmp_path / "one", method, 1)
    launch(tiny_model_dir, tmp_path / "two", method, 2)
    one, _ = load_causal_lm(tmp_path / "one" / "model")
    two, _ = load_causal_lm(tmp_path / "two" / "model")
    base, _ = load_causal_lm(tiny_model_dir)
    moved = max_weight_difference(one, base)
    gap = max_weight_difference(two, one)
    assert moved > 1e-4, "the run did not train"
    assert gap <= 1e-4 * max(1.0, moved) + 1e-6, (gap, moved)
    ledgers = [json.loads((tmp_path / d / "privacy_ledger.json").read_text()) for d in ("one", "two")]
    assert ledgers[0]["epsilon_spent"] == ledgers[1]["epsilon_spent"]
    assert ledgers[0]["world_size"] == 1 and ledgers[1]["world_size"] == 2
    if method == "dp-zo":
        logs = [[json.loads(x) for x in (tmp_path / d / "zo_steps.jsonl").read_text().splitlines()]
                for d in ("one", "two")]
        assert [r["seed"] for r in logs[0]] == [r["seed"] for r in logs[1]]
        assert [r["scalar"] for r in logs[0]] == pytest.approx([r["scalar"] for r in logs[1]], rel=1e-5, abs=1e-7)


@pytest.fixture(scope="module")
def sharded_zo(tiny_model_dir, tmp_path_factory):
    """DPZero directions (the sphere scale needs the ranks' partial sums) and micro-batches of 3, so the
    ranks' shares need different numbers of passes and the smaller one pads."""
    root = tmp_path_factory.mktemp("sharded_zo")
    launch(tiny_model_dir, root / "one", "dp-zo", 1, "sphere", "micro")
    launch(tiny_model_dir, root / "two", "dp-zo", 2, "sphere", "micro", "shard")
    return root


def test_sharded_dp_zo_matches_one_process(sharded_zo, tiny_model_dir):
    moved, gap = weights_gap(sharded_zo / "one", sharded_zo / "two", tiny_model_dir)
    assert moved > 1e-4, "the run did not train"
    assert gap <= 1e-5 * max(1.0, moved), (gap, moved)
    logs = [zo_log(sharded_zo / d) for d in ("one", "two")]
    assert [r["seed"] for r in logs[0]] == [r["seed"] for r in logs[1]]
    assert [r["scalar"] for r in logs[0]] == pytest.approx([r["scalar"] for r in logs[1]], rel=1e-5, abs=1e-7)
    ledgers = [json.loads((sharded_zo / d / "privacy_ledger.json").read_text()) for d in ("one", "two")]
    assert ledgers[0]["epsilon_spent"] == ledgers[1]["epsilon_spent"]
    meta = json.loads((sharded_zo / "two" / "run_config.json").read_text())
    assert meta["sharded"] is True and meta["config"]["shard"] is True


def test_a_sharded_dp_zo_run_takes_white_box_canaries_as_one_process_does(tiny_model_dir, tmp_path):
    """DP-ZO's white-box canaries join the summed scalar once, on every rank alike: a sharded run plants the
    same canaries, releases the same (seed, scalar) log and audits to the same bound as one process."""
    from cli_helpers import dpaudit

    launch(tiny_model_dir, tmp_path / "one", "dp-zo", 1, "whitebox")
    launch(tiny_model_dir, tmp_path / "two", "dp-zo", 2, "shard", "whitebox")
    logs = [zo_log(tmp_path / d) for d in ("one", "two")]
    assert [r["scalar"] for r in logs[0]] == pytest.approx([r["scalar"] for r in logs[1]], rel=1e-5, abs=1e-7)
    bounds = []
    for d in ("one", "two"):
        out = dpaudit("audit", "transcript", "--run", tmp_path / d, "--json")
        assert out.returncode in (0, 1), out.stderr
        bounds.append(json.loads(out.stdout)["epsilon_lower_bound"])
    assert bounds[0] == pytest.approx(bounds[1], rel=1e-3)


@pytest.mark.parametrize("layout", [("shard",), ()], ids=["sharded", "data-parallel"])
def test_dp_sgd_white_box_canaries_under_torchrun_read_what_one_process_reads(tiny_model_dir, tmp_path, layout):
    """DP-SGD's gradient canaries (probes/probe.py) on two processes: sharded, each joins the one slice
    holding its coordinate and the ranks' readings are summed; data-parallel, rank 0 adds them once and reads
    the reduced release. Either way the transcript is one process's (the noise streams are the same)."""
    import numpy as np

    from dpaudit.audit.whitebox_canaries import TRANSCRIPT

    launch(tiny_model_dir, tmp_path / "one", "dp-sgd", 1, "whitebox")
    launch(tiny_model_dir, tmp_path / "two", "dp-sgd", 2, *layout, "whitebox")
    rows = [np.fromfile(tmp_path / d / TRANSCRIPT, dtype="<f4").reshape(-1, 64) for d in ("one", "two")]
    assert rows[0].shape == rows[1].shape == (6, 64)
    assert np.abs(rows[0]).max() > 1  # a release was read, canaries and noise included
    assert np.allclose(rows[0], rows[1], rtol=1e-3, atol=1e-3), np.abs(rows[0] - rows[1]).max()


def test_a_sharded_dp_zo_run_replays_on_one_process(sharded_zo):
    from dpaudit.workflows.replay import replay_run

    replayed, _ = replay_run(sharded_zo / "two")
    trained, _ = load_causal_lm(sharded_zo / "two" / "model")
    assert max_weight_difference(replayed, trained) < 1e-5


def test_sharded_dp_sgd_matches_one_process(tiny_model_dir, tmp_path):
    launch(tiny_model_dir, tmp_path / "one", "dp-sgd", 1, "micro")
    launch(tiny_model_dir, tmp_path / "two", "dp-sgd", 2, "micro", "shard")
    moved, gap = weights_gap(tmp_path / "one", tmp_path / "two", tiny_model_dir)
    assert moved > 1e-3, "the run did not train"
    assert gap <= 1e-5 * max(1.0, moved), (gap, moved)
    ledgers = [json.loads((tmp_path / d / "privacy_ledger.json").read_text()) for d in ("one", "two")]
    assert ledgers[0]["epsilon_spent"] == ledgers[1]["epsilon_spent"]


def test_a_sharded_dp_sgd_run_checkpoints_and_resumes_as_one_process_does(tiny_model_dir, tmp_path):
    """Killed after step 5 with checkpoints every 2 steps, then resumed: the checkpoint holds whole
    weights and optimizer state, gathered from the shards, and a resumed sharded run ends where a resumed
    single-process run does. A sharded checkpoint is not resumed without --shard."""
    for procs, name, extra in ((1, "one", ()), (2, "two", ("shard",))):
        launch(tiny_model_dir, tmp_path / name, "dp-sgd", procs, "save", "stop=5", *extra)
        state = json.loads((tmp_path / name / "checkpoint" / "trainer_state.json").read_text())
        assert state["step"] == 4 and state["sharded"] is (procs == 2)
        assert (tmp_path / name / "checkpoint" / "optimizer.pt").is_file()
    from cli_helpers import dpaudit

    data = tmp_path / "texts.txt"
    from distributed_worker import TEXTS

    data.write_text("\n".join(TEXTS) + "\n")  # the run's own data: a resume with other data is refused first
    refused = dpaudit("train", "--model", tiny_model_dir, "--data", data, "-o", tmp_path / "two", "--resume",
                      "--eps", "4", "-T", "6", "-B", "12", "--lr", "1e-2", "--save-every", "2", "--allow-overspend")
    assert refused.returncode == 2 and "--shard" in refused.stderr and "Traceback" not in refused.stderr
    for procs, name, extra in ((1, "one", ()), (2, "two", ("shard",))):
        launch(tiny_model_dir, tmp_path / name, "dp-sgd", procs, "save", "resume", *extra)
    moved, gap = weights_gap(tmp_path / "one", tmp_path / "two", tiny_model_dir)
    assert moved > 1e-3 and gap <= 1e-5 * max(1.0, moved), (gap, moved)


@pytest.mark.parametrize("noise,accountant", [("bandmf", "bandmf"), ("blt", "matrix")])
def test_a_correlated_run_draws_the_same_numbers_sharded_or_data_parallel_and_resumes_so(tiny_model_dir, tmp_path,
                                                                                        noise, accountant):
    """Correlated noise (--noise bandmf,b=2; blt,buffers=2,order=fixed with its fixed-order batches) killed after
    step 5 and resumed from its step-4 checkpoint, in one process, sharded over two (each rank continues the noises
    or buffers of its slices; the checkpoint holds them whole) and data parallel over two (rank 0 adds the noise):
    the same weights, and the same ledger."""
    layouts = {"one": (1, ()), "sharded": (2, ("shard",)), "ddp": (2, ())}
    for name, (procs, extra) in layouts.items():
        launch(tiny_model_dir, tmp_path / name, "dp-sgd", procs, noise, "micro", "save", "stop=5", *extra)
        launch(tiny_model_dir, tmp_path / name, "dp-sgd", procs, noise, "micro", "save", "resume", *extra)
    ledgers = {n: json.loads((tmp_path / n / "privacy_ledger.json").read_text()) for n in layouts}
    assert all(ledger["attempts"] == [[0, 5, None], [4, None, 0]] and ledger["accountant"] == accountant
               for ledger in ledgers.values())
    assert len({ledger["epsilon_spent"] for ledger in ledgers.values()}) == 1
    for name in ("sharded", "ddp"):
        moved, gap = weights_gap(tmp_path / "one", tmp_path / name, tiny_model_dir)
        assert moved > 1e-3 and gap <= 1e-5 * max(1.0, moved), (name, gap, moved)


def test_sharded_bf16_keeps_float32_master_weights(tiny_model_dir, tmp_path):
    """--bf16 --shard: computed in bf16, but the shards the optimizer updates stay float32, so the saved
    model is float32 (a single-process --bf16 run holds and saves bf16 weights)."""
    from safetensors import safe_open

    launch(tiny_model_dir, tmp_path / "two", "dp-sgd", 2, "bf16", "shard")
    saved = set()
    for f in (tmp_path / "two" / "model").glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            saved |= {h.get_slice(k).get_dtype() for k in h.keys()}
    assert saved == {"F32"}
    model, _ = load_causal_lm(tmp_path / "two" / "model")
    moved = max_weight_difference(model, load_causal_lm(tiny_model_dir)[0])
    assert 1e-3 < moved < 1.0


def test_a_rank_without_its_own_gpu_is_refused(monkeypatch):
    import torch

    from dpaudit.core.errors import DPAuditError
    from dpaudit.training.distributed import setup_world

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(DPAuditError, match="no GPU of its own"):
        setup_world()


@pytest.mark.parametrize("extra,named", [(["--trainable", "lora"], "LoRA"),
                                         (["--per-sample-grads", "materialise"], "materialise"),
                                         (["--plant-bug", "no-clip"], "planted bugs")])
def test_what_shard_does_not_run_with_is_refused_in_one_line(tiny_model_dir, tmp_path, extra, named, monkeypatch):
    from cli_helpers import assert_one_line_error, dpaudit

    monkeypatch.setenv("DPAUDIT_ALLOW_BUGS", "1")  # past the planted-bug gate, to the --shard check

    data = tmp_path / "d.txt"
    data.write_text("".join(f"line {i}\n" for i in range(20)))
    out = dpaudit("train", "--shard", "--model", tiny_model_dir, "-d", data, "-o", tmp_path / "run", "--eps", "4",
                  *extra)
    assert_one_line_error(out)
    assert named in out.stderr and not (tmp_path / "run").exists()


def test_the_cli_under_torchrun_trains_sharded_and_every_rank_exits_0(tiny_model_dir, tmp_path):
    """The documented command (docs/distributed.md), run as users run it: both ranks exit 0 and rank 0's
    --json answer arrives whole (each rank leaves through exit_process, after flushing)."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                            (f"Carol number {i} sells maps in Oslo." for i in range(40))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dpaudit.cli.main", "train", "--shard", "--method", "dp-sgd", "--eps", "8", "-B", "4", "-T", "2",
           "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "run"), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout)
    assert answer["epsilon"] <= 8 and answer["steps"] == 2
