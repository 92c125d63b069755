"""A 2-process gloo run (torchrun) gives the same weights as one process with the same seeds,
for DP-ZO and DP-SGD: data parallelism changes neither the released quantities nor the accounting."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpaudit.models.loading import load_causal_lm
from dpaudit.training.replay import max_weight_difference

WORKER = Path(__file__).with_name("distributed_worker.py")


def launch(model, run, method, procs):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
           str(WORKER), str(model), str(run), method]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # gloo, on CPU
    assert out.returncode == 0, out.stderr[-3000:]


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


def test_a_rank_without_its_own_gpu_is_refused(monkeypatch):
    import torch

    from dpaudit.errors import DPAuditError
    from dpaudit.training.distributed import setup_world

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(DPAuditError, match="no GPU of its own"):
        setup_world()
