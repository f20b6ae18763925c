"""Rollout record validation, the dedupe set, the atomic trainer state file and the config.

Run: .venv/bin/pytest tests/unit/trainer/test_intake_state.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from app.contracts.events import encode_routes
from trainer.checkpoint import load_state, save_state, state_path
from trainer.config import TrainerConfig
from trainer.rollouts import DedupeSet, parse_rollout


def record(**overrides) -> dict:
    r = {
        "request_id": "r1",
        "session_id": "s1",
        "group_id": None,
        "model_version": "3",
        "prompt_tokens": [1, 2],
        "completion_tokens": [3, 4, 5],
        "logprobs": [-0.1, -0.2, -0.3],
        "routes": None,
        "route_shape": None,
        "reward": 0.75,
        "components": {
            "decision": 0.75,
            "persistence": None,
            "rating": None,
            "followup": None,
            "tool_errors": None,
        },
        "tool_errors": [],
        "reward_spec": "v1",
        "generated_at": "2026-01-01T00:00:00Z",
        "labelled_at": "2026-01-01T00:15:00Z",
        "closed_by": "window",
    }
    r.update(overrides)
    return r


def test_valid_rollout_record_parses_with_routes_and_tool_errors():
    b64, shape = encode_routes([[[1, 2]], [[0, 3]], [[2, 2]]])
    rec = record(
        routes=b64,
        route_shape=list(shape),
        model_version="7",
        tool_errors=[{"message": "SyntaxError", "hint": "close (", "token_index": 1}],
    )
    r, refusal = parse_rollout(json.dumps(rec).encode())
    assert refusal is None and r is not None
    assert r.model_version == "7" and r.version_number() == 7
    assert r.routes_array().tolist() == [[[1, 2]], [[0, 3]], [[2, 2]]]
    assert r.tool_errors[0].token_index == 1


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"logprobs": [-0.1, -0.2]}, "logprobs has 2 values"),
        ({"completion_tokens": []}, "completion_tokens"),
        ({"route_shape": [3, 1, 2]}, "routes and route_shape"),
        ({"request_id": ""}, "request_id"),
        ({"closed_by": "decision"}, "closed_by"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_invalid_rollout_records_are_rejected_with_a_reason(overrides, field):
    r, refusal = parse_rollout(json.dumps(record(**overrides)).encode())
    assert r is None and refusal.reason == "invalid_rollout" and field in refusal.message, refusal


@pytest.mark.parametrize(
    "value", [b"\xff not json", b"", None, b"[1, 2]", b"null", b"{" * 100_000, b'{"a": 1']
)
def test_undecodable_bytes_are_invalid_json_not_an_exception(value):
    r, refusal = parse_rollout(value)
    assert r is None and refusal.reason == "invalid_json" and refusal.message


def test_dedupe_set_keeps_the_newest_ids_up_to_capacity():
    d = DedupeSet(3)
    for i in range(5):
        d.add(f"r{i}")
    assert "r0" not in d and "r1" not in d and all(f"r{i}" in d for i in (2, 3, 4))
    assert DedupeSet(3, d.to_list()).to_list() == ["r2", "r3", "r4"]


def test_state_round_trips_and_leaves_no_temp_files(tmp_path):
    state = {
        "model": {"w": torch.arange(4, dtype=torch.float32)},
        "step": 5,
        "positions": {0: 12, 2: 3},
        "seen": ["a", "b"],
        "intent": None,
        "pending": {"skipped": {"duplicate": 1}},
    }
    save_state(tmp_path, state)
    save_state(tmp_path, dict(state, step=6))
    loaded = load_state(tmp_path)
    assert (
        loaded["step"] == 6
        and loaded["positions"] == {0: 12, 2: 3}
        and loaded["seen"] == ["a", "b"]
    )
    assert torch.equal(loaded["model"]["w"], torch.arange(4, dtype=torch.float32))
    assert [p.name for p in tmp_path.iterdir()] == [state_path(tmp_path).name]


def test_an_interrupted_write_leaves_the_previous_state_readable(tmp_path):
    save_state(tmp_path, {"step": 1})
    stray = tmp_path / ".trainer_state.pt.999.tmp"
    stray.write_bytes(b"half a checkpoint")  # what a kill during torch.save leaves behind
    assert load_state(tmp_path)["step"] == 1
    assert not stray.exists()
    assert load_state(tmp_path / "nothing-here") is None


def test_config_reads_env_prefix_and_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TRAINER_LR", "3e-4")
    monkeypatch.setenv("FLYWHEEL_TRAINER_POLICY", '{"d_model": 32}')
    cfg = TrainerConfig()
    assert (
        cfg.lr == 3e-4
        and cfg.policy == {"d_model": 32}
        and cfg.trunc_c == 2.0
        and cfg.max_staleness == 4
    )
    assert (cfg.seq_mask_low, cfg.seq_mask_high) == (0.5, 2.0)
    with pytest.raises(ValidationError, match="must contain 1.0"):
        TrainerConfig(seq_mask_low=1.5)
    with pytest.raises(ValidationError, match="PAUSE_AT"):
        TrainerConfig(pause_at="somewhere")
    with pytest.raises(ValidationError, match="PRETRAIN_MID_TARGET set below it"):
        TrainerConfig(pretrain_mid_peak=0.7)  # scaled back to what?
    with pytest.raises(ValidationError, match="PRETRAIN_MID_TARGET set below it"):
        TrainerConfig(pretrain_mid_peak=0.4, pretrain_mid_target=0.5)
    assert TrainerConfig(pretrain_mid_peak=0.7, pretrain_mid_target=0.4).pretrain_mid_peak == 0.7
    monkeypatch.setenv("FLYWHEEL_TRAINER_POLICY", "{not json")
    with pytest.raises(ValidationError, match="JSON object"):
        TrainerConfig()
