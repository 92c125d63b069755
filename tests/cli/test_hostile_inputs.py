"""Hostile and careless inputs (issue 15): the gate fails closed, writes never destroy what is not a regular
file, configs are parsed within limits and never echoed, checkpoint code never runs, OS errors are one line."""

import json
import os
import stat

import pytest

from cli_helpers import assert_one_line_error, dpaudit

PASSING = "mechanism: gaussian\nbatch_size: 16\ndataset_size: 1000\nsteps: 1000\ndelta: 1.0e-5\ntarget_epsilon: 8\n"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_outputs_never_replace_devices_or_folders(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target, what in ((fifo, "not a regular file"), (tmp_path, "a folder")):
        out = dpaudit("plot", "--vs", "sigma", "-o", target, "--force")
        assert_one_line_error(out)
        assert what in out.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # still a FIFO


def test_a_symlinked_output_is_not_replaced(tmp_path):
    precious = write(tmp_path, "precious.png", "keep me")
    link = tmp_path / "link.png"
    link.symlink_to(precious)
    assert_one_line_error(dpaudit("plot", "--vs", "sigma", "-o", link, "--force"))
    assert link.is_symlink() and precious.read_text() == "keep me"


def test_unwritable_output_folder_is_one_line_exit_2(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/dpaudit-cannot-write/x.png"  # root can write anywhere but /proc
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "x.png"
    assert_one_line_error(dpaudit("plot", "--vs", "sigma", "-o", target))


@pytest.mark.parametrize("text,message", [
    (PASSING, "states no noise_multiplier"),                                   # sigma missing: fail closed
    (PASSING + "noise_multiplier: null\n", "states no noise_multiplier"),
    ("target_epsilon: 1\ndelta: 1e-5\n", "states no noise_multiplier"),
    (PASSING + "noise_multiplier: 1\ncalibrate: true\n", "keep one"),
    ("noise_multiplier: 0.1\nprivacy:\n" + "".join("  " + line + "\n" for line in PASSING.splitlines()),
     "both at the top and in the 'privacy' section"),
    ("dpaudit:\n  noise_multiplier: 1\nprivacy:\n  noise_multiplier: 2\n", "both a 'dpaudit' and a 'privacy'"),
    (PASSING + "noise_multiplier: 1\nsteps: 1e308\n", "beyond"),
    ("mechanism: gaussian\nbatch_size: 16\ndataset_size: 1000\nepochs: 1.0e+300\ndelta: 1.0e-5\n"
     "target_epsilon: 8\nnoise_multiplier: 1\n", "steps"),
    ("a: &a [x, x, x]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n", "aliases"),   # billion laughs, small
    ("x: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested deeper"),
    ("1: 2\n", "every key must be a name"),
])
def test_check_refuses_unusable_configs_with_exit_2(tmp_path, text, message):
    out = dpaudit("check", write(tmp_path, "c.yaml", text), timeout=120)
    assert_one_line_error(out)
    assert message in out.stderr


def test_check_never_echoes_the_file(tmp_path):
    secret = "root:$6$saltsalt$5H0QpwprRiJQR19Y5aVvM9ZK0ZvIcm8:19000:0:99999:7:::"
    out = dpaudit("check", write(tmp_path, "shadow.yaml", secret + "\n"))
    assert_one_line_error(out)
    assert "$6$" not in out.stderr and "saltsalt" not in out.stderr
    huge = tmp_path / "huge.yaml"
    huge.write_text("x: 1\n" * 300_000)
    out = dpaudit("check", huge)
    assert_one_line_error(out)
    assert "KiB" in out.stderr


def test_check_judges_the_stated_sigma_and_calibrates_only_when_asked(tmp_path):
    ok = dpaudit("check", write(tmp_path, "ok.yaml", PASSING + "noise_multiplier: 1.0\n"), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["minimal_sigma"] is None  # no calibration when sigma is given and passes
    asked = dpaudit("check", write(tmp_path, "cal.yaml", PASSING + "calibrate: true\n"), "--json")
    assert asked.returncode == 0 and json.loads(asked.stdout)["sigma_from_config"] is False
    over = dpaudit("check", write(tmp_path, "over.yaml", PASSING + "noise_multiplier: 0.3\n"), "--json")
    assert over.returncode == 1 and json.loads(over.stdout)["minimal_sigma"] > 0.3


def test_check_has_a_time_budget(tmp_path):
    cfg = write(tmp_path, "mc.yaml", PASSING.replace("steps: 1000", "steps: 75000") +
                "noise_multiplier: 1\naccountant: mc\n")
    out = dpaudit("check", cfg, "--timeout", "3", timeout=120)
    assert_one_line_error(out)
    assert "time budget" in out.stderr


def test_checkpoints_that_ship_code_are_refused(tmp_path, tiny_model_dir):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "tokenization_evil.py").write_text("raise SystemExit('evil code ran')\n")
    out = dpaudit("canaries", "make", "-t", model, "-o", tmp_path / "c.json", "-m", "4")
    assert_one_line_error(out)
    assert "auto_map" in out.stderr and out.stdout == ""


@pytest.fixture(scope="module")
def manifest(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("manifest") / "canaries.json"
    # membership is OS entropy: with 6 canaries the manifest had no member 1 time in 64 (the full run of 2026-11-27)
    out = dpaudit("canaries", "make", "-t", tiny_model_dir, "-o", path, "-m", "40", "--seed", "2")
    assert out.returncode == 0, out.stderr
    return path


def test_insert_copies_every_original_line_byte_for_byte(tmp_path, manifest):
    txt = tmp_path / "d.txt"
    txt.write_bytes("one\x0ctwo\nthree\x85four\nfive\n".encode())  # form feed and NEL inside lines
    out = dpaudit("canaries", "insert", "-c", manifest, "-d", txt, "-o", tmp_path / "o.txt", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["original_examples"] == 3
    lines = (tmp_path / "o.txt").read_bytes().decode().split("\n")
    assert {"one\x0ctwo", "three\x85four", "five"} <= set(lines)
    raw = ['{"text": "a\u2028b", "n": Infinity}', '{"text": "x", "text": "y"}', '{"text": "plain"}']
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(raw) + "\n", encoding="utf-8")
    out = dpaudit("canaries", "insert", "-c", manifest, "-d", jsonl, "-o", tmp_path / "o.jsonl")
    assert out.returncode == 0, out.stderr
    copied = (tmp_path / "o.jsonl").read_text(encoding="utf-8").split("\n")
    assert set(raw) <= set(copied)
    again = dpaudit("canaries", "insert", "-c", manifest, "-d", tmp_path / "o.jsonl", "-o", tmp_path / "o2.jsonl")
    assert again.returncode == 0, again.stderr  # dpaudit reads its own output


def test_insert_refuses_a_text_that_is_not_text(tmp_path, manifest):
    bad = write(tmp_path, "bad.jsonl", '{"text": null}\n')
    out = dpaudit("canaries", "insert", "-c", manifest, "-d", bad, "-o", tmp_path / "o.jsonl")
    assert_one_line_error(out)
    assert "not text" in out.stderr


def test_a_run_folder_has_one_writer_and_force_only_clears_dpaudits_own(tmp_path):
    from dpaudit.core.lock import folder_lock

    busy = tmp_path / "busy"
    with folder_lock(busy):
        out = dpaudit("audit", "run", "--out", busy, "--force", "--steps", "1")
    assert_one_line_error(out)
    assert "in use by another dpaudit run" in out.stderr and f"pid {os.getpid()}" in out.stderr
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "run").mkdir()
    (mine / "run" / "thesis.tex").write_text("years of work")
    out = dpaudit("audit", "run", "--out", mine, "--force", "--steps", "1")
    assert_one_line_error(out)
    assert "not made by dpaudit" in out.stderr
    assert (mine / "run" / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("args,message", [
    (["compare", "--sigma", "0"], "sigma must be"),
    (["plot", "--sigma", "0", "-o", "x.png"], "sigma must be"),
    (["compare", "--eps", "0"], "epsilon must be"),
    (["epsilon", "--sigma", "1e308", "--p", "0.1", "-T", "10"], "sigma must be"),
    (["calibrate", "--eps", "1e308", "--p", "0.01", "-T", "100", "--timeout", "10"], "met even with sigma=0.001"),
])
def test_accounting_edges_are_one_line(tmp_path, args, message):
    out = dpaudit(*[str(tmp_path / a) if a.endswith(".png") else a for a in args], timeout=120)
    assert_one_line_error(out)
    assert message in out.stderr


def test_max_steps_is_the_largest_t_within_budget():
    """The coarse PLD bracket (pessimistic above, optimistic below) must not move the answer."""
    from dpaudit.accounting import Mechanism, epsilon, max_steps

    answer = max_steps(Mechanism("gaussian", 1.0, 0.01, 1), 1.0, 1e-5)
    assert answer.result.epsilon <= 1.0 < answer.epsilon_next
    assert epsilon(Mechanism("gaussian", 1.0, 0.01, answer.steps + 1), 1e-5).epsilon > 1.0


def test_a_failed_folder_write_leaves_nothing_behind(tmp_path):
    from dpaudit.core.atomic import atomic_folder

    target = tmp_path / "model"
    with pytest.raises(OSError):
        with atomic_folder(target) as tmp:
            (tmp / "weights").write_bytes(b"half")
            raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []  # no half-written folder, no temporary left
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_bytes(b"whole")
    assert (target / "weights").read_bytes() == b"whole" and oct(target.stat().st_mode & 0o777) != "0o700"
