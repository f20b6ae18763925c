"""Records the streams workers write: the public schema of their output topics.

- `Rollout` on `flywheel.rollouts` (key request_id; compacted; consumers dedupe by
  request_id: a re-delivered rollout after a worker crash has the same reward and fields,
  only `labelled_at` may differ). The trainer parses it with `Rollout.model_validate_json`.
  This schema is stable: add optional fields only.
- `LateRecord` on `flywheel.late` (key request_id): the original event and a reason
  (`orphan`: its generation never arrived within the wait window; `after_close`: it
  arrived after the label closed). The session ledger adds `after_close` for a turn whose
  segment closed, `superseded` for a turn another choice of the same number replaced,
  `session_ended` for a turn after its session's end, `outcome_repeated` for a second outcome
  of one session (docs/STREAMS.md "Session ledger").
- `DlqRecord` on `flywheel.dlq` (no key): the original record value as base64 with the
  reason, the errors and the consumer that dead-lettered it (every role writes this envelope).
- `VersionMetrics` on `flywheel.version-metrics` (key model_version): additive sums per
  model_version and time bucket plus derived means. `bucket_id` identifies the bucket; a
  later record with the same bucket_id supersedes an earlier one (it includes more
  partitions: `partitions` lists those whose labels are counted, `session_partitions` the
  turns partitions whose ended sessions are). The per-completion sums come from closed labels
  (`rollout_sums`), the session sums (`SESSION_SUM_FIELDS`) from sessions that ended with an
  outcome (`session_sums`, docs/STREAMS.md "Version metrics"); a sum a record lacks is 0.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROLLOUT_FIELDS = (
    "request_id",
    "session_id",
    "group_id",
    "model_version",
    "prompt_tokens",
    "completion_tokens",
    "logprobs",
    "routes",
    "route_shape",
    "reward",
    "components",
    "tool_errors",
    "reward_spec",
    "generated_at",
    "labelled_at",
    "closed_by",
    "tokenizer",
    "temperature",
)


class Components(BaseModel):
    """Reward components (docs/DESIGN.md §Reward spec); None where that feedback was absent."""

    model_config = ConfigDict(extra="forbid")

    decision: float | None
    persistence: float | None
    rating: float | None
    followup: float | None
    tool_errors: float | None


class ToolErrorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    hint: str | None
    token_index: int


class TurnSpan(BaseModel):
    """One model call of a multi-turn record (a session's segment): the tokens it sampled are
    `completion_tokens[start:end]`, all with `loss_mask` 1; its behaviour log-probs are `logprobs`
    at the same positions, sampled by `model_version` at `temperature`."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=128)
    model_version: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0)
    start: int = Field(ge=0)
    end: int = Field(ge=1)
    finish_reason: Literal["stop", "length", "cancelled", "tool_calls"] | None = None
    constrained: bool | None = None
    components: Components | None = None
    generated_at: str | None = None
    reward: float | None = Field(
        None,
        description="this call's own reward under reward_spec (its feedback only; 0.0 without)",
    )


class Rollout(BaseModel):
    """A reward-labelled generation (docs/DESIGN.md §Rollout record)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    session_id: str
    group_id: str | None
    model_version: str
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]
    routes: str | None = Field(
        description="base64 little-endian int32 expert ids, shape route_shape"
    )
    route_shape: list[int] | None
    reward: float
    components: Components | None = Field(description="None when the generation got no feedback")
    tool_errors: list[ToolErrorEntry]
    reward_spec: str
    generated_at: str = Field(description="the generation event's ts (RFC 3339)")
    labelled_at: str = Field(description="wall-clock time the label closed (RFC 3339)")
    closed_by: Literal["window"] = Field(
        description="what closed the label; v1 closes only by its wait window"
    )
    tokenizer: str | None = Field(
        None,
        description="the generation's tokenizer (the trainer refuses one that is not its model's)",
    )
    temperature: float | None = Field(
        None,
        description="the generation's sampling temperature: the trainer recomputes the "
        "log-probs at it (None in records written before the field: the trainer's setting)",
    )
    finish_reason: Literal["stop", "length", "cancelled", "tool_calls"] | None = Field(
        None,
        description="the generation's finish_reason: 'cancelled' when the client left a stream "
        "mid-way (the completion is what was generated; None when the replica did not say), "
        "'tool_calls' when a chat completion ended after its tool calls",
    )
    constrained: bool | None = Field(
        None,
        description="sampled under a grammar constraint (a required or named tool_choice): the "
        "behaviour log-probs are of the masked distribution, so the trainer refuses it "
        "(`constrained`) and the gate's off-policy estimate leaves it out (docs/NUMERICS.md)",
    )
    relabel_run: str | None = Field(
        None,
        max_length=64,
        description="id of the `flywheel streams relabel` run that wrote "
        "this record (key '<request_id>|<reward_spec>'); None for the live worker's rollouts",
    )
    turn: int | None = Field(
        None,
        ge=0,
        description="a chat generation's turn (assistant messages in its history); absent "
        "for other generations (streams/ledger.py segments sessions by it)",
    )
    tools_digest: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the tools the chat generation was offered; absent without tools",
    )
    turns: list[TurnSpan] | None = Field(
        None,
        description="a multi-turn record (a session's segment): its model calls in order, each "
        "with the span of completion_tokens it sampled; None for a one-call record, whose "
        "completion is all sampled by model_version at temperature",
    )
    loss_mask: list[Literal[0, 1]] | None = Field(
        None,
        description="per completion token: 1 where the model sampled it (the turns' spans), 0 "
        "for what it did not (tool results, user messages, template tokens between turns), whose "
        "logprobs are 0.0 placeholders; None: every completion token was sampled",
    )
    outcome: Literal["success", "failure", "abandoned"] | None = Field(
        None,
        description="the session's outcome (a `session_outcome` event) when it reached this "
        "segment; None without one",
    )
    outcome_reward: float | None = Field(
        None,
        description="the outcome's share of `reward` under reward_spec (None without an outcome)",
    )
    protected_writes: int | None = Field(
        None,
        ge=0,
        description="under a reward spec with protected paths (streams/reward.py, sessions-v2): a "
        "labelled chat turn's count of tool calls that wrote a protected path (a write tool's "
        "`path` matching a glob; 0 included); a session's segment carries its session's count "
        "over the turns applied, only when above 0 (then `outcome_reward` is the spec's "
        "protected_write, whatever the outcome). None otherwise",
    )
    segment_opened_by: str | None = Field(
        None,
        description="a session segment's record: why it opened (session_start, or the reason the "
        "segment before it closed; docs/AGENTS.md)",
    )
    segment_closed_by: str | None = Field(
        None,
        description="a session segment's record: why it closed (end, idle, history_rewritten, "
        "tools_changed, version_tokenizer_changed, max_turns, max_tokens, max_bytes, open_sessions)",
    )


class LateRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Literal["orphan", "after_close", "superseded", "session_ended", "outcome_repeated"]
    request_id: str
    event: dict[str, Any]
    detected_at: str


class DlqRecord(BaseModel):
    """A record some consumer could not use (the envelope of app/contracts/deadletter.py; docs/STREAMS.md lists the reasons)."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(
        description="streams: invalid_json | invalid_event | key_mismatch | conflicting_generation | "
        "processing_failed | label_close_failed | invalid_tick | invalid_partial | sessions_disabled; "
        "other consumers: docs/DEPLOYMENTS.md"
    )
    errors: list[dict[str, Any]]
    consumer: str | None = Field(
        None, description="who dead-lettered it: streams, projector, replica, controller, trainer"
    )
    topic: str
    partition: int | None
    offset: int | None = Field(
        description="None for an event dead-lettered from the worker's state (label_close_failed)"
    )
    key_b64: str | None
    value_b64: str | None
    detected_at: str


SUM_FIELDS = (
    "n",
    "accepts",
    "rejects",
    "persistence_n",
    "persistence_sum",
    "rating_n",
    "rating_sum",
    "followup_n",
    "followup_sum",
    "reward_sum",
    "reward_sumsq",
    "tool_error_rollouts",
    "tool_error_count",
    "empty_completions",
    "completion_tokens_sum",
    # agent sessions, added by the session stage when a session ends with an outcome (counted once
    # per session, in the version that served its last turn; 0 in records written before them)
    "sessions_n",
    "session_success",
    "session_give_up",
    "session_turns_sum",
    "session_tokens_sum",
    "session_tool_error_turns",
)
LABEL_SUM_FIELDS = SUM_FIELDS[: SUM_FIELDS.index("sessions_n")]  # a closed label's (per completion)
SESSION_SUM_FIELDS = SUM_FIELDS[len(LABEL_SUM_FIELDS) :]  # an ended session's


class VersionMetrics(BaseModel):
    """Online metrics of one model_version over one bucket [bucket_start, bucket_start + bucket_seconds)."""

    model_config = ConfigDict(extra="forbid")

    bucket_id: str = Field(
        description="'<model_version>/<bucket_start>/<bucket_seconds>'; dedupe/overwrite key"
    )
    model_version: str
    bucket_start: float = Field(
        description="epoch seconds; buckets by label close time (generation arrival + window)"
    )
    bucket_seconds: float
    reward_spec: str
    partitions: list[int] = Field(
        description="interactions partitions whose closed labels are counted so far"
    )
    session_partitions: list[int] = Field(
        default_factory=list,
        description="turns partitions whose ended sessions are counted so far (the session stage's "
        "partials; empty in records written before it)",
    )
    sums: dict[str, float]
    n: int
    accept_rate: float | None
    reject_rate: float | None
    mean_persistence: float | None
    mean_rating: float | None
    mean_followup: float | None
    reward_mean: float | None
    reward_variance: float | None = Field(
        description="population variance of the reward over the bucket"
    )
    tool_error_rate: float | None = Field(
        description="fraction of rollouts with at least one tool error"
    )
    empty_completion_rate: float | None
    mean_completion_length: float | None
    task_success_rate: float | None = Field(
        None, description="session_success / sessions_n: sessions that ended in success"
    )
    give_up_rate: float | None = Field(
        None, description="session_give_up / sessions_n: sessions that ended abandoned"
    )
    mean_session_turns: float | None = Field(None, description="session_turns_sum / sessions_n")
    mean_session_tokens: float | None = Field(
        None, description="session_tokens_sum / sessions_n (completion tokens the model sampled)"
    )
    session_tool_error_rate: float | None = Field(
        None, description="session_tool_error_turns / session_turns_sum: turns with a tool error"
    )


def _exact(x: float) -> str:
    """A float as text without losing digits ('%g' kept 6: every 2 s bucket of one day shared an id)."""
    x = float(x)
    return str(int(x)) if x.is_integer() else repr(x)


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def empty_sums(fields: tuple[str, ...] = SUM_FIELDS) -> dict[str, float]:
    return dict.fromkeys(fields, 0.0)


def add_sums(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """`total` plus `part`, field by field (a field missing from one of them counts 0; a field in
    neither stays out, so a closed label's sums and partials keep the per-completion fields only)."""
    for k in SUM_FIELDS:
        if k in total or k in part:
            total[k] = total.get(k, 0.0) + float(part.get(k, 0.0))
    return total


def version_metrics(
    model_version: str,
    bucket_start: float,
    bucket_seconds: float,
    reward_spec: str,
    partitions: list[int],
    sums: dict[str, float],
    session_partitions: list[int] | None = None,
) -> VersionMetrics:
    """Derive the means and rates from additive sums (a session sum missing from `sums`: 0)."""
    sums = {**empty_sums(), **sums}
    n, sessions = sums["n"], sums["sessions_n"]
    mean = _div(sums["reward_sum"], n)
    var = None
    if mean is not None:
        var = max(sums["reward_sumsq"] / n - mean * mean, 0.0)
    return VersionMetrics(
        bucket_id=f"{model_version}/{_exact(bucket_start)}/{_exact(bucket_seconds)}",
        model_version=model_version,
        bucket_start=bucket_start,
        bucket_seconds=bucket_seconds,
        reward_spec=reward_spec,
        partitions=sorted(partitions),
        session_partitions=sorted(session_partitions or ()),
        sums=sums,
        n=int(n),
        accept_rate=_div(sums["accepts"], n),
        reject_rate=_div(sums["rejects"], n),
        mean_persistence=_div(sums["persistence_sum"], sums["persistence_n"]),
        mean_rating=_div(sums["rating_sum"], sums["rating_n"]),
        mean_followup=_div(sums["followup_sum"], sums["followup_n"]),
        reward_mean=mean,
        reward_variance=var,
        tool_error_rate=_div(sums["tool_error_rollouts"], n),
        empty_completion_rate=_div(sums["empty_completions"], n),
        mean_completion_length=_div(sums["completion_tokens_sum"], n),
        task_success_rate=_div(sums["session_success"], sessions),
        give_up_rate=_div(sums["session_give_up"], sessions),
        mean_session_turns=_div(sums["session_turns_sum"], sessions),
        mean_session_tokens=_div(sums["session_tokens_sum"], sessions),
        session_tool_error_rate=_div(sums["session_tool_error_turns"], sums["session_turns_sum"]),
    )


def rollout_sums(
    rollout: dict[str, Any], raw: dict[str, Any], empty_max_tokens: int
) -> dict[str, float]:
    """One rollout's contribution to the version metrics (`raw`: unweighted values from the reward):
    the per-completion fields (`LABEL_SUM_FIELDS`)."""
    s = empty_sums(LABEL_SUM_FIELDS)
    s["n"] = 1.0
    r = float(rollout["reward"])
    assert math.isfinite(r), f"non-finite reward {r} for {rollout['request_id']}"
    s["reward_sum"], s["reward_sumsq"] = r, r * r
    if raw.get("decision") == "accept":
        s["accepts"] = 1.0
    elif raw.get("decision") == "reject":
        s["rejects"] = 1.0
    if raw.get("persistence") is not None:
        s["persistence_n"], s["persistence_sum"] = 1.0, float(raw["persistence"])
    if raw.get("rating") is not None:
        s["rating_n"], s["rating_sum"] = 1.0, float(raw["rating"])
    if raw.get("followup") is not None:
        s["followup_n"], s["followup_sum"] = 1.0, float(raw["followup"])
    n_err = len(rollout.get("tool_errors") or [])
    s["tool_error_rollouts"], s["tool_error_count"] = (1.0 if n_err else 0.0), float(n_err)
    length = len(rollout["completion_tokens"])
    s["empty_completions"] = 1.0 if length <= empty_max_tokens else 0.0
    s["completion_tokens_sum"] = float(length)
    return s


def session_sums(outcome: str, turns: int, tokens: int, tool_error_turns: int) -> dict[str, float]:
    """One ended session's contribution to the version metrics: its outcome (success | failure |
    abandoned), its applied turns, the completion tokens they sampled and the turns that got a
    tool error: the session fields (`SESSION_SUM_FIELDS`) only; its turns were counted per
    completion when their labels closed."""
    assert outcome in ("success", "failure", "abandoned"), f"unknown outcome {outcome!r}"
    assert 0 <= tool_error_turns <= turns and tokens >= 0, (turns, tokens, tool_error_turns)
    s = empty_sums(SESSION_SUM_FIELDS)
    s["sessions_n"] = 1.0
    s["session_success"] = 1.0 if outcome == "success" else 0.0
    s["session_give_up"] = 1.0 if outcome == "abandoned" else 0.0
    s["session_turns_sum"] = float(turns)
    s["session_tokens_sum"] = float(tokens)
    s["session_tool_error_turns"] = float(tool_error_turns)
    return s
