"""The run record (core/run_record.py): run_config.json read and written through one typed, versioned record.
The fixtures in tests/fixtures/run_records/ are run_config.json files written by dpaudit before the record
(format 1, b63d03b: a black-box DP-SGD audit run on a pretrained model, a DP-ZO audit run, a white-box DP-SGD
run); each must keep opening, with what it said."""

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from dpaudit.core import run_record
from dpaudit.core.errors import DPAuditError
from dpaudit.core.run_record import FORMAT, RunRecord, RunSettings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "run_records"


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.mark.parametrize("name,release,method", [
    ("v1_black_box_dp_sgd.json", "gradient-transcript", "dp-sgd"),
    ("v1_dp_zo.json", "zo-log", "dp-zo"),
    ("v1_white_box_run/run_config.json", "gradient-transcript", "dp-sgd"),
])
def test_format_1_folders_still_open_with_what_they_said(tmp_path, name, release, method):
    old = _fixture(name)
    assert "format" not in old  # written before the record
    (tmp_path / "run_config.json").write_text(json.dumps(old))
    record = run_record.read(tmp_path)
    assert record.release == release and record.settings.method == method
    for key in ("base_model", "sigma", "sampling_rate", "examples", "direction_device", "direction_stream", "sharded"):
        assert getattr(record, key) == old[key], key
    assert list(record.lora_new_token_rows) == old["lora_new_token_rows"]
    for key, value in old["config"].items():
        assert getattr(record.settings, key) == (math.inf if value == "inf" else value), key
    # written back, it is format 2 and reads the same
    run_record.write(tmp_path, record)
    assert json.loads((tmp_path / "run_config.json").read_text())["format"] == FORMAT
    assert run_record.read(tmp_path) == record


def test_the_oldest_runs_take_the_values_they_had():
    """Keys added over time: a run without "release" released by its method, without "direction_stream" drew
    directions in sequence (training/streams.LEGACY), without "sampling" drew Poisson batches."""
    from dpaudit.training.streams import LEGACY

    record = RunRecord.from_json({"config": {"method": "dp-zo", "clip": 1.0}}, "old")
    assert record.release == "zo-log" and record.direction_stream == LEGACY
    assert record.settings.sampling == "poisson" and record.settings.clip == 1.0


@pytest.mark.parametrize("change,key", [
    ({"config": {"clip": -1.0}}, "clip"),
    ({"config": {"clip": "1"}}, "clip"),
    ({"config": {"steps": 0}}, "steps"),
    ({"config": {"target_epsilon": math.nan}}, "target_epsilon"),
    ({"config": {"bf16": 1}}, "bf16"),
    ({"sampling_rate": 1.5}, "sampling_rate"),
    ({"sigma": -2.0}, "sigma"),
    ({"release": "everything"}, "release"),
    ({"lora_new_token_rows": [1, -2]}, "lora_new_token_rows"),
])
def test_a_value_no_run_writes_is_refused_naming_its_key_not_its_value(change, key):
    data = _fixture("v1_dp_zo.json")
    for k, v in change.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) else v
    with pytest.raises(DPAuditError, match=key) as err:
        RunRecord.from_json(data, "run_config.json")
    assert "-1.0" not in str(err.value) and "everything" not in str(err.value)


@pytest.mark.parametrize("data,message", [
    ({"config": {}, "format": "dpaudit-run/9"}, "unknown to this dpaudit"),
    ({"config": {"method": "dp-sgd", "a_new_option": 1}, "format": FORMAT}, "does not know"),
    ({"config": {}, "format": FORMAT, "a_new_key": 1}, "does not know"),
    ({"config": "dp-sgd"}, "not a run config"),
    ([1, 2], "not a run config"),
])
def test_a_file_of_another_format_or_version_is_refused(data, message):
    with pytest.raises(DPAuditError, match=message):
        RunRecord.from_json(data, "run_config.json")


def test_a_folder_without_a_record_is_not_a_run(tmp_path):
    assert run_record.read(tmp_path, required=False) is None
    with pytest.raises(DPAuditError, match="not a run folder"):
        run_record.read(tmp_path)


_SETTING_VALUES = {
    "method": st.sampled_from(["dp-sgd", "dp-zo"]), "target_epsilon": st.floats(1e-3, 1e3) | st.just(math.inf),
    "delta": st.floats(0, 0.5), "sigma": st.none() | st.floats(0.1, 100), "clip": st.floats(1e-3, 10),
    "steps": st.integers(1, 10_000), "batch_size": st.integers(0, 4096), "bf16": st.booleans(),
    "noise": st.none() | st.just("bandmf,b=4"), "max_memory": st.none() | st.integers(1, 2**40),
}


@settings(max_examples=50, deadline=None)
@given(settings_values=st.fixed_dictionaries(_SETTING_VALUES), sigma=st.none() | st.floats(0.1, 100),
       rate=st.floats(1e-4, 1.0), rows=st.lists(st.integers(0, 10**6), max_size=20))
def test_a_record_reads_back_as_written(settings_values, sigma, rate, rows):
    record = RunRecord(settings=RunSettings(**settings_values), base_model="m", sigma=sigma, sampling_rate=rate,
                       examples=100, expected_batch_size=rate * 100, lora_new_token_rows=tuple(rows),
                       release="zo-log")
    assert RunRecord.from_json(json.loads(json.dumps(record.to_json())), "x") == record


def test_every_train_config_field_is_recorded_or_named_as_not():
    """A TrainConfig field added without the record would not reach the folder; one renamed fails settings_of."""
    from dpaudit.training.resume import settings_of
    from dpaudit.training.runner import TrainConfig

    not_recorded = {"secret_seed", "allow_overspend",  # a secret; a permission for one resume
                    "bug", "strategy", "privacy_unit"}   # resolved from plant_bug, noise and the unit's fields
    assert {f.name for f in fields(TrainConfig)} - not_recorded == {f.name for f in fields(RunSettings)}
    cfg = TrainConfig(method="dp-zo", target_epsilon=2.0, secret_seed=7, batch_size=8)
    recorded = settings_of(cfg)
    assert recorded.method == "dp-zo" and recorded.batch_size == 8 and recorded.clip == cfg.clip
    assert "secret_seed" not in json.dumps(recorded.to_json())


def test_a_format_1_white_box_run_audits_as_the_same_run_in_format_2(tmp_path):
    """The white-box audit of a run folder written before the record (its transcript, canaries and ledger kept
    as they were) gives the same result as the same folder with its record rewritten in format 2."""
    import shutil

    from dpaudit.audit.whitebox import audit_run_folder

    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(FIXTURES / "v1_white_box_run", old)
    shutil.copytree(old, new)
    run_record.write(new, run_record.read(old))
    assert "format" not in json.loads((old / "run_config.json").read_text())
    a, b = (audit_run_folder(folder, claimed_epsilon=4.0, delta=1e-5, alpha=0.05)[0] for folder in (old, new))
    assert a.epsilon_lower_bound == b.epsilon_lower_bound > 0 and a.violation == b.violation


def test_a_format_1_probe_folder_audits_as_the_same_folder_in_format_2(tmp_path):
    """probe.json of a WhiteBoxProbe attached to Opacus (hooks, sigma 1, m 50, 20 steps) written before the record:
    its fields read back typed, and the audit of the folder equals the audit with probe.json rewritten."""
    import shutil

    from dpaudit.audit.whitebox import audit_run_folder
    from dpaudit.core.run_record import PROBE_FORMAT, ProbeRecord

    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(FIXTURES / "v1_probe", old)
    shutil.copytree(old, new)
    written = json.loads((old / "probe.json").read_text())
    assert written["format"] == "dpaudit-probe/1"
    record = run_record.read_probe(old)
    assert record.kind == "gradient" and record.m == written["m"] and record.clip == written["clip"]
    assert [list(s) for s in record.parameter_shapes] == written["parameter_shapes"]
    assert record.noise_multiplier == written["noise_multiplier"] and record.loader_rate == written["loader_rate"]
    run_record.write_probe(new, record)
    assert json.loads((new / "probe.json").read_text())["format"] == PROBE_FORMAT
    assert run_record.read_probe(new) == record
    a, b = (audit_run_folder(folder, claimed_epsilon=4.375, delta=1e-5, alpha=0.05)[0] for folder in (old, new))
    assert a.epsilon_lower_bound == b.epsilon_lower_bound and a.verdict == b.verdict
    assert a.noise is not None and a.noise.to_dict() == b.noise.to_dict()
    # format 1 had no schema: a key no probe writes any longer is dropped; format 2 refuses it
    assert ProbeRecord.from_json({**written, "retired_key": 1}, "p") == record
    with pytest.raises(DPAuditError, match="does not know"):
        ProbeRecord.from_json({**record.to_json(), "retired_key": 1}, "p")


@pytest.mark.parametrize("key,value", [("clip", -1.0), ("sample_rate", 2.0), ("gain", 0), ("m", 1),
                                       ("kind", "weights"), ("parameter_shapes", [[2, -1]])])
def test_a_probe_value_no_probe_writes_is_refused(key, value):
    from dpaudit.core.run_record import ProbeRecord

    data = json.loads((FIXTURES / "v1_probe" / "probe.json").read_text())
    with pytest.raises(DPAuditError):
        ProbeRecord.from_json({**data, key: value}, "probe.json")


def test_the_side_files_carry_their_format_and_old_ones_still_read(tmp_path):
    """The canary manifest and the probe's tallies are written with a format; the format-1 files of the probe
    fixture (no key) audit as the same folder with each rewritten in format 2; a format no dpaudit wrote is refused."""
    import shutil

    from dpaudit.audit.whitebox import audit_run_folder
    from dpaudit.core.run_record import SIDE_FORMATS

    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(FIXTURES / "v1_probe", old)
    shutil.copytree(old, new)
    present = [name for name in SIDE_FORMATS if (old / name).is_file()]
    assert "whitebox_canaries.json" in present and "noise_tally.json" in present
    for name in present:
        data = json.loads((old / name).read_text())
        assert "format" not in data
        (new / name).write_text(json.dumps(run_record.stamped(name, data)))
    a, b = (audit_run_folder(folder, claimed_epsilon=4.375, delta=1e-5, alpha=0.05)[0] for folder in (old, new))
    assert a.epsilon_lower_bound == b.epsilon_lower_bound and a.noise.to_dict() == b.noise.to_dict()
    for name in present:
        data = json.loads((new / name).read_text())
        (new / name).write_text(json.dumps({**data, "format": "dpaudit-from-the-future/9"}))
        with pytest.raises(DPAuditError, match="format this dpaudit does not know"):
            audit_run_folder(new, claimed_epsilon=4.375, delta=1e-5, alpha=0.05)
        (new / name).write_text(json.dumps(data))


def test_a_format_1_ledger_reads_as_it_said_and_a_tampered_one_is_refused(tmp_path):
    """The white-box fixture's ledger (format 1, no key) reads back typed, each key as written ("inf" as infinity);
    a value no run writes, a phase it does not describe or a format no dpaudit wrote is refused, never read as 0."""
    from dpaudit.core.run_record import LEDGER_FORMAT, LedgerRecord, ledger_json, read_ledger

    written = json.loads((FIXTURES / "v1_white_box_run" / "privacy_ledger.json").read_text())
    record = read_ledger(FIXTURES / "v1_white_box_run")
    assert "format" not in written and dict(record.said) == written
    assert record.steps_executed == 3 and record.claimed_epsilon == written["epsilon_total"]
    assert LedgerRecord.from_json(ledger_json(written), "l") == record
    assert ledger_json(written)["format"] == LEDGER_FORMAT
    assert LedgerRecord.from_json({**written, "epsilon_total": "inf"}, "l").claimed_epsilon is None
    assert not LedgerRecord.from_json({"steps_executed": None}, "l").says("steps_executed")
    for bad in ({"steps_executed": -1}, {"steps_executed": "3"}, {"sigma": "1.0"}, {"epsilon_spent": float("nan")},
                {"phases": [{"from_step": 0}]}, {"phases": ["x"]}, {"format": "dpaudit-ledger/9"},
                ledger_json({"retired": 1})):
        with pytest.raises(DPAuditError, match="spending is unknown|does not know| is not "):
            LedgerRecord.from_json(bad, "l")
    assert dict(LedgerRecord.from_json({"retired": 1}, "l").said) == {}  # format 1 had no schema: dropped


def test_a_checkpoint_state_health_and_accountant_ledger_read_back_typed():
    """trainer_state.json (format 1 as the trainers wrote it before: no key; 2 with its format), health.json and the
    Hugging Face accountant ledger: what is written reads back the same; what no dpaudit wrote is refused."""
    from dpaudit.core.run_record import CheckpointState, HealthRecord, RunSettings

    settings = RunSettings(method="dp-sgd")
    state = CheckpointState(4, settings, sharded=True, attempt=1)
    assert CheckpointState.from_json(json.loads(json.dumps(state.to_json())), "s") == state
    old = {"step": 4, "config": {**settings.to_json(), "retired_option": 1}, "sharded": False}  # format 1
    assert CheckpointState.from_json(old, "s") == CheckpointState(4, None, False, None)
    for bad in ({"step": 0}, {"step": 4, "sharded": "yes"}, {"step": 4, "attempt": -1}, {**state.to_json(), "x": 1},
                {"format": "dpaudit-checkpoint/9", "step": 4}):
        with pytest.raises(DPAuditError):
            CheckpointState.from_json(bad, "s")
    health = HealthRecord(12, 4, (("outside-dp", "lm_head.weight", "moved outside the DP step"),), None)
    assert HealthRecord.from_json(json.loads(json.dumps(health.to_json())), "h") == health
    with pytest.raises(DPAuditError):
        HealthRecord.from_json({**health.to_json(), "findings": [{"kind": 1}]}, "h")


def test_the_accountant_ledger_reads_its_history_and_refuses_another_file(tmp_path):
    from dpaudit.core.run_record import accountant_ledger_json, read_accountant_history

    path = tmp_path / "ledger.json"
    assert read_accountant_history(path) is None
    path.write_text(json.dumps(accountant_ledger_json([(1.0, 0.01, 30), (1.0, 0.02, 5)])))
    assert read_accountant_history(path) == [(1.0, 0.01, 30), (1.0, 0.02, 5)]
    for bad in ({"history": [[1.0, 0.01, 30]]}, {**accountant_ledger_json([]), "history": [[1.0, 0.0, 3]]},
                {**accountant_ledger_json([]), "history": [[1.0, 0.01, True]]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(DPAuditError, match="not an accountant ledger"):
            read_accountant_history(path)


def test_the_allocation_secret_reads_in_both_formats_and_refuses_another_file(tmp_path):
    from dpaudit.core.run_record import allocation_secret_json, read_allocation_secret

    path = tmp_path / "allocation_secret.json"
    assert read_allocation_secret(path) is None
    for data, secret in ((allocation_secret_json(2 ** 62), 2 ** 62), ({"secret": 7}, 7), ({}, None)):
        path.write_text(json.dumps(data))
        assert read_allocation_secret(path) == secret
    for bad in ({"secret": True}, {"secret": "7"}, {"format": "dpaudit-allocation-secret/9", "secret": 7},
                {"format": "dpaudit-allocation-secret/2"}):
        path.write_text(json.dumps(bad))
        with pytest.raises(DPAuditError, match="not an allocation secret"):
            read_allocation_secret(path)


def test_a_checkpoint_manifest_carries_its_format_and_a_format_1_one_is_still_intact(tmp_path):
    """checkpoint_manifest.json is sealed with its format; a format-1 manifest (no key, as dpaudit sealed before)
    leaves the checkpoint intact at its step; a format no dpaudit wrote makes it not intact (a resume passes it over,
    as it passes over any checkpoint it cannot verify)."""
    from dpaudit.core.atomic import atomic_write_json
    from dpaudit.training import checkpoint

    def write(folder):
        (folder / "weights.bin").write_bytes(b"w" * 64)
        atomic_write_json(folder / checkpoint.STATE, run_record.CheckpointState(step=3).to_json())

    checkpoint.save(tmp_path, 3, write)
    saved = tmp_path / checkpoint.FINAL
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
    assert manifest["format"] == run_record.SIDE_FORMATS[checkpoint.MANIFEST]
    assert checkpoint.intact_step(saved) == 3
    old = {k: v for k, v in manifest.items() if k != "format"}
    (saved / checkpoint.MANIFEST).write_text(json.dumps(old))
    assert checkpoint.intact_step(saved) == 3
    (saved / checkpoint.MANIFEST).write_text(json.dumps({**old, "format": "dpaudit-from-the-future/9"}))
    assert checkpoint.intact_step(saved) is None


def test_a_watchs_looks_carry_their_format_and_old_lines_still_count(tmp_path):
    """Each line of running.jsonl is written with its format; format-1 lines (no key) count as the looks they
    were; a line of a format no dpaudit wrote is refused (its looks, and so the alpha spent, are unknown)."""
    from dpaudit.probes.looks import RUNNING, running_looks

    name = run_record.SIDE_FORMATS[RUNNING]
    lines = [{"step": 16, "look": 1, "final": False}, {"format": name, "step": 32, "look": 2, "final": False},
             {"format": name, "step": 40, "look": 3, "final": True}]
    (tmp_path / RUNNING).write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert running_looks(tmp_path) == (2, True)
    lines[1]["format"] = "dpaudit-from-the-future/9"
    (tmp_path / RUNNING).write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DPAuditError, match="format this dpaudit does not know"):
        running_looks(tmp_path)
