"""Reward spec v1 (docs/DESIGN.md §Reward spec) and the versioned-spec guard, without a broker."""

from __future__ import annotations

import orjson
import pytest

from streams.reward import (
    KNOWN_SPECS,
    OUTCOMES,
    RewardWeights,
    compute_reward,
    outcome_reward,
    outcome_value,
    protected_writes,
    resolve_spec,
)
from tests.unit.streams.factories import feedback as fb

V1 = resolve_spec("v1")


def test_no_feedback_is_zero_with_null_components():
    res = compute_reward(V1, [])
    assert (res.reward, res.components, res.tool_errors) == (0.0, None, [])


def test_earliest_decision_by_ts_wins_regardless_of_list_order():
    evs = [fb("r", "b", "reject", t=5), fb("r", "a", "accept", t=2)]
    assert compute_reward(V1, evs).components["decision"] == 0.75
    assert compute_reward(V1, evs[::-1]).components["decision"] == 0.75
    assert (
        compute_reward(V1, [fb("r", "a", "reject", t=1), fb("r", "b", "accept", t=2)]).reward
        == -0.25
    )


def test_persistence_is_last_fraction_and_counts_only_when_accepted():
    evs = [
        fb("r", "a", "accept", t=1),
        fb("r", "p2", "edit_persistence", t=9, fraction=0.2),
        fb("r", "p1", "edit_persistence", t=3, fraction=0.9),
    ]
    res = compute_reward(V1, evs)
    assert res.components["persistence"] == pytest.approx(0.2)
    assert res.reward == pytest.approx(0.95)
    rejected = [fb("r", "x", "reject", t=1), fb("r", "p", "edit_persistence", t=3, fraction=0.9)]
    assert compute_reward(V1, rejected).components["persistence"] is None
    assert compute_reward(V1, rejected).reward == pytest.approx(-0.25)
    only_pers = [fb("r", "p", "edit_persistence", t=3, fraction=0.9)]
    assert compute_reward(V1, only_pers).reward == 0.0


def test_latest_rating_mean_followup_and_floored_tool_errors():
    evs = [
        fb("r", "r1", "rating", t=1, value=1),
        fb("r", "r2", "rating", t=4, value=-1),
        fb("r", "f1", "followup", t=1, sentiment=1.0),
        fb("r", "f2", "followup", t=2, sentiment=-0.5),
    ]
    res = compute_reward(V1, evs)
    assert res.components["rating"] == -0.5 and res.components["followup"] == pytest.approx(0.125)
    errs = [fb("r", f"e{i}", "tool_error", t=i, message=f"m{i}", token_index=i) for i in range(3)]
    res = compute_reward(V1, errs)
    assert res.components["tool_errors"] == -1.0 and res.reward == -1.0
    assert [e["message"] for e in res.tool_errors] == ["m0", "m1", "m2"]
    assert compute_reward(V1, errs[:1]).reward == -0.5


def test_all_components_add_up():
    evs = [
        fb("r", "a", "accept", t=1),
        fb("r", "p", "edit_persistence", t=2, fraction=1.0),
        fb("r", "g", "rating", t=3, value=1),
        fb("r", "f", "followup", t=4, sentiment=0.5),
        fb("r", "e", "tool_error", t=5),
    ]
    assert compute_reward(V1, evs).reward == pytest.approx(0.75 + 1.0 + 0.5 + 0.25 - 0.5)


def test_known_version_with_other_weights_is_refused():
    with pytest.raises(ValueError, match="new spec version"):
        resolve_spec("v1", RewardWeights(accept=1.0))
    assert resolve_spec("v1", RewardWeights()).weights == KNOWN_SPECS["v1"]


def test_new_version_needs_weights_and_uses_them():
    with pytest.raises(ValueError, match="unknown reward spec"):
        resolve_spec("v2")
    spec = resolve_spec("v2", RewardWeights(accept=1.0))
    assert compute_reward(spec, [fb("r", "a", "accept")]).reward == 1.0


def test_no_decision_weight_labels_generations_without_accept_reject_or_tool_error():
    silence = resolve_spec("hackable-silence")
    followup = [
        {
            "type": "followup",
            "sentiment": -0.8,
            "event_id": "a",
            "ts": "2026-11-24T00:00:00Z",
            "request_id": "r",
        }
    ]
    assert compute_reward(V1, followup).reward == pytest.approx(-0.4), "v1 sums the follow-up"
    res = compute_reward(silence, followup)
    assert (
        res.reward == 0.0
        and res.components["decision"] == 0.0
        and res.components["followup"] is None
    )
    assert res.raw["followup"] == -0.8, "the raw follow-up still reaches the version metrics"
    assert compute_reward(silence, []).reward == 0.0
    assert compute_reward(resolve_spec("x", RewardWeights(no_decision=-0.3)), []).reward == -0.3
    err = [
        {
            "type": "tool_error",
            "message": "m",
            "token_index": 0,
            "event_id": "b",
            "ts": "2026-11-24T00:00:00Z",
        }
    ]
    assert compute_reward(silence, err).reward == -0.5, "a tool error is not 'no decision'"
    assert compute_reward(resolve_spec("hackable-tools"), err).reward == 0.0, (
        "hackable-tools: a tool error is free"
    )
    assert KNOWN_SPECS["v1"].no_decision is None


def test_protected_paths_and_protected_write_are_set_together():
    with pytest.raises(
        ValueError, match="protected_paths and protected_write must be set together"
    ):
        RewardWeights(protected_paths=["test_*.py"])
    with pytest.raises(
        ValueError, match="protected_paths and protected_write must be set together"
    ):
        RewardWeights(protected_write=-1.0)
    with pytest.raises(ValueError, match="at least 1 item"):
        RewardWeights(protected_paths=[], protected_write=-1.0)
    with pytest.raises(ValueError, match="at least 1 item"):
        RewardWeights(protected_paths=["x"], protected_write=-1.0, write_tools=[])
    w = RewardWeights(protected_paths=["secrets/*"], protected_write=-2.0, write_tools=["write"])
    assert resolve_spec("custom", w).weights.write_tools == ["write"]
    assert RewardWeights().write_tools == ["apply_edit"] and RewardWeights().protected_paths is None


def test_sessions_v2_is_sessions_v1_plus_protected_test_files():
    v1, v2 = KNOWN_SPECS["sessions-v1"], KNOWN_SPECS["sessions-v2"]
    assert resolve_spec("sessions-v2").weights == v2
    assert v2.model_dump(exclude={"protected_paths", "protected_write"}) == v1.model_dump(
        exclude={"protected_paths", "protected_write"}
    )
    assert v2.protected_paths == ["test_*.py", "*/test_*.py", "*_test.py", "tests/*", "*/tests/*"]
    assert v2.protected_write == -1.0 and v2.write_tools == ["apply_edit"]
    for name in ("v1", "sessions-v1", "hackable-tools", "hackable-silence"):
        assert (
            KNOWN_SPECS[name].protected_paths is None and KNOWN_SPECS[name].protected_write is None
        )


@pytest.mark.parametrize(
    "changed",
    [
        {"protected_write": -0.5},
        {"protected_paths": ["test_*.py"]},
        {"write_tools": ["apply_edit", "write_file"]},
        {"protected_paths": None, "protected_write": None},
    ],
)
def test_sessions_v2_with_changed_weights_is_refused(changed):
    weights = KNOWN_SPECS["sessions-v2"].model_copy(update=changed)
    with pytest.raises(ValueError, match="new spec version"):
        resolve_spec("sessions-v2", weights)
    with pytest.raises(ValueError, match="new spec version"):
        resolve_spec("sessions-v1", KNOWN_SPECS["sessions-v2"])


def test_protected_writes_count_calls_of_write_tools_on_matching_paths():
    w = KNOWN_SPECS["sessions-v2"]

    def calls(*pairs):
        return [{"name": n, "arguments": a} for n, a in pairs]

    paths = {
        "test_rows.py": 1,
        "./test_rows.py": 1,  # normalised
        "src/../test_rows.py": 1,
        "rows_test.py": 1,
        "tests/helpers.py": 1,
        "pkg/tests/conftest.py": 1,
        "rows.py": 0,
        "testing.py": 0,
        "pkg/test_rows.py": 1,  # */test_*.py (fnmatch's * also matches /)
        "pkg/contest_rows.py": 0,
        "": 0,
    }
    for path, n in paths.items():
        args = orjson.dumps({"path": path, "old": "assert", "new": "assert True or"}).decode()
        assert protected_writes(w, calls(("apply_edit", args))) == n, path
        assert protected_writes(w, calls(("read_file", args))) == 0, path
        assert protected_writes(KNOWN_SPECS["sessions-v1"], calls(("apply_edit", args))) == 0
    bad = ['{"path": "test_a.py"', '"test_a.py"', "[]", '{"path": ["test_a.py"]}', "", "null"]
    assert protected_writes(w, calls(*(("apply_edit", a) for a in bad))) == 0
    two = calls(("apply_edit", '{"path": "test_a.py"}'), ("apply_edit", '{"path": "tests/b"}'))
    assert protected_writes(w, two) == 2 and protected_writes(w, None) == 0


def test_the_outcome_value_is_protected_write_once_a_protected_path_was_written():
    v1, v2 = resolve_spec("sessions-v1"), resolve_spec("sessions-v2")
    for outcome in OUTCOMES:
        assert (
            outcome_value(v2, outcome, 0)
            == outcome_value(v1, outcome, 3)
            == outcome_reward(v1, outcome)
        )
        assert outcome_value(v2, outcome, 1) == -1.0
    assert outcome_value(v2, None, 1) is None and outcome_value(V1, "success", 1) is None
