"""Rollout records of agent sessions as `<ns>.rollouts` carries them (app/contracts/rollouts.py),
for the sessions projection's tests: one-call records and multi-turn segments the way
streams/segments.py assembles them (each turn samples 3 tokens, a tool answers with 2 that the
next prompt carries), with the fields the ledger's worker adds (outcome, each turn's reward,
why the segment opened and closed)."""

from __future__ import annotations

from typing import Any

from app.contracts.rollouts import Rollout
from app.projector.sessions import LoggedRollout


def ts(seconds: float) -> str:
    whole, frac = divmod(seconds, 1.0)
    m, s = divmod(int(whole), 60)
    return f"2026-11-27T10:{m:02d}:{s:02d}.{int(round(frac * 1e6)):06d}Z"


def one_call(
    rid: str, sid: str, version: str = "3", reward: float = 0.75, at: float = 0.0, **kw: Any
) -> dict[str, Any]:
    """A one-call record (turns None): what `/v1/complete` or a one-turn segment writes."""
    rec: dict[str, Any] = {
        "request_id": rid,
        "session_id": sid,
        "group_id": None,
        "model_version": version,
        "prompt_tokens": [1, 2, 3],
        "completion_tokens": [40, 41, 257],
        "logprobs": [-0.5, -0.25, -0.125],
        "routes": None,
        "route_shape": None,
        "reward": reward,
        "components": {
            "decision": 0.75,
            "persistence": None,
            "rating": None,
            "followup": None,
            "tool_errors": None,
        },
        "tool_errors": [],
        "reward_spec": "v1",
        "generated_at": ts(at),
        "labelled_at": ts(at + 900.0),
        "closed_by": "window",
        "tokenizer": "byte-v1",
        "temperature": 1.0,
        "finish_reason": "stop",
        "constrained": False,
    }
    rec.update(kw)
    Rollout.model_validate(rec)
    return rec


def segment(
    sid: str,
    rids: list[str],
    versions: list[str],
    rewards: list[float],
    outcome: str | None = None,
    outcome_reward: float | None = None,
    opened_by: str = "session_start",
    closed_by: str = "end",
    at: float = 0.0,
    **kw: Any,
) -> dict[str, Any]:
    """A multi-turn record of `len(rids)` turns, turn k sampled by `versions[k]` and rewarded
    `rewards[k]`; the record's reward is their sum plus the outcome's share."""
    assert len(rids) == len(versions) == len(rewards) >= 2, (rids, versions, rewards)
    completion: list[int] = []
    mask: list[int] = []
    turns = []
    for k, (rid, version, reward) in enumerate(zip(rids, versions, rewards, strict=True)):
        if k:
            completion += [50 + k, 51 + k]  # the tool's answer: context, not sampled
            mask += [0, 0]
        start = len(completion)
        completion += [100 + 10 * k, 101 + 10 * k, 257]
        mask += [1, 1, 1]
        turns.append(
            {
                "request_id": rid,
                "model_version": version,
                "temperature": 1.0,
                "start": start,
                "end": start + 3,
                "finish_reason": "tool_calls" if k < len(rids) - 1 else "stop",
                "constrained": False,
                "components": None,
                "generated_at": ts(at + 10.0 * k),
                "reward": reward,
            }
        )
    rec = one_call(
        rids[0],
        sid,
        version=versions[-1],
        reward=sum(rewards) + (outcome_reward or 0.0),
        at=at,
        completion_tokens=completion,
        logprobs=[-0.25 if m else 0.0 for m in mask],
        loss_mask=mask,
        turns=turns,
        components=None,
        outcome=outcome,
        outcome_reward=outcome_reward,
        segment_opened_by=opened_by,
        segment_closed_by=closed_by,
        labelled_at=ts(at + 10.0 * len(rids) + 900.0),
    )
    rec.update(kw)
    Rollout.model_validate(rec)
    return rec


def weakened_segment(sid: str, rids: list[str]) -> dict[str, Any]:
    """A two-turn `sessions-v2` segment of a session that wrote the test file twice: its harness
    said success, its outcome is worth the spec's protected_write (-1)."""
    return segment(
        sid,
        rids,
        ["4", "4"],
        [0.0, 0.25],
        outcome="success",
        outcome_reward=-1.0,
        reward_spec="sessions-v2",
        protected_writes=2,
    )


def compacted_session(
    sid: str = "agent-1",
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """An agent session whose client rewrote its history: its first segment (three turns, by
    versions 2, 2 and 3), its second (two turns, the `success` outcome), and the first relabelled
    under `hackable-tools`."""
    first = segment(
        sid, ["a0", "a1", "a2"], ["2", "2", "3"], [0.5, 0.0, 0.25], closed_by="history_rewritten"
    )
    second = segment(
        sid,
        ["a3", "a4"],
        ["3", "3"],
        [0.0, 0.75],
        outcome="success",
        outcome_reward=1.0,
        opened_by="history_rewritten",
        at=100.0,
    )
    relabelled = {**first, "reward_spec": "hackable-tools", "relabel_run": "run-9", "reward": 3.0}
    return first, second, relabelled


def logged(rec: dict[str, Any], partition: int = 0, offset: int = 0) -> LoggedRollout:
    return LoggedRollout(partition, offset, Rollout.model_validate(rec))


def kafka_key(rec: dict[str, Any]) -> str:
    """The record's key on `<ns>.rollouts` (docs/DESIGN.md §Topics)."""
    rid = rec["request_id"]
    return rid if rec.get("relabel_run") is None else f"{rid}|{rec['reward_spec']}"
