"""A segment of a session: labelled chat turns that extend one another, and the rollout it makes (pure).

The session ledger (streams/ledger.py) decides which turns go together; this module is the
token arithmetic of one segment, on the rollout records the label join writes (one per
generation, `streams/labels.py`), each with the generation's `turn` and `tools_digest` beside.

Extension. A turn extends the segment when its `prompt_tokens` start with the segment's
context (the first turn's prompt and everything assembled since: the previous turn's prompt
and completion, token for token), or with that context less its last token when that token is
the previous completion's final eos (a chat template that does not render eos in the history):
that eos then leaves the trajectory, since nothing after it was conditioned on it. Tokens are
compared, never re-tokenized. Anything else is a break with a reason (`break_reason`).

The record of a segment (`segment_record`):

    prompt_tokens      the first turn's prompt
    completion_tokens  turn 0's sampled tokens, then each later turn's prompt tokens beyond the
                       context (tool results, user messages, template tokens), then its sampled ones
    loss_mask          1 exactly on sampled tokens; logprobs are the behaviour log-probs there, 0.0
                       elsewhere
    turns              one span per turn (request_id, model_version, temperature, finish_reason,
                       constrained, components, generated_at, [start, end) of its sampled tokens)

A one-turn segment's record is its input record (less `turn`, `tools_digest` and
`protected_writes`) plus the segment fields: no `turns`, no `loss_mask`, so today's consumers read
it as they always have. Every segment's record says why it opened and closed (`segment_opened_by`,
`segment_closed_by`), when the session's outcome reached it, `outcome` and `outcome_reward`, and,
when its session's turns wrote protected paths (a spec with `protected_paths`), their count
`protected_writes` (the session's, not the segment's own: it is what decided `outcome_reward`). The multi-turn record: request_id, session_id, group_id and
generated_at of the first turn; model_version, finish_reason and reward_spec of the last;
temperature where the turns agree, else None; constrained True when any turn was (the trainer
masks such turns); labelled_at the latest; tool_errors re-indexed to completion positions (each
turn's token_index plus its span's start); routes as below.

Routes (`segment_routes`). An MoE model's turn logs `routes`, base64 little-endian int32
[n_completion, layers, top_k]: row j the experts at the position that predicted its sampled token
j. The multi-turn record's `routes` cover its whole `completion_tokens` ([len, layers, top_k]):
each turn's rows at its span (a dropped final eos drops its row too: a span keeps its first
`end - start` rows), and rows of zeros for the tokens between the turns (loss_mask 0), which no
call sampled, so no route was logged for them (they were prefilled; the trainer does not replay
them, docs/TRAINER.md "The objective on trajectories"). The record has routes only when every turn
logged them with the same (layers, top_k); otherwise `routes` and `route_shape` are None and the
trainer routes the whole record with its current router: one array has one (layers, top_k), and a
turn without routes (a dense model's, a replica that logs none) has no rows to put in its span,
which zeros would pass off as logged experts. Stored state: turn 0's routes are the first record's
(kept whole), each later turn's are its part's, as logged (base64, never decoded into lists), so
the value every turn rewrites holds each turn's routes once; the record's are assembled at close.

Credit assignment (`segment_reward`, streams/reward.py "Sessions"): the return is the sum of
the turns' own rewards (a turn's decision, rating and follow-up where feedback named that turn,
and its tool-error penalty where its call failed) plus the outcome's reward; `components` are
the per-name sums of the turns' (None where no turn has that component; None when no turn got
feedback); each turn's span keeps its own reward.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson

BreakReason = Literal[
    "history_rewritten", "tools_changed", "version_tokenizer_changed", "max_tokens", "max_bytes"
]
# input keys beside the rollout's; not in the record (a turn's `protected_writes`, which a spec
# with protected paths labels it with, is summed into its session's: the record carries that)
LEDGER_KEYS = ("turn", "tools_digest", "protected_writes")
COMPONENT_NAMES = ("decision", "persistence", "rating", "followup", "tool_errors")


def as_rollout(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The rollout of an input record: the record less the ledger's own keys."""
    return {k: v for k, v in rec.items() if k not in LEDGER_KEYS}


@dataclass(slots=True)
class TurnPart:
    """One turn of an open segment (stored with the short keys named beside each field)."""

    turn: int  # "t": the generation's turn
    request_id: str  # "rid"
    model_version: str  # "v"
    temperature: float | None  # "temp"
    finish_reason: str | None  # "fin"
    constrained: bool | None  # "con"
    components: dict[str, float | None] | None  # "comp"
    generated_at: str  # "gen"
    labelled_at: str  # "lab"
    reward: float  # "r"
    reward_spec: str  # "spec"
    tool_errors: list[
        dict[str, Any]
    ]  # "err": as labelled (token_index into this turn's completion)
    start: int  # "s": its sampled tokens are completion_tokens[start:end]
    end: int  # "e"
    # "ro": the routes it logged (base64 int32 [n, layers, top_k], n its completion's length before
    # an eos drop), as logged; None for turn 0 (its routes are the segment's first record's) and
    # for a turn that logged none. Stored only when set.
    routes: str | None = None
    route_shape: list[int] | None = None  # "rs": [n, layers, top_k] with `routes`

    @classmethod
    def of(cls, rec: Mapping[str, Any], start: int, keep_routes: bool = True) -> TurnPart:
        """The part of input record `rec` whose sampled tokens start at completion position `start`
        (with its routes unless `keep_routes` is False: turn 0, whose routes the segment keeps)."""
        n = len(rec["completion_tokens"])
        routes = rec.get("routes") if keep_routes else None
        return cls(
            rec["turn"],
            rec["request_id"],
            rec["model_version"],
            rec.get("temperature"),
            rec.get("finish_reason"),
            rec.get("constrained"),
            rec.get("components"),
            rec["generated_at"],
            rec["labelled_at"],
            float(rec["reward"]),
            rec["reward_spec"],
            list(rec.get("tool_errors") or []),
            start,
            start + n,
            routes,
            rec.get("route_shape") if routes is not None else None,
        )

    def span(self) -> dict[str, Any]:
        """Its `TurnSpan` (app/contracts/rollouts.py) as JSON."""
        return {
            "request_id": self.request_id,
            "model_version": self.model_version,
            "temperature": self.temperature,
            "start": self.start,
            "end": self.end,
            "finish_reason": self.finish_reason,
            "constrained": self.constrained,
            "components": self.components,
            "generated_at": self.generated_at,
            "reward": self.reward,
        }

    _KEYS = (
        "t",
        "rid",
        "v",
        "temp",
        "fin",
        "con",
        "comp",
        "gen",
        "lab",
        "r",
        "spec",
        "err",
        "s",
        "e",
    )

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> TurnPart:
        """(A part stored before routes were kept has no "ro": it logged none, as far as it says.)"""
        return cls(*(stored[k] for k in cls._KEYS), stored.get("ro"), stored.get("rs"))

    def to_stored(self) -> dict[str, Any]:
        values = (
            self.turn,
            self.request_id,
            self.model_version,
            self.temperature,
            self.finish_reason,
            self.constrained,
            self.components,
            self.generated_at,
            self.labelled_at,
            self.reward,
            self.reward_spec,
            self.tool_errors,
            self.start,
            self.end,
        )
        out = dict(zip(self._KEYS, values, strict=True))
        if self.routes is not None:
            out["ro"], out["rs"] = self.routes, self.route_shape
        return out


@dataclass(slots=True)
class Segment:
    """The open segment of a session: its first record and what was assembled after its prompt.

    A value: extending builds the next segment (`extended`), so a stored form that was read is
    never changed under its table."""

    first: dict[str, Any]  # "first": the first turn's rollout (as_rollout), kept whole
    completion: list[int]  # "c": the assembled completion_tokens
    logprobs: list[float]  # "lp"
    mask: list[int]  # "m": the loss mask (1 on sampled tokens)
    parts: list[TurnPart]  # "parts": the turns, in order
    tools_digest: str | None  # "tools": the tools the turns were offered
    opened_by: str  # "by": why it opened (streams/ledger.py, OpenReason)

    @classmethod
    def start(cls, rec: Mapping[str, Any], opened_by: str) -> Segment:
        first = as_rollout(rec)
        n = len(first["completion_tokens"])
        return cls(
            first,
            list(first["completion_tokens"]),
            list(first["logprobs"]),
            [1] * n,
            [TurnPart.of(rec, 0, keep_routes=False)],
            rec.get("tools_digest"),
            opened_by,
        )

    @property
    def length(self) -> int:
        """Tokens of the record it makes (prompt and completion)."""
        return len(self.first["prompt_tokens"]) + len(self.completion)

    @property
    def row_bytes(self) -> int:
        """Logged route bytes per completion token (int32 ids, base64): 0 without routes."""
        return _row_bytes(self.first.get("route_shape"))

    @property
    def size(self) -> int:
        """An upper bound of its stored JSON, and of its record's (`record_bytes`; the turns'
        logged routes and tool errors as they are)."""
        first = len(self.first["prompt_tokens"])
        size = record_bytes(first, len(self.completion), len(self.parts), self.row_bytes)
        # the stored state also keeps the first turn's own completion in `first`
        size += (COMPLETION_TOKEN_BYTES + self.row_bytes) * len(self.first["completion_tokens"])
        return size + sum(len(orjson.dumps(p.tool_errors)) for p in self.parts)

    @property
    def last_turn(self) -> int:
        return self.parts[-1].turn

    def turn_routes(self, k: int) -> tuple[str, list[int]] | None:
        """(routes, route_shape) that turn `k` logged, as logged; None when it logged none."""
        if k == 0:
            routes, shape = self.first.get("routes"), self.first.get("route_shape")
        else:
            routes, shape = self.parts[k].routes, self.parts[k].route_shape
        return None if routes is None or shape is None else (routes, list(shape))

    def context(self) -> list[int]:
        """What the next turn's prompt must start with: the last turn's prompt and completion."""
        return [*self.first["prompt_tokens"], *self.completion]

    def extended(self, rec: Mapping[str, Any], drop_eos: bool) -> Segment:
        """This segment with turn `rec` appended (after `extension` said it extends it)."""
        completion, logprobs, mask = self.completion, self.logprobs, self.mask
        parts = list(self.parts)
        if drop_eos:
            completion, logprobs, mask = completion[:-1], logprobs[:-1], mask[:-1]
            last = parts[-1]
            parts[-1] = replace(last, end=last.end - 1)
        between = rec["prompt_tokens"][len(self.first["prompt_tokens"]) + len(completion) :]
        sampled = rec["completion_tokens"]
        start = len(completion) + len(between)
        parts.append(TurnPart.of(rec, start))
        return Segment(
            self.first,
            [*completion, *between, *sampled],
            [*logprobs, *([0.0] * len(between)), *rec["logprobs"]],
            [*mask, *([0] * len(between)), *([1] * len(sampled))],
            parts,
            self.tools_digest,
            self.opened_by,
        )

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> Segment:
        return cls(
            stored["first"],
            stored["c"],
            stored["lp"],
            stored["m"],
            [TurnPart.from_stored(p) for p in stored["parts"]],
            stored["tools"],
            stored["by"],
        )

    def to_stored(self) -> dict[str, Any]:
        return {
            "first": self.first,
            "c": self.completion,
            "lp": self.logprobs,
            "m": self.mask,
            "parts": [p.to_stored() for p in self.parts],
            "tools": self.tools_digest,
            "by": self.opened_by,
        }


# Upper bounds of a record's JSON per token, for `record_bytes`: a prompt token is an id and a
# comma (ids below 10^7); a completion token adds its log-prob (orjson's shortest float repr,
# sign and exponent included) and its mask digit; each turn's span and the fixed fields are below
# the per-turn and per-record constants.
PROMPT_TOKEN_BYTES, COMPLETION_TOKEN_BYTES = 8, 8 + 25 + 2
TURN_BYTES, RECORD_BYTES = 1024, 4096


def record_bytes(prompt: int, completion: int, turns: int, row_bytes: int) -> int:
    """An upper bound of the JSON size of a segment's record (and of its stored state, which
    holds the same tokens): `prompt` and `completion` tokens, `turns` turns, `row_bytes` of
    routes per completion token."""
    return (
        RECORD_BYTES
        + PROMPT_TOKEN_BYTES * prompt
        + (COMPLETION_TOKEN_BYTES + row_bytes) * completion
        + TURN_BYTES * turns
    )


def _row_bytes(shape: Sequence[int] | None) -> int:
    return 0 if not shape else (4 * shape[1] * shape[2] * 4 + 2) // 3


def record_size(rec: Mapping[str, Any]) -> int:
    """An upper bound of the JSON size of a rollout record (an input turn or a segment's record)."""
    turns = len(rec.get("turns") or ()) or 1
    size = record_bytes(
        len(rec["prompt_tokens"]),
        len(rec["completion_tokens"]),
        turns,
        _row_bytes(rec.get("route_shape")),
    )
    return size + len(orjson.dumps(rec.get("tool_errors") or []))


def extension(
    seg: Segment,
    rec: Mapping[str, Any],
    eos_ids: Sequence[int],
    max_tokens: int,
    max_bytes: int | None = None,
) -> tuple[BreakReason | None, bool]:
    """(why `rec` cannot extend `seg`, or None; whether it extends it without the final eos)."""
    if rec.get("tokenizer") != seg.first.get("tokenizer"):
        return "version_tokenizer_changed", False
    if rec.get("tools_digest") != seg.tools_digest:
        return "tools_changed", False
    ctx, prompt = seg.context(), rec["prompt_tokens"]
    if prompt[: len(ctx)] == ctx:
        drop = False
    elif _ends_in_eos(seg, eos_ids) and prompt[: len(ctx) - 1] == ctx[:-1]:
        drop = True
    else:
        return "history_rewritten", False
    total = len(prompt) + len(rec["completion_tokens"])
    if total > max_tokens:
        return "max_tokens", False
    first = len(seg.first["prompt_tokens"])
    size = record_bytes(first, total - first, len(seg.parts) + 1, seg.row_bytes)
    if max_bytes is not None and size > max_bytes:
        return "max_bytes", False
    return None, drop


def _ends_in_eos(seg: Segment, eos_ids: Sequence[int]) -> bool:
    last = seg.parts[-1]
    return last.end > last.start and seg.completion[-1] in eos_ids


def segment_reward(parts: Sequence[TurnPart], outcome_value: float | None = None) -> float:
    """A segment's return: the sum of its turns' rewards, plus the session outcome's reward when
    it reached the segment (streams/reward.py "Sessions")."""
    total = sum((p.reward for p in parts), 0.0)
    return total + outcome_value if outcome_value is not None else total


def segment_components(parts: Sequence[TurnPart]) -> dict[str, float | None] | None:
    """Per-name sums of the turns' components (None where no turn has it; None without feedback)."""
    given = [p.components for p in parts if p.components is not None]
    if not given:
        return None
    out: dict[str, float | None] = {}
    for name in COMPONENT_NAMES:
        values = [c[name] for c in given if c.get(name) is not None]
        out[name] = sum(values, 0.0) if values else None
    return out


def segment_routes(seg: Segment) -> tuple[str, list[int]] | tuple[None, None]:
    """(routes, route_shape) of a multi-turn segment's record (module docstring, "Routes"): each
    turn's logged rows at its span, zeros between; (None, None) unless every turn logged routes
    with the same (layers, top_k)."""
    logged = [seg.turn_routes(k) for k in range(len(seg.parts))]
    if any(r is None for r in logged):
        return None, None
    per_token = {tuple(shape[1:]) for _, shape in logged}  # type: ignore[misc]
    if len(per_token) != 1:
        return None, None
    layers, top_k = per_token.pop()
    row = 4 * layers * top_k  # bytes of one token's int32 [layers, top_k]
    out = bytearray(row * len(seg.completion))  # zeros: the rows no turn sampled
    for k, (part, (routes, shape)) in enumerate(zip(seg.parts, logged)):  # type: ignore[misc]
        raw, n = base64.b64decode(routes), part.end - part.start
        assert len(raw) == row * shape[0] and n <= shape[0], (
            f"turn {part.turn} (part {k}) logged {len(raw)} route bytes, route_shape {shape}, "
            f"for a span of {n} tokens"
        )
        out[row * part.start : row * part.end] = raw[: row * n]  # an eos dropped: its row too
    return base64.b64encode(bytes(out)).decode(), [len(seg.completion), layers, top_k]


def segment_record(
    seg: Segment,
    closed_by: str,
    outcome: str | None = None,
    outcome_value: float | None = None,
    protected_writes: int = 0,
) -> dict[str, Any]:
    """The rollout of a segment that closed for `closed_by` (module docstring), with the session's
    `outcome` and its reward under the turns' spec when it reached the segment, and the session's
    count of protected writes so far when above 0."""
    ledger = {
        "segment_opened_by": seg.opened_by,
        "segment_closed_by": closed_by,
        **({"outcome": outcome, "outcome_reward": outcome_value} if outcome is not None else {}),
        **({"protected_writes": protected_writes} if protected_writes > 0 else {}),
    }
    if len(seg.parts) == 1:
        record = {**seg.first, **ledger}
        if outcome_value is not None:
            record["reward"] = segment_reward(seg.parts, outcome_value)
        return record
    first, parts = seg.first, seg.parts
    temperatures = {p.temperature for p in parts}
    routes, route_shape = segment_routes(seg)
    constrained = [p.constrained for p in parts if p.constrained is not None]
    return {
        "request_id": first["request_id"],
        "session_id": first["session_id"],
        "group_id": first.get("group_id"),
        "model_version": parts[-1].model_version,
        "prompt_tokens": first["prompt_tokens"],
        "completion_tokens": seg.completion,
        "logprobs": seg.logprobs,
        "routes": routes,
        "route_shape": route_shape,
        "reward": segment_reward(parts, outcome_value),
        "components": segment_components(parts),
        "tool_errors": [
            {**e, "token_index": p.start + int(e["token_index"])}
            for p in parts
            for e in p.tool_errors
        ],
        "reward_spec": parts[-1].reward_spec,
        "generated_at": parts[0].generated_at,
        "labelled_at": max(p.labelled_at for p in parts),
        "closed_by": "window",
        "tokenizer": first.get("tokenizer"),
        "temperature": temperatures.pop() if len(temperatures) == 1 else None,
        "finish_reason": parts[-1].finish_reason,
        "constrained": any(constrained) if constrained else None,
        "turns": [p.span() for p in parts],
        "loss_mask": seg.mask,
        **ledger,
    }
