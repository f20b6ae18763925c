"""An agent session's whole round trip on the real parts (docs/AGENTS.md "Sessions"): chat turns
with tools from a replica through the official `openai` package, a tool result between them,
feedback on one turn and the session's outcome through `FeedbackClient` to the ingest API, and
the one rollout the real streams worker's session ledger writes for the session.

Real uvicorn servers for the replica and the API, the session's Kafka broker, and
`python -m streams.worker` as its own process; nothing is mocked. The replica serves tiny
version 7 (context 2,048) from its verified cache. The first two turns name their tool
(constrained decoding), so the calls are well-formed whatever the untrained model prefers; the
last turn answers freely."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from app.client import FeedbackClient
from app.contracts.rollouts import Rollout
from tests.integration.clients.servers import serve_api, serve_replica
from tests.integration.replica.conftest import read_topic
from tests.integration.replica.test_tool_calling import TOOLS
from tests.integration.streams.conftest import WorkerProc, streams_env

pytestmark = pytest.mark.integration

WINDOW_S = 8.0  # each turn's feedback is sent as soon as the turn is done, well inside it
CHOICES = [  # per turn: the first two call a tool, the last answers
    {"type": "function", "function": {"name": "read_file"}},
    {"type": "function", "function": {"name": "run_tests"}},
    "none",
]


def _agent(
    client: openai.OpenAI, model: str, session: str, rewrite: bool, seed: int, after_turn=None
) -> list[str]:
    """Three turns of a coding agent; returns the request ids. `rewrite`: before the last turn the
    client drops the first tool exchange from its history (as a context compactor would).
    `after_turn(turn, request_id)` runs as each turn is done (its feedback, as a client sends it)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Fix add in calc.py"},
    ]
    ids = []
    for turn, choice in enumerate(CHOICES):
        if rewrite and turn == 2:  # drop turn 0's message and its tool results (one per call)
            assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            messages = [*messages[:2], *messages[assistant[1] :]]
        answer = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=96,  # room for a whole call, so the tool results are real
            temperature=0.9,
            user=session,
            seed=seed + turn,
        )
        ids.append(answer.id)
        if after_turn is not None:
            after_turn(turn, answer.id)
        msg = answer.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            result = "def add(a, b):\n    return a - b" if turn == 0 else "1 failed"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ids


def _relabel(settings, session: str) -> dict[str, Any]:
    """`flywheel streams relabel`'s core over the interactions so far, under a stricter spec; the
    relabelled record of `session`'s last segment."""
    from datetime import UTC, datetime, timedelta

    from streams.config import StreamsConfig
    from streams.relabel import RelabelOptions, relabel
    from streams.reward import RewardSpec, RewardWeights

    weights = RewardWeights(
        rating=1.0,
        tool_error=-2.0,
        tool_error_floor=-4.0,
        outcome={"success": 2.5, "failure": -2.0, "abandoned": -3.0},
    )
    spec = RewardSpec(version="sessions-strict", weights=weights)
    since = datetime.now(UTC) - timedelta(hours=1)
    counts = relabel(
        settings.model_copy(update={"wait_window": WINDOW_S}),
        StreamsConfig(session_idle=120.0),
        RelabelOptions(spec, since=since),
    )
    assert counts.labelled >= 1, counts.as_dict()
    [got] = read_topic(
        settings,
        "rollouts",
        1,
        where=lambda v: v["session_id"] == session and v.get("relabel_run") is not None,
    )
    return got


def test_an_agent_session_becomes_one_trajectory_and_a_rewritten_history_two(
    make_settings, tmp_path
):
    settings = make_settings()
    worker = WorkerProc(
        streams_env(
            settings,
            FLYWHEEL_WAIT_WINDOW=str(WINDOW_S),
            FLYWHEEL_STREAMS_REWARD_SPEC="sessions-v1",
            FLYWHEEL_STREAMS_SESSION_IDLE="120s",
        ),
        tmp_path / "worker.log",
    )
    replica = serve_replica(settings, tmp_path, "replica-agent", max_context=2048)
    api, ingest_key = serve_api(settings, "agent")
    try:
        client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=2)
        with FeedbackClient(api.url, ingest_key, flush_interval_s=0) as fc:

            def feedback(turn: int, request_id: str) -> None:
                # the read_file call failed on the user's machine; the user rated the answer down
                if turn == 0:
                    fc.tool_error(request_id, "agent-1", message="FileNotFoundError", token_index=0)
                elif turn == 2:
                    fc.rating(request_id, "agent-1", value=-1, model_version="7")
                fc.flush()

            ids = _agent(
                client, settings.model_name, "agent-1", False, seed=100, after_turn=feedback
            )
            rewritten = _agent(client, settings.model_name, "agent-2", rewrite=True, seed=200)
            fc.session_outcome(ids[2], "agent-1", outcome="success")
            fc.session_outcome(rewritten[2], "agent-2", outcome="failure")
        # every record of both sessions (three: one, and two for the rewritten history): a
        # session's pieces go out in one batch, but on the partitions of their own keys, so its
        # end record may be read before the others
        got = read_topic(
            settings,
            "rollouts",
            3,
            timeout_s=180.0,
            where=lambda v: v["session_id"] in ("agent-1", "agent-2"),
        )
        generations = {
            g["request_id"]: g
            for g in read_topic(
                settings,
                "interactions",
                6,
                where=lambda v: v["type"] == "generation" and v["request_id"] in ids + rewritten,
            )
        }
    finally:
        api.stop()
        replica.stop()
        worker.kill()

    log = worker.tail()
    pieces = [(r["session_id"], r["segment_opened_by"], r["segment_closed_by"]) for r in got]
    assert len(pieces) == 3, (pieces, log)
    [one] = [r for r in got if r["session_id"] == "agent-1"]
    Rollout.model_validate(one)
    assert [t["request_id"] for t in one["turns"]] == ids, (one["turns"], log)
    assert (one["segment_opened_by"], one["segment_closed_by"]) == ("session_start", "end")
    # every turn's sampled tokens, in order, exactly where the mask is 1 (a final eos the
    # template leaves out of the next prompt leaves the trajectory); nothing else is masked in
    completion, mask = one["completion_tokens"], one["loss_mask"]
    sampled = []
    for span, rid in zip(one["turns"], ids, strict=True):
        tokens = generations[rid]["completion_tokens"]
        assert completion[span["start"] : span["end"]] == tokens[: span["end"] - span["start"]]
        assert span["end"] - span["start"] >= len(tokens) - 1
        sampled += list(range(span["start"], span["end"]))
    assert [i for i, m in enumerate(mask) if m] == sampled
    # the whole trajectory is the last turn's prompt and completion, token for token
    last = generations[ids[2]]
    assert one["prompt_tokens"] + completion == last["prompt_tokens"] + last["completion_tokens"]
    # feedback reached the turn it named; the outcome the whole record (sessions-v1: success +1)
    rewards = [t["reward"] for t in one["turns"]]
    assert rewards == [-0.5, 0.0, -0.5], rewards
    assert one["outcome"] == "success" and one["outcome_reward"] == 1.0
    assert one["reward"] == pytest.approx(sum(rewards) + 1.0)
    assert one["tool_errors"][0]["token_index"] == one["turns"][0]["start"]

    # the same interactions relabelled under another spec: the new rewards, exactly
    relabelled = _relabel(settings, "agent-1")
    assert [t["request_id"] for t in relabelled["turns"]] == ids
    assert relabelled["completion_tokens"] == completion and relabelled["loss_mask"] == mask
    rewards = [t["reward"] for t in relabelled["turns"]]  # tool error -2, rating 1.0 x -1
    assert rewards == [-2.0, 0.0, -1.0] and relabelled["outcome_reward"] == 2.5, relabelled
    assert relabelled["reward"] == -2.0 + 0.0 + -1.0 + 2.5
    assert relabelled["reward_spec"] == "sessions-strict" and relabelled["relabel_run"]

    two = sorted((r for r in got if r["session_id"] == "agent-2"), key=lambda r: r["generated_at"])
    assert [r["segment_closed_by"] for r in two] == ["history_rewritten", "end"], (two, log)
    assert two[1]["segment_opened_by"] == "history_rewritten"
    assert [t["request_id"] for t in two[0]["turns"]] == rewritten[:2]
    assert two[1]["request_id"] == rewritten[2] and "turns" not in two[1]
    assert {r["outcome"] for r in two} == {"failure"}  # both pieces share the session's outcome
