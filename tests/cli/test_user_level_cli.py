"""`--unit user` on the accounting commands and `unit: user` in a gated config: the answer is a user's, and the CI
gate judges a user-level claim as it judges an example-level one (exit 0 / 1 / 2)."""

import json

import pytest

from cli_helpers import assert_one_line_error, dpaudit

SCHEDULE = ("--p", "0.01", "-T", "1000", "--delta", "1e-6")


def test_epsilon_answers_a_users_epsilon_and_says_whose():
    out = dpaudit("epsilon", "-s", "1", *SCHEDULE, "--unit", "user", "--records-per-user", "4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert 9.5 < data["result"]["epsilon"] < 10.5 and data["result"]["unit"] == "user (ELS, k = 4)"
    assert data["unit"] == {"kind": "user", "records": 4, "sampling": "example"}
    assert any("privacy unit: one user" in line for line in data["assumptions"])
    example = json.loads(dpaudit("epsilon", "-s", "1", *SCHEDULE, "--json").stdout)["result"]["epsilon"]
    uls = json.loads(dpaudit("epsilon", "-s", "1", *SCHEDULE, "--unit", "user", "--records-per-user", "4",
                             "--user-sampling", "uls", "--json").stdout)["result"]
    assert uls["epsilon"] == example and uls["unit"] == "user (ULS, k = 4)"


def test_compare_shows_els_uls_and_group_privacy_for_a_schedule():
    out = dpaudit("compare", "-s", "1", *SCHEDULE, "--unit", "user", "--records-per-user", "4", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)["rows"]}
    assert set(rows) == {"ELS", "ULS", "group privacy"}
    eps = {name: r["result"]["epsilon"] for name, r in rows.items()}
    assert eps["ULS"] < eps["ELS"] < eps["group privacy"]
    text = dpaudit("compare", "-e", "8", *SCHEDULE, "--unit", "user", "--records-per-user", "4")
    assert text.returncode == 0 and "noise / signal" in text.stdout and "group privacy" in text.stdout


def test_calibrate_and_max_steps_take_the_unit():
    cal = json.loads(dpaudit("calibrate", "-e", "8", *SCHEDULE, "--unit", "user", "--records-per-user", "4",
                             "--json").stdout)
    plain = json.loads(dpaudit("calibrate", "-e", "8", *SCHEDULE, "--json").stdout)
    assert cal["sigma"] > plain["sigma"] and cal["epsilon"] <= 8 and cal["unit"]["records"] == 4
    steps = json.loads(dpaudit("max-steps", "-s", "1", "-e", "8", "--p", "0.01", "--delta", "1e-6", "--unit", "user",
                               "--records-per-user", "4", "--json").stdout)
    assert steps["max_steps"] < 1000 < json.loads(dpaudit("max-steps", "-s", "1", "-e", "8", "--p", "0.01", "--delta",
                                                          "1e-6", "--json").stdout)["max_steps"]


@pytest.mark.parametrize("args", [
    ("--records-per-user", "4"),
    ("--unit", "user"),
    ("--unit", "household", "--records-per-user", "4"),
    ("--unit", "user", "--records-per-user", "0"),
    ("--unit", "user", "--records-per-user", "4", "--user-sampling", "both"),
    ("--unit", "user", "--records-per-user", "4", "--sampling", "fixed", "-B", "10", "-N", "1000"),
])
def test_a_unit_the_command_cannot_account_is_refused_in_one_line(args):
    base = ("epsilon", "-s", "1", "-T", "100") + (() if "--sampling" in args else ("--p", "0.01"))
    assert_one_line_error(dpaudit(*base, *args))


def _config(tmp_path, **keys) -> str:
    path = tmp_path / "privacy.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in {"noise_multiplier": 1.0, "sampling_rate": 0.01,
                                                        "steps": 1000, "delta": 1e-6, **keys}.items()))
    return str(path)


def test_check_gates_a_user_level_claim_like_an_example_level_one(tmp_path):
    example = dpaudit("check", _config(tmp_path, target_epsilon=8))
    assert example.returncode == 0, example.stdout
    over = dpaudit("check", _config(tmp_path, target_epsilon=8, unit="user", records_per_user=4))
    assert over.returncode == 1 and "a user's" in over.stdout and "FAIL" in over.stdout
    fits = dpaudit("check", _config(tmp_path, target_epsilon=11, unit="user", records_per_user=4), "--json")
    data = json.loads(fits.stdout)
    assert fits.returncode == 0 and data["unit"]["records"] == 4 and 9.5 < data["epsilon"] < 11
    for bad in ({"unit": "user"}, {"records_per_user": 4}, {"unit": "user", "records_per_user": 4,
                                                            "user_sampling": "maybe"}):
        assert_one_line_error(dpaudit("check", _config(tmp_path, target_epsilon=8, **bad)))
