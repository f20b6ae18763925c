"""Self-distillation on a multi-turn record: the teacher sees a tool error at the turn it came back
to, and only what that turn sampled from the error on is distilled; never the tool results or
user tokens after it, never another turn.

The records are real two-turn sessions of a tiny policy (tests/unit/trainer/test_multi_turn.py
`session`), with tool errors at completion positions as the session ledger re-indexes them (the
turn's span start + the index in its call). The objective runs on test_multi_turn's stand-in.

    .venv/bin/pytest tests/unit/trainer/test_multi_turn_distill.py -q
"""

from __future__ import annotations

import pytest
import torch

from policy import build_policy
from policy.tool_format import HermesFormat, tool_format_for
from tests.unit.policy.conftest import TINY
from tests.unit.trainer.test_multi_turn import TOOL, _base, one_call, parse, session, stand_in
from trainer.batch import distill_spans, error_mask, error_spans, feedback_text, teacher_inputs
from trainer.loop import Trainer
from trainer.rollouts import Batch

ERR = {"message": "NameError: name 'y' is not defined", "hint": "define y first"}


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return build_policy(dict(TINY)).eval()


def with_errors(policy, i: int, at: list[tuple[int, int]]) -> dict:
    """Session `i` with a tool error at each (turn, index in that turn's call), re-indexed to
    completion positions as the ledger writes them; turn -1 names the tool result's first token."""
    rec = session(policy, i, 1.0)
    spans = [(t["start"], t["end"]) for t in rec["turns"]]
    errors = []
    for turn, index in at:
        pos = spans[0][1] if turn == -1 else spans[turn][0] + index
        errors.append(dict(ERR, token_index=pos))
    return dict(rec, tool_errors=errors)


def forward(policy, rollouts):
    t = stand_in(policy, distill_coef=0.1)
    with torch.no_grad():
        f = Trainer._forward(t, Batch(rollouts=rollouts, staleness=[0] * len(rollouts)))  # type: ignore[arg-type]
    policy.eval()
    return t, f


def test_the_teacher_sees_the_error_at_its_turn_and_scores_that_turn_from_it_only(policy):
    rec = with_errors(policy, 0, [(0, 1)])
    [r] = parse(policy, [rec])
    t0, t1 = r.turns
    assert t0.end >= 2 and t1.end > t1.start, r.turns  # the session sampled something to distil
    k = t0.start + 1
    t = teacher_inputs([r], policy.tokenizer, policy.config_dict()["max_context"])
    feedback = policy.tokenizer.encode(feedback_text(ERR["message"], ERR["hint"]))
    assert t.rows == [0] and t.starts == [k]
    assert t.prompts == [r.prompt_tokens + r.completion_tokens[:k] + feedback]
    assert t.tails == [r.completion_tokens[k : t0.end]], "the span ends with its turn"

    _, f = forward(policy, [r])
    expect = torch.zeros(len(r.completion_tokens))
    expect[k : t0.end] = 1.0
    assert f.teacher.mask[0].tolist() == expect.tolist(), "only turn 0 from the error on"
    # the teacher's log-probs there are the policy's given the feedback at the error
    alone = policy.logprobs(t.prompts, t.tails, None, torch.tensor([r.temperature]))[0]
    assert torch.equal(f.teacher.logprobs[0, k : t0.end], alone.to(torch.float32))
    assert float(f.teacher.logprobs[0, t0.end :].abs().sum()) == 0.0
    assert f.teacher.rollouts == 1


def test_the_distillation_term_is_summed_over_that_span_alone(policy):
    """The loss with distillation minus the loss without is coef x the surrogate written out
    over the error's span, divided by the batch's trained tokens."""
    [r] = parse(policy, [with_errors(policy, 1, [(0, 0)])])
    t0 = r.turns[0]
    t = stand_in(policy, distill_coef=0.5)
    batch = Batch(rollouts=[r], staleness=[0])
    o = Trainer._loss(t, batch)  # type: ignore[arg-type]
    base = Trainer._loss(stand_in(policy), batch)  # type: ignore[arg-type]
    policy.eval()
    logp, w, teacher = o.forward.logprobs, o.forward.weights, o.forward.teacher
    span = slice(t0.start, t0.end)
    surrogate = (
        w.weights[0, span] * (logp[0, span].detach() - teacher.logprobs[0, span]) * logp[0, span]
    ).sum() / sum(r.loss_mask)
    assert float((o.loss - base.loss).detach()) == pytest.approx(
        0.5 * float(surrogate), rel=1e-5, abs=1e-7
    )
    gap = (logp[0, span] - teacher.logprobs[0, span]).detach()
    assert o.metrics["distill_kl"] == pytest.approx(float(gap.mean()), rel=1e-5)


def test_each_turn_a_tool_error_came_back_to_gets_its_own_span(policy):
    rec = with_errors(policy, 2, [(0, 1), (1, 1), (1, 0), (-1, 0)])
    [r] = parse(policy, [rec])
    t0, t1 = r.turns
    assert distill_spans(r) == [
        (t0.start + 1, t0.end, [r.tool_errors[0]]),
        (t1.start, t1.end, [r.tool_errors[2]]),  # the turn's earliest error
    ], "an error on a tool-result token is not distilled"
    _, f = forward(policy, [r])
    mask = f.teacher.mask[0]
    assert mask[t0.start + 1 : t0.end].eq(1).all() and mask[t1.start : t1.end].eq(1).all()
    assert float(mask[: t0.start + 1].sum() + mask[t0.end : t1.start].sum()) == 0.0, (
        "never the tool result between the turns"
    )
    assert f.teacher.rollouts == 1


def test_a_stale_turn_is_not_distilled(policy):
    [r] = parse(policy, [with_errors(policy, 3, [(0, 0), (1, 0)])])
    t1 = r.turns[1]
    stale_first = r.without_turns([0])  # as the intake masks a stale turn
    assert distill_spans(stale_first) == [(t1.start, t1.end, [stale_first.tool_errors[1]])]
    only_first = r.without_turns([1])
    assert [k for k, _, _ in distill_spans(only_first)] == [r.turns[0].start]
    assert distill_spans(r.without_turns([0, 1])) == []


def test_a_one_call_record_is_distilled_from_its_earliest_error_to_its_end_as_before(policy):
    rec = one_call(policy, 0, 1.0)
    n = len(rec["completion_tokens"])
    errors = [dict(ERR, token_index=3), dict(ERR, message="second", token_index=1)]
    [r] = parse(policy, [dict(rec, tool_errors=[*errors, dict(ERR, token_index=n)])])
    [(k, end, at)] = distill_spans(r)
    assert (k, end, [e.message for e in at]) == (1, n, ["second"])
    t = teacher_inputs([r], policy.tokenizer, None)
    assert t.tails == [r.completion_tokens[1:]] and t.starts == [1]


def test_no_tool_result_token_is_ever_distilled_in_a_mixed_batch(policy):
    records = [with_errors(policy, 4 + i, [(0, 0), (1, 0)]) for i in range(3)]
    rollouts = parse(policy, records)
    _, f = forward(policy, rollouts)
    for i, r in enumerate(rollouts):
        n = len(r.completion_tokens)
        untrained = torch.tensor([1 - m for m in r.loss_mask], dtype=torch.float32)
        assert float((f.teacher.mask[i, :n] * untrained).sum()) == 0.0
        assert float(f.teacher.mask[i, :n].sum()) == sum(r.loss_mask), "both whole turns"


def test_a_broken_call_is_pushed_down_in_a_session_that_was_pushed_up(policy):
    """`error_turn_advantage`: the tokens of the turn a tool error came back to, from the error
    on (the distilled span), take that advantage instead of their session's; everything else in
    the batch keeps its own. The loss difference is the surrogate written out over that span."""
    rec = with_errors(policy, 7, [(0, 1)])  # reward 1.0: above the batch's other session
    other = session(policy, 8, -1.0)
    rollouts = parse(policy, [rec, other])
    r = rollouts[0]
    t0 = r.turns[0]
    batch = Batch(rollouts=rollouts, staleness=[0, 0])
    on = stand_in(policy, error_turn_advantage=-1.0)
    o = Trainer._loss(on, batch)  # type: ignore[arg-type]
    off = Trainer._loss(stand_in(policy), batch)  # type: ignore[arg-type]
    policy.eval()
    expect = torch.zeros(o.forward.logprobs.shape)
    expect[0, t0.start + 1 : t0.end] = 1.0
    assert o.forward.error_mask.tolist() == expect.tolist(), "turn 0 from its error on, alone"
    assert off.forward.error_mask is None
    assert o.metrics["error_turn_tokens"] == float(t0.end - t0.start - 1)
    adv = Trainer._advantages(on, o.forward.batch.rewards, [None, None], ["a", "b"], [None, None])
    assert float(adv[0]) > 0, adv  # the session's own advantage would push the broken call up
    span = slice(t0.start + 1, t0.end)
    w, logp = o.forward.weights, o.forward.logprobs
    # -w * A * logp per token: the span's A goes from the session's adv[0] to -1
    surrogate = (w.weights[0, span] * (adv[0] + 1.0) * logp[0, span]).sum()
    n = float(o.forward.batch.mask.sum())
    assert float((o.loss - off.loss).detach()) == pytest.approx(
        float(surrogate) / n, rel=1e-5, abs=1e-7
    )
    # and its gradient lowers the broken call's log-probs where the session's raised them
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = torch.autograd.grad(o.loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= 0.05 * g
        after = Trainer._forward(stand_in(policy), batch).logprobs  # type: ignore[arg-type]
        for p, g in zip(params, grads):
            p += 0.05 * g
    policy.eval()
    assert float(after[0, span].sum()) < float(logp[0, span].detach().sum())


CALL = (
    '<tool_call>\n{"name": "apply_edit", "arguments": {"path": "calc.py", "old": "raise '
    'NotImplementedError", "new": "return a // b"}}\n</tool_call>'
)


def call_session(policy, calls: list[str], errors: list[int]) -> dict:
    """A session whose turns sampled `calls` (text, in the policy's tokens) around tool results,
    with a tool error at the first token of each turn in `errors`, as the agent simulator reports
    them (token_index 0 of the turn, re-indexed by the ledger)."""
    enc = policy.tokenizer.encode
    completion, turns, mask = [], [], []
    for j, text in enumerate(calls):
        if j:
            completion += TOOL
            mask += [0] * len(TOOL)
        toks = enc(text)
        turns.append({"request_id": f"c-{j}", "model_version": "4", "temperature": 0.8,
                      "start": len(completion), "end": len(completion) + len(toks)})  # fmt: skip
        completion += toks
        mask += [1] * len(toks)
    rec = dict(
        _base("c", enc("implement div_rows"), 1.0),
        model_version="4",
        completion_tokens=completion,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        turns=turns,
        loss_mask=mask,
    )
    return dict(rec, tool_errors=[dict(ERR, token_index=turns[j]["start"]) for j in errors])


@pytest.fixture(scope="module")
def wide():
    """The tiny policy with room for three calls of an agent session."""
    torch.manual_seed(0)
    return build_policy(dict(TINY, max_context=1024)).eval()


def test_a_broken_call_is_pushed_down_from_where_it_broke_and_a_failed_call_whole(wide):
    """`error_spans`: a call one brace short is pushed down from the newline that ended it, never
    on its `//`; a well-formed call whose tool failed, from the error on, whole; a turn without an
    error, not at all. Without a tool format, every span is `distill_spans`'."""
    short = CALL.replace('b"}}', 'b"}')
    [r] = parse(wide, [call_session(wide, [short, CALL, CALL], [0, 1])])
    t0, t1, _ = r.turns
    tok = wide.tokenizer
    fmt = tool_format_for(tok)
    (k0, e0), (k1, e1) = error_spans(r, tok, fmt)
    assert tok.decode(r.completion_tokens[t0.start : k0]) == short[: short.index('b"}') + 3]
    assert tok.decode(r.completion_tokens[k0:e0]) == "\n</tool_call>" and e0 == t0.end
    assert (k1, e1) == (t1.start, t1.end), "a well-formed call: the whole call"
    assert error_spans(r, tok, None) == [(t0.start, t0.end), (t1.start, t1.end)]
    mask = error_mask([r], (1, len(r.completion_tokens)), tok, fmt)
    assert float(mask.sum()) == (e0 - k0) + (e1 - k1)


@pytest.mark.parametrize(
    ("text", "breaks_at"),
    [
        (CALL, None),
        (CALL.replace('b"}}', 'b"}'), 'b"}'),  # one brace short: at the newline after it
        (CALL[: CALL.index("// b")] + "rntumpl_cal_cal>", '"new":'),  # an unterminated string
        (CALL.replace("}}\n", "}} xx\n"), 'b"}}'),  # text after the object
        (CALL[: -len("</tool_call>")], 'b"}}'),  # a block that never closes
        ("<tool_call>\n[1, 2]\n</tool_call>", ""),  # JSON, not a call: the whole block
        ("no call at all", None),
        (CALL + "\n" + CALL.replace('b"}}', 'b"}'), CALL + "\n" + CALL[: CALL.index('b"}') + 3]),
    ],
)
def test_the_hermes_format_finds_where_a_call_stops_being_one(text, breaks_at):
    at = HermesFormat().first_break(text)
    if breaks_at is None:
        assert at is None
    else:  # everything before the break is what the call got right
        assert at is not None and text[:at].endswith(breaks_at), (text[:at][-30:], breaks_at)
        assert breaks_at or at == 0
