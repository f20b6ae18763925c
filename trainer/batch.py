"""Rollouts -> the padded tensors the objective needs, and the self-distillation teacher inputs.

`collate` turns a list of rollouts into prompts/completions/routes lists (what
Policy.logprobs takes) plus right-padded [B, T] float32 tensors: behaviour log-probs, the
token mask, rewards, and each rollout's sampling temperature [B] (the rollout's own; a record
without one, written before the field existed, gets the trainer's FLYWHEEL_TRAINER_TEMPERATURE).
The token mask is 1 on the tokens trained on: every completion token of a one-call record; a
multi-turn record's `train_mask()` (what its turns sampled; docs/TRAINER.md "Multi-turn
records"), whose mask-0 positions read as padding (behaviour log-prob 0.0). Routes
(`replay_routes`): a one-call record's are replayed on every token; a multi-turn record's only on
its trained tokens, the rest `UNROUTED` (routed by the current router, as its prompt is).

`teacher_inputs` builds, for rollouts with tool_error feedback, the self-distillation teacher's
rows: the context prompt + completion[:k] + the error message and hint (as text), then the
student's own tokens completion[k:end]. One call: k is the earliest error's token_index and end
the completion's end. A multi-turn record: one row per trained turn a tool error came back to, k
its earliest error in that turn's span and end the span's end, so the teacher scores only what
that call sampled from the error on (`distill_spans`). A row whose span fills the whole context
has no room for the feedback and gets no teacher.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from policy.base import UNROUTED, Tokenizer
from policy.tool_format import ToolFormat
from trainer.rollout_record import Rollout, ToolErrorInfo, version_number


@dataclass
class Collated:
    prompts: list[list[int]]
    completions: list[list[int]]
    routes: list[np.ndarray | None]
    behav: torch.Tensor  # float32 [B, T]
    mask: torch.Tensor  # float32 [B, T]
    rewards: torch.Tensor  # float32 [B]
    group_ids: list[str | None]
    baseline_keys: list[str]  # `baseline_key`: what a group's baseline counts once
    outcomes: list[str | None]  # each agent session's outcome where it reached the record
    versions: list[int | None]
    temperatures: torch.Tensor  # float32 [B]: what each rollout was sampled at
    # int64 [B, T]: the model version that sampled each token (its turn's), -1 where unknown
    token_versions: torch.Tensor
    masked: bool  # some rollout trains on part of its completion only (a loss mask)


def baseline_key(r: Rollout) -> str:
    """What a group's baseline counts once (`objective.advantages`' baseline keys): a session's
    segments (records the ledger assembled, with `turns`) share their session id; any other
    record is one of its own, by request id (the choices of one request are as many attempts,
    though the editor's session id is the same)."""
    return f"session:{r.session_id}" if r.turns is not None else f"request:{r.request_id}"


def collate(rollouts: list[Rollout], default_temperature: float = 1.0) -> Collated:
    """The batch tensors; a rollout without a recorded temperature is scored at
    `default_temperature` (the trainer's setting)."""
    assert rollouts, "collate needs at least one rollout"
    t_max = max(len(r.completion_tokens) for r in rollouts)
    b = len(rollouts)
    behav = torch.zeros((b, t_max), dtype=torch.float32)
    mask = torch.zeros((b, t_max), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        n, trained = len(r.completion_tokens), r.train_mask()
        behav[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
        mask[i, :n] = 1.0
        if trained is not None:  # the placeholders at mask-0 positions are ignored: 0.0
            mask[i, :n] = torch.tensor(trained, dtype=torch.float32)
            behav[i] = torch.where(mask[i] > 0, behav[i], 0.0)
    return Collated(
        prompts=[list(r.prompt_tokens) for r in rollouts],
        completions=[list(r.completion_tokens) for r in rollouts],
        routes=[replay_routes(r) for r in rollouts],
        behav=behav,
        mask=mask,
        rewards=torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
        group_ids=[r.group_id for r in rollouts],
        baseline_keys=[baseline_key(r) for r in rollouts],
        outcomes=[r.outcome for r in rollouts],
        versions=[r.version_number() for r in rollouts],
        temperatures=torch.tensor(
            [_or(r.scoring_temperature(), default_temperature) for r in rollouts],
            dtype=torch.float32,
        ),
        token_versions=token_versions(rollouts, t_max),
        masked=any(r.train_mask() is not None for r in rollouts),
    )


def replay_routes(r: Rollout) -> np.ndarray | None:
    """int32 [T, layers, top_k], the routes `Policy.logprobs` replays for `r` (None: none logged).

    A one-call record's as logged. A multi-turn record's at its trained tokens (`train_mask()` 1:
    what a fresh, unconstrained turn sampled, each row the experts its turn's replica routed it
    to) and `UNROUTED` elsewhere: the tokens between the turns were prefilled by the next call,
    not sampled, so no route was logged for them (their rows are zeros, streams/segments.py) and
    the current router routes them, as it does the prompt; a stale or constrained turn is
    context, routed the same way."""
    ids = r.routes_array()
    if ids is None or r.turns is None:
        return ids
    ids[np.asarray(r.train_mask(), dtype=bool) == 0] = UNROUTED
    return ids


def _or(x: float | None, default: float) -> float:
    return default if x is None else x


def token_versions(rollouts: list[Rollout], t_max: int) -> torch.Tensor:
    """int64 [B, t_max]: the version that sampled each completion token (a one-call record's
    `model_version`; a multi-turn record's turn's), -1 where unknown (not a number, not
    sampled, padding)."""
    out = torch.full((len(rollouts), t_max), -1, dtype=torch.int64)
    for i, r in enumerate(rollouts):
        spans = [(0, len(r.completion_tokens), r.version_number())]
        if r.turns is not None:
            spans = [(t.start, t.end, version_number(t.model_version)) for t in r.turns]
        for start, end, v in spans:
            out[i, start:end] = -1 if v is None else v
    return out


def feedback_text(message: str, hint: str | None) -> str:
    """What the teacher sees at the error position (a code comment, so it reads as context)."""
    text = f"\n# tool error: {message.strip()}\n"
    if hint:
        text += f"# hint: {hint.strip()}\n"
    return text


@dataclass
class TeacherInputs:
    """One teacher row per distilled span; a multi-turn record may have several (one per turn a
    tool error came back to), so `rows` may repeat a batch row, with disjoint spans."""

    rows: list[int]  # batch row of each teacher row
    starts: list[int]  # k per teacher row: its first distilled completion token
    prompts: list[list[int]]  # prompt + completion[:k] + feedback (left-truncated to fit)
    tails: list[list[int]]  # the distilled span completion[k:end]


def distill_spans(r: Rollout) -> list[tuple[int, int, list[ToolErrorInfo]]]:
    """(k, end, the errors at k) per span to distil: from a tool error's position to the end of
    what the model sampled in that call.

    One call: from the earliest error to the end of the completion. A multi-turn record (`turns`;
    its tool errors are at completion positions, the ledger's span start + index): per turn whose
    span holds an error and is trained on (not masked as stale or constrained), from its earliest
    error to the end of that turn's span; an error on a token no turn sampled (a tool result, past
    the end) has nothing of its call after it and is not distilled."""
    n = len(r.completion_tokens)
    if r.turns is None:
        errors = [e for e in r.tool_errors if e.token_index < n]
        if not errors:
            return []
        k = min(e.token_index for e in errors)
        return [(k, n, [e for e in errors if e.token_index == k])]
    trained = r.train_mask() or [1] * n
    out = []
    for t in r.turns:
        errors = [e for e in r.tool_errors if t.start <= e.token_index < t.end]
        if not errors or not trained[t.start]:  # a turn's span is trained whole or not at all
            continue
        k = min(e.token_index for e in errors)
        out.append((k, t.end, [e for e in errors if e.token_index == k]))
    return out


def _token_at(tokens: list[int], tokenizer: Tokenizer, offset: int) -> int:
    """The index of the token of `tokens` whose decoded text holds character `offset`, which is
    inside their decoded text: the shortest prefix that decodes past it, by bisection."""
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(tokens[:mid])) > offset:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


def error_spans(r: Rollout, tokenizer: Tokenizer, fmt: ToolFormat | None) -> list[tuple[int, int]]:
    """(start, end) per call that came back as a tool error: `distill_spans`' span, from where
    the call broke when the turn's text holds a malformed call in `fmt` (`ToolFormat.first_break`:
    a call one brace short breaks at the byte that ended it, not at its first token; a break at
    the very end of the text, its last token), else from the error's position (a well-formed call
    whose tool failed: the whole call from there).

    A span from the error position would hold the whole broken call: in an agent run the `//` of
    every `div` edit that dropped its last brace was pushed down with it, and the verb's right
    operator fell from 0.33 to 0.05 in five versions (docs/TRAINER.md "Error turns")."""
    out = []
    for k, end, _ in distill_spans(r):
        tokens = list(r.completion_tokens[k:end])
        text = tokenizer.decode(tokens)
        at = None if fmt is None else fmt.first_break(text)
        if at is not None:
            k += len(tokens) - 1 if at >= len(text) else _token_at(tokens, tokenizer, at)
        out.append((k, end))
    return out


def error_mask(
    rollouts: list[Rollout], shape: tuple[int, int], tokenizer: Tokenizer, fmt: ToolFormat | None
) -> torch.Tensor:
    """float32 [B, T], 1 on every `error_spans` span of each rollout, 0 elsewhere: where
    `error_turn_advantage` replaces the session's advantage (trainer/objective.py
    `token_advantages`)."""
    out = torch.zeros(shape, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        for k, end in error_spans(r, tokenizer, fmt):
            out[i, k:end] = 1.0
    return out


def teacher_inputs(
    rollouts: list[Rollout], tokenizer: Tokenizer, max_context: int | None
) -> TeacherInputs:
    """The teacher's rows of `rollouts` (`distill_spans`): each sees its errors' feedback at k and
    scores the span completion[k:end]. A span that fills the whole context has no room for the
    feedback and gets no teacher."""
    out = TeacherInputs([], [], [], [])
    for i, r in enumerate(rollouts):
        for k, end, errors in distill_spans(r):
            feedback = tokenizer.encode("".join(feedback_text(e.message, e.hint) for e in errors))
            ctx = list(r.prompt_tokens) + list(r.completion_tokens[:k]) + feedback
            tail = list(r.completion_tokens[k:end])
            if max_context is not None:
                room = max_context - 1 - len(tail)  # 1 for bos
                if room <= 0:  # no room for the feedback: no teacher for this span
                    continue
                ctx = ctx[-room:]
            out.rows.append(i)
            out.starts.append(k)
            out.prompts.append(ctx)
            out.tails.append(tail)
    return out


def scatter_teacher(
    teacher_lp: torch.Tensor, t: TeacherInputs, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher log-probs [n_teacher_rows, T_tail] -> ([B, T] aligned with the student, distill
    mask [B, T]: 1 on every teacher row's span)."""
    full = torch.zeros(shape, dtype=torch.float32)
    dmask = torch.zeros(shape, dtype=torch.float32)
    for j, (row, k, tail) in enumerate(zip(t.rows, t.starts, t.tails)):
        full[row, k : k + len(tail)] = teacher_lp[j, : len(tail)].to(torch.float32)
        dmask[row, k : k + len(tail)] = 1.0
    return full, dmask
