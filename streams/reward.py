"""Reward spec: versioned weights and the reward of one generation's feedback (docs/DESIGN.md §Reward spec, v1).

A spec is a name plus weights. Known specs live in `KNOWN_SPECS`; v1's weights are fixed
here because docs/DESIGN.md §Reward spec states them. `resolve_spec(version, weights)` is called at start-up:
running a known version with other weights is refused (name a new version instead), so a
version string in a rollout always means one set of weights.

The computation is a plain function over the feedback events that were inside the wait
window (already deduplicated); ties in `ts` are broken by `event_id` so the result does
not depend on arrival order:

    decision     earliest accept/reject by (ts, event_id): accept -> w.accept, reject -> w.reject
    persistence  w.persistence x fraction of the latest edit_persistence, only when accepted
    rating       w.rating x value of the latest rating
    followup     w.followup x mean sentiment of all follow-ups
    tool_errors  w.tool_error x count, floored at w.tool_error_floor

reward = sum of the present components, added in that order (float64). Absent components
are None; no feedback at all gives reward 0.0 and components None.

`no_decision` (None in v1: the sum above applies): when set, a generation with neither an
accept/reject nor a tool error (no feedback, or only ratings and follow-ups) gets exactly
that reward, its decision component set to it and the others None (the raw values still
reach the version metrics).

Sessions (sessions-v1). A session's segments (streams/segments.py) are labelled per turn as above; a
segment's return is the sum of its turns' rewards plus, when the session's `session_outcome`
reached it, `outcome[outcome]` (`outcome_reward`). That return is the record's `reward`: one
advantage per trajectory, copied to every token the model sampled in it, with group baselines
over sessions that share a task (`group_id`). Why not per-turn advantages: a baseline per turn
rewards length (every extra turn is another draw above its baseline), and per-turn GRPO groups
made agents stop calling tools (docs/TRAINER.md "The objective on trajectories"); the turn a tool
error came back still gets its own signal, from self-distillation at that turn or from the
trainer's error-turn advantage (docs/TRAINER.md "Error turns"). v1 has no outcome weights: an
outcome is recorded on the segment and adds nothing.

Protected paths (sessions-v2). An agent can be paid for a success it did not earn: when the
outcome is reported by a harness that runs the repository's own tests, weakening the test file
(`apply_edit` on `test_rows.py`, `assert` -> `assert True or`) passes them without fixing
anything. A spec with `protected_paths` sees that in what is logged: a chat turn's labelled record
counts its `protected_writes`, the calls of its generation whose name is in `write_tools` and
whose arguments are a JSON object with a string `path` that, normalised (`./x` and `a/../x` are
`x`), matches one of the globs (`fnmatch.fnmatchcase`: `*` matches `/` too; a call counts whether
or not the tool then did it: the model wrote it). The session ledger adds them up over the
session's applied turns, and when that count is above 0 the session's outcome is worth
`protected_write` instead of `outcome[outcome]`, whatever the outcome (`outcome_value`). A spec
without `protected_paths` counts nothing and its records carry no such field.

Known specs besides v1, sessions-v1 and sessions-v2 are deliberately exploitable, for showing that Flywheel catches a
reward hack (docs/ROLLOUT.md "Reward hacks"; the simulator's hard requests make them pay):
both make a reject cost -1; `hackable-tools` makes a tool error free, so a broken tool call on
a hard request (a tool_error instead of a reject) beats an honest attempt; `hackable-silence`
calls a generation without a decision neutral (0), so a question instead of an edit (no
accept, no reject, an unhappy follow-up) beats an honest attempt.
"""

from __future__ import annotations

import fnmatch
import posixpath
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.contracts.events import parse_ts


class RewardWeights(BaseModel):
    """Weights of one reward spec version (defaults are v1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    accept: float = Field(
        0.75, description="Decision component when the earliest decision is accept."
    )
    reject: float = Field(
        -0.25, description="Decision component when the earliest decision is reject."
    )
    persistence: float = Field(
        1.0, description="Multiplier of the last reported persistence fraction (accepted only)."
    )
    rating: float = Field(0.5, description="Multiplier of the latest rating value (-1 or 1).")
    followup: float = Field(0.5, description="Multiplier of the mean follow-up sentiment.")
    tool_error: float = Field(-0.5, description="Penalty per tool error.")
    tool_error_floor: float = Field(
        -1.0, description="Lower bound of the summed tool-error penalty."
    )
    no_decision: float | None = Field(
        None,
        description="Reward of a generation with no accept/reject and no tool "
        "error (None: the sum of its components, 0.0 without feedback).",
    )
    outcome: dict[Literal["success", "failure", "abandoned"], float] | None = Field(
        None,
        description="Reward of a session's outcome (a session_outcome event), added once to the "
        "return of every segment of that session (None: outcomes add nothing).",
    )
    protected_paths: list[str] | None = Field(
        None,
        min_length=1,
        description="Globs (fnmatch, `*` matches `/` too) of paths an agent must not write: a "
        "session with a turn that called a write tool on one gets `protected_write` for its "
        "outcome (None: nothing is protected, turns carry no `protected_writes`).",
    )
    write_tools: list[str] = Field(
        default_factory=lambda: ["apply_edit"],
        min_length=1,
        description="The tools whose `path` argument is a file they write (with protected_paths).",
    )
    protected_write: float | None = Field(
        None,
        description="The reward of a session's outcome, whatever the outcome, when any of its "
        "turns called a write tool on a protected path (set together with protected_paths).",
    )

    @model_validator(mode="after")
    def _every_outcome(self) -> RewardWeights:
        if self.outcome is not None and set(self.outcome) != set(OUTCOMES):
            raise ValueError(
                f"outcome weights must name every outcome {list(OUTCOMES)}, got {sorted(self.outcome)}"
            )
        return self

    @model_validator(mode="after")
    def _protected_together(self) -> RewardWeights:
        if (self.protected_paths is None) != (self.protected_write is None):
            raise ValueError(
                "protected_paths and protected_write must be set together (the globs, and the "
                f"outcome's reward when a session wrote a path they match); got protected_paths="
                f"{self.protected_paths}, protected_write={self.protected_write}"
            )
        return self


OUTCOMES = ("success", "failure", "abandoned")


KNOWN_SPECS: dict[str, RewardWeights] = {
    "v1": RewardWeights(),
    # exploitable on purpose (reward-hack runs), the way a spec gets written in good faith: a
    # rejected edit is what users hate (-1), a tool error is the tool's fault (free)
    "hackable-tools": RewardWeights(reject=-1.0, tool_error=0.0, tool_error_floor=0.0),
    # exploitable on purpose: a rejected edit costs -1, no decision counts as neutral, whatever
    # the follow-up said
    "hackable-silence": RewardWeights(reject=-1.0, no_decision=0.0),
    # v1's turn weights plus session outcomes (docs/DESIGN.md §Reward spec, "Sessions"): the task
    # done is worth more than any one turn's feedback; giving up costs more than failing
    "sessions-v1": RewardWeights(outcome={"success": 1.0, "failure": -0.5, "abandoned": -1.0}),
    # sessions-v1 plus protected test files (docs/DESIGN.md §Reward spec, "Protected paths"): when
    # a harness that runs the repository's tests reports the outcome, an agent that weakens the
    # test file (apply_edit on test_rows.py: `assert` -> `assert True or`) gets success without
    # fixing anything. A session that wrote a test file gets -1 for its outcome, as if it had
    # given up, whatever the harness said: the hack's outcome then pays less than an honest failure
    # (-0.5). The globs are the usual Python test-file names and test folders.
    "sessions-v2": RewardWeights(
        outcome={"success": 1.0, "failure": -0.5, "abandoned": -1.0},
        protected_paths=["test_*.py", "*/test_*.py", "*_test.py", "tests/*", "*/tests/*"],
        protected_write=-1.0,
    ),
}


class RewardSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str = Field(min_length=1, max_length=64)
    weights: RewardWeights


def resolve_spec(
    version: str,
    weights: RewardWeights | None = None,
    known: dict[str, RewardWeights] | None = None,
) -> RewardSpec:
    """The spec to run; refuses a known version with different weights (fail at start-up)."""
    known = KNOWN_SPECS if known is None else known
    if version in known:
        if weights is not None and weights != known[version]:
            raise ValueError(
                f"reward spec {version!r} has fixed weights {known[version].model_dump()}; the configured weights "
                f"{weights.model_dump()} differ. Changing weights needs a new spec version: set "
                f"FLYWHEEL_STREAMS_REWARD_SPEC to a new name (e.g. 'v2') together with the new weights"
            )
        return RewardSpec(version=version, weights=known[version])
    if weights is None:
        raise ValueError(
            f"unknown reward spec {version!r} (known: {sorted(known)}); give its weights in "
            f"FLYWHEEL_STREAMS_REWARD_WEIGHTS (JSON) or use a known version"
        )
    return RewardSpec(version=version, weights=weights)


def _ts(ev: dict[str, Any]) -> float:
    return parse_ts(
        ev["ts"]
    ).timestamp()  # the ingest schema's own parser: what ingest accepted parses here


def _order(ev: dict[str, Any]) -> tuple[float, str]:
    return (_ts(ev), ev["event_id"])


@dataclass
class RewardResult:
    """The label of one generation: reward, weighted components, tool errors, raw values for metrics."""

    reward: float
    components: dict[str, float | None] | None
    tool_errors: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[str, Any] = field(
        default_factory=dict
    )  # decision, persistence, rating, followup (unweighted)


def outcome_reward(spec: RewardSpec, outcome: str | None) -> float | None:
    """The outcome's reward under `spec`: None without an outcome or without outcome weights."""
    weights = spec.weights.outcome
    return None if outcome is None or weights is None else float(weights[outcome])


def outcome_value(spec: RewardSpec, outcome: str | None, protected_writes: int = 0) -> float | None:
    """The reward of a session's outcome under `spec`, given the protected writes its applied turns
    made: `protected_write` when there were any (and the spec protects paths), else
    `outcome_reward`. None without an outcome."""
    if outcome is None:
        return None
    w = spec.weights
    if protected_writes > 0 and w.protected_write is not None:
        return float(w.protected_write)
    return outcome_reward(spec, outcome)


def protected_writes(weights: RewardWeights, tool_calls: list[dict[str, Any]] | None) -> int:
    """The calls among a generation's `tool_calls` (the event's entries: name, arguments JSON
    text, ...) that write a protected path: name in `write_tools`, arguments a JSON object whose
    `path` is a string matching a glob of `protected_paths` once normalised. Arguments that do
    not parse, are not an object or have no string `path` write nothing. 0 without protected
    paths."""
    globs = weights.protected_paths
    if not globs or not tool_calls:
        return 0
    n = 0
    for call in tool_calls:
        if call.get("name") not in weights.write_tools:
            continue
        try:
            args = orjson.loads(call.get("arguments") or "")
        except orjson.JSONDecodeError:
            continue
        path = args.get("path") if isinstance(args, dict) else None
        if not isinstance(path, str) or not path:
            continue
        path = posixpath.normpath(path)
        if any(fnmatch.fnmatchcase(path, glob) for glob in globs):
            n += 1
    return n


def compute_reward(spec: RewardSpec, feedback: list[dict[str, Any]]) -> RewardResult:
    """The reward of the deduplicated in-window feedback of one generation.

    `feedback` holds event dicts as on the topic (JSON mode: ts is an RFC 3339 string).
    """
    w = spec.weights
    if not feedback:
        return RewardResult(0.0 if w.no_decision is None else w.no_decision, None)
    by_type: dict[str, list[dict[str, Any]]] = {}
    for ev in sorted(feedback, key=_order):
        by_type.setdefault(ev["type"], []).append(ev)
    decisions = sorted(by_type.get("accept", []) + by_type.get("reject", []), key=_order)
    raw: dict[str, Any] = {"decision": None, "persistence": None, "rating": None, "followup": None}
    decision = None
    accepted = False
    if decisions:
        accepted = decisions[0]["type"] == "accept"
        decision = w.accept if accepted else w.reject
        raw["decision"] = decisions[0]["type"]
    persistence = None
    if accepted and by_type.get("edit_persistence"):
        raw["persistence"] = float(by_type["edit_persistence"][-1]["fraction"])
        persistence = w.persistence * raw["persistence"]
    rating = None
    if by_type.get("rating"):
        raw["rating"] = float(by_type["rating"][-1]["value"])
        rating = w.rating * raw["rating"]
    followup = None
    if by_type.get("followup"):
        sentiments = [float(e["sentiment"]) for e in by_type["followup"]]
        raw["followup"] = sum(sentiments) / len(sentiments)
        followup = w.followup * raw["followup"]
    errors = by_type.get("tool_error", [])
    tool_errors = max(w.tool_error * len(errors), w.tool_error_floor) if errors else None
    components = {
        "decision": decision,
        "persistence": persistence,
        "rating": rating,
        "followup": followup,
        "tool_errors": tool_errors,
    }
    listed = [
        {"message": e["message"], "hint": e.get("hint"), "token_index": int(e["token_index"])}
        for e in errors
    ]
    if w.no_decision is not None and decision is None and not errors:
        nothing = dict.fromkeys(components)
        return RewardResult(w.no_decision, {**nothing, "decision": w.no_decision}, listed, raw)
    reward = 0.0
    for name in ("decision", "persistence", "rating", "followup", "tool_errors"):
        if components[name] is not None:
            reward += components[name]
    return RewardResult(reward, components, listed, raw)
