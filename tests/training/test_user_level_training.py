"""User-level training (ELS): the user column read, each user's records capped at k by a rule that reads neither the
texts nor other users, the run accounted per user, and the unit carried by the run record, the ledger and a resume."""

import json
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from cli_helpers import assert_one_line_error, dpaudit
from dpaudit.core.errors import DPAuditError
from dpaudit.core.users import cap_records, read_user_texts


@settings(max_examples=40, deadline=None)
@given(owners=st.lists(st.integers(0, 6), min_size=1, max_size=60), k=st.integers(1, 5), seed=st.integers(0, 9))
def test_the_cap_keeps_k_a_user_and_each_users_records_depend_on_that_user_alone(owners, k, seed):
    users = [f"u{o}" for o in owners]
    texts = [f"record {i}" for i in range(len(users))]
    capped = cap_records(texts, users, k, seed)
    assert max(Counter(capped.users).values()) <= k and capped.read == len(texts)
    assert [texts.index(t) for t in capped.texts] == sorted(texts.index(t) for t in capped.texts)  # file order
    # another user removed: this user's kept records are the same ones
    gone = users[0]
    rest = [(t, u) for t, u in zip(texts, users) if u != gone]
    other = cap_records([t for t, _ in rest], [u for _, u in rest], k, seed)
    assert sorted(t for t, u in zip(capped.texts, capped.users) if u != gone) == sorted(other.texts)
    # the texts are never read: other words, the same positions kept
    reworded = cap_records([f"another {i}" for i in range(len(users))], users, k, seed)
    assert [t.split()[-1] for t in reworded.texts] == [t.split()[-1] for t in capped.texts]


def _users_file(tmp_path, users: int, each: int, name="d.jsonl", field="user"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": f"Member {u} wrote note {j} about maps in Oslo.", field: f"id{u}"})
                            + "\n" for u in range(users) for j in range(each)))
    return path


def test_a_user_level_run_is_accounted_per_user_and_says_so(tiny_model_dir, tmp_path):
    from dpaudit.accounting.mechanism import Mechanism
    from dpaudit.accounting.registry import epsilon
    from dpaudit.accounting.unit import Unit
    from dpaudit.core import run_record

    data = _users_file(tmp_path, 12, 5)  # 60 records, 5 a user: capped at 3 -> 36
    args = ("train", "--model", tiny_model_dir, "-d", data, "--sigma", "1.5", "-B", "6", "-T", "4", "--threads", "1",
            "--unit", "user", "--records-per-user", "3", "--json")
    out = dpaudit(*args, "-o", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    ledger = run_record.read_ledger(tmp_path / "run")
    assert ledger.value("privacy_unit") == "user (ELS, k = 3)" and ledger.value("examples") == 36
    expected = epsilon(Mechanism("gaussian", 1.5, 6 / 36, 4, unit=Unit("user", 3)), 1e-5).epsilon
    assert result["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert result["epsilon"] > epsilon(Mechanism("gaussian", 1.5, 6 / 36, 4), 1e-5).epsilon
    settings_ = run_record.read(tmp_path / "run").settings
    assert (settings_.unit, settings_.records_per_user) == ("user", 3)
    # a resume keeps the unit: another k is a different plan
    again = dpaudit("train", "--model", tiny_model_dir, "-d", data, "-o", tmp_path / "run", "--resume", "-T", "6",
                    "--unit", "user", "--records-per-user", "4", "--threads", "1")
    assert again.returncode == 2 and "records_per_user" in again.stderr


@pytest.mark.parametrize("case", ["no user column", "plain text", "no k", "example run with k"])
def test_a_user_level_run_the_data_or_flags_cannot_make_is_refused_in_one_line(tiny_model_dir, tmp_path, case):
    data = _users_file(tmp_path, 6, 3, field="owner" if case == "no user column" else "user")
    if case == "plain text":
        data = tmp_path / "d.txt"
        data.write_text("".join(f"note {i}\n" for i in range(20)))
    flags = {"no user column": ("--unit", "user", "--records-per-user", "2"),
             "plain text": ("--unit", "user", "--records-per-user", "2"),
             "no k": ("--unit", "user"),
             "example run with k": ("--records-per-user", "2")}[case]
    out = dpaudit("train", "--model", tiny_model_dir, "-d", data, "-o", tmp_path / "run", "--sigma", "1", "-B", "4",
                  "-T", "2", "--threads", "1", *flags)
    assert_one_line_error(out)
    assert not (tmp_path / "run" / "privacy_ledger.json").exists()


def test_a_record_without_its_owner_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "user": "x"}\n{"text": "b"}\n')
    with pytest.raises(DPAuditError, match="no user id"):
        read_user_texts(path, "jsonl", "text", "user")
    csv = tmp_path / "d.csv"
    csv.write_text("text,user\na,1\nb,2\n")
    assert read_user_texts(csv, "csv", "text", "user") == (["a", "b"], ["1", "2"])
