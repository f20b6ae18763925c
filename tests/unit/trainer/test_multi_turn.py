"""Multi-turn records (a session's segment: `turns` + `loss_mask`) through the trainer's intake and
objective: only the tokens the model sampled are trained on, each against its own turn's
behaviour log-prob; what it did not sample (tool results between turns) is context only.

The sessions are real generations of a tiny MoE policy: turn 0 sampled from the prompt, three
"tool result" tokens appended, turn 1 sampled from all of that, written as the session ledger
writes them (app/contracts/rollouts.py) and parsed as the intake parses them (`parse_rollout`).
The objective (`Trainer._loss`) runs on a stand-in holding only what it reads (config, policy,
a KL reference): a Trainer needs MLflow and Kafka.

    .venv/bin/pytest tests/unit/trainer/test_multi_turn.py -q
"""

from __future__ import annotations

import copy
import functools
import json
from types import SimpleNamespace

import pytest
import torch

from app.contracts.events import encode_routes
from policy import build_policy
from tests.unit.policy.conftest import TINY, make_prompts
from tests.unit.trainer.test_validate import TINY as VALIDATE_TINY
from tests.unit.trainer.test_validate import record as validate_record
from trainer import objective as obj
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.rollouts import Batch, DedupeSet, RolloutIntake, parse_rollout
from trainer.validate import ModelSpec

TOOL = [10, 11, 12]  # what the model did not sample: a tool result between the turns
T = 0.8


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return build_policy(dict(TINY)).eval()


@pytest.fixture(scope="module")
def ref_policy():
    """The KL reference: the policy's weights, perturbed (so the KL and the mismatch are not 0)."""
    ref = build_policy(dict(TINY)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return ref


def _base(request_id: str, prompt: list[int], reward: float) -> dict:
    """test_validate's record without routes, for `prompt`, at temperature T."""
    return validate_record(
        request_id=request_id,
        session_id="s",
        prompt_tokens=prompt,
        routes=None,
        route_shape=None,
        reward=reward,
        temperature=T,
    )


def session(policy, i: int, reward: float, versions=("3", "4")) -> dict:
    """Two sampled turns around a tool result, as one multi-turn record (a dict of its JSON)."""
    [prompt] = make_prompts(1, seed=20 + i)
    [s0] = policy.generate([prompt], max_tokens=6, temperature=T, seed=31 + i)
    [s1] = policy.generate([prompt + s0.tokens + TOOL], max_tokens=6, temperature=T, seed=41 + i)
    a, b = len(s0.tokens), len(s0.tokens) + len(TOOL)
    turns = [
        {"request_id": f"m{i}-0", "model_version": versions[0], "temperature": T, "start": 0, "end": a},
        {"request_id": f"m{i}-1", "model_version": versions[1], "temperature": T, "start": b, "end": b + len(s1.tokens)},
    ]  # fmt: skip
    return dict(
        _base(f"m{i}", prompt, reward),
        model_version=max(versions, key=int),
        completion_tokens=s0.tokens + TOOL + s1.tokens,
        logprobs=s0.logprobs + [0.0] * len(TOOL) + s1.logprobs,
        turns=turns,
        loss_mask=[1] * a + [0] * len(TOOL) + [1] * len(s1.tokens),
    )


def one_call(policy, i: int, reward: float) -> dict:
    """A one-call record with its routes (a dict of its JSON)."""
    [prompt] = make_prompts(1, seed=60 + i)
    [s] = policy.generate([prompt], max_tokens=10, temperature=T, seed=71 + i)
    routes, shape = encode_routes(s.routes)
    return dict(
        _base(f"o{i}", prompt, reward),
        model_version="4",
        completion_tokens=s.tokens,
        logprobs=s.logprobs,
        routes=routes,
        route_shape=list(shape),
    )


def parse(policy, records: list[dict]):
    spec = ModelSpec.of(policy, replay_routes=True, max_abs_reward=1e6)
    parsed = [parse_rollout(json.dumps(r).encode(), spec) for r in records]
    assert all(refusal is None for _, refusal in parsed), parsed
    return [rollout for rollout, _ in parsed]


def stand_in(policy, ref_policy=None, ref_version=None, distill_coef=0.0, **config):
    """What `Trainer._loss` reads: config, policy, the KL reference and its controller."""
    cfg = TrainerConfig(temperature=1.0, distill_coef=distill_coef, **config)
    t = SimpleNamespace(
        cfg=cfg,
        policy=policy,
        ref_policy=ref_policy,
        ref_version=ref_version,
        kl_ctl=obj.AdaptiveKL(0.1, None),
    )
    t._forward = functools.partial(Trainer._forward, t)
    t._assemble = functools.partial(Trainer._assemble, t)
    t._advantages = functools.partial(Trainer._advantages, t)
    return t


def loss_and_grads(trainer, rollouts):
    """The objective on `rollouts` and d loss / d parameters (nothing applied)."""
    batch = Batch(rollouts=rollouts, staleness=[0] * len(rollouts))
    o = Trainer._loss(trainer, batch)  # type: ignore[arg-type]
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    grads = torch.autograd.grad(o.loss, params, allow_unused=True)
    trainer.policy.eval()
    return o, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def test_the_sampled_tokens_are_scored_against_their_own_turn_s_behaviour_logprobs(policy):
    rollouts = parse(policy, [session(policy, i, float(i)) for i in range(3)])
    with torch.no_grad():
        f = Trainer._forward(stand_in(policy), Batch(rollouts=rollouts, staleness=[0] * 3))  # type: ignore[arg-type]
    policy.eval()
    c = f.batch
    for i, r in enumerate(rollouts):
        n = len(r.completion_tokens)
        assert c.mask[i, :n].tolist() == [float(m) for m in r.loss_mask]
    # at every sampled token of both turns the trainer's log-prob is the replica's
    assert torch.equal(f.logprobs * c.mask, c.behav * c.mask), (f.logprobs - c.behav) * c.mask
    # what the model did not sample reads as padding: no log-prob, no weight
    off = (1 - c.mask).bool()
    assert (
        float(f.logprobs[off].abs().max()) == 0.0
        and float(f.weights.weights[off].abs().max()) == 0.0
    )


def test_the_step_takes_the_configured_scale_of_negative_advantages(policy):
    """FLYWHEEL_TRAINER_ADV_NEGATIVE_SCALE reaches the step: its loss is the objective on the
    advantages with the negative ones scaled (0 here: the failed sessions push nothing down)."""
    rollouts = parse(policy, [session(policy, i, r) for i, r in enumerate((1.0, -0.5, -1.0))])
    batch = Batch(rollouts=rollouts, staleness=[0] * 3)
    full = obj.advantages(torch.tensor([1.0, -0.5, -1.0]), [None] * 3)
    assert (full < 0).sum() == 2
    t = stand_in(policy, adv_negative_scale=0.0)
    with torch.no_grad():
        got = Trainer._loss(t, batch)  # type: ignore[arg-type]
        want = Trainer._assemble(t, Trainer._forward(t, batch), full.clamp(min=0))  # type: ignore[arg-type]
        plain = Trainer._loss(stand_in(policy), batch)  # type: ignore[arg-type]
    policy.eval()
    assert torch.equal(got.pg_loss, want.pg_loss)
    assert not torch.equal(got.pg_loss, plain.pg_loss), "the scale changed the step"


def test_the_step_pushes_up_only_sessions_that_succeeded_when_configured(policy):
    """FLYWHEEL_TRAINER_ADV_POSITIVE_NEEDS_SUCCESS reaches the step through the records'
    `outcome`: of two failed sessions in one group, the one above the mean (-0.5 against -1.0)
    is pushed up without it and not with it."""
    recs = [session(policy, i, r) for i, r in enumerate((-0.5, -1.0))]
    for rec, outcome in zip(recs, ("failure", "abandoned"), strict=True):
        rec.update(group_id="g", outcome=outcome)
    rollouts = parse(policy, recs)
    assert [r.outcome for r in rollouts] == ["failure", "abandoned"]
    batch = Batch(rollouts=rollouts, staleness=[0] * 2)
    on = stand_in(policy, adv_scale="none", adv_positive_needs_success=True)
    with torch.no_grad():
        got = Trainer._loss(on, batch)  # type: ignore[arg-type]
        want = Trainer._assemble(on, Trainer._forward(on, batch), torch.tensor([0.0, -0.25]))  # type: ignore[arg-type]
        plain = Trainer._loss(stand_in(policy, adv_scale="none"), batch)  # type: ignore[arg-type]
    policy.eval()
    assert torch.equal(got.pg_loss, want.pg_loss)
    assert not torch.equal(got.pg_loss, plain.pg_loss), "holding the failure changed the step"
    # the step metric `positive_held_back` counts the one held
    c = got.forward.batch
    adv = Trainer._advantages(on, c.rewards, c.group_ids, c.baseline_keys, c.outcomes)  # type: ignore[arg-type]
    held = Trainer._held_back(on, c.rewards, c.group_ids, c.baseline_keys, adv)  # type: ignore[arg-type]
    assert held.tolist() == [1.0, 0.0]
    bad = dict(recs[0], outcome="won")
    spec = ModelSpec.of(policy, replay_routes=True, max_abs_reward=1e6)
    _, refusal = parse_rollout(json.dumps(bad).encode(), spec)
    assert refusal is not None and "outcome" in str(refusal), refusal


def test_the_trust_clip_reaches_the_step_and_counts_the_tokens_it_drops(policy):
    """FLYWHEEL_TRAINER_CLIP_HIGH: tokens of a positive-advantage session that the trainer already
    favours past 1 + clip_high over its behaviour (here: the behaviour log-probs of each first turn
    lowered by 0.4, ratio e^0.4 = 1.49) leave the policy gradient, and the step says how many."""
    recs = [session(policy, i, r) for i, r in enumerate((1.0, -0.5, -1.0))]
    for rec in recs:
        a = rec["turns"][0]["end"]
        rec["logprobs"] = [x - 0.4 for x in rec["logprobs"][:a]] + rec["logprobs"][a:]
    rollouts = parse(policy, recs)
    batch = Batch(rollouts=rollouts, staleness=[2] * 3)
    with torch.no_grad():
        clipped = Trainer._loss(stand_in(policy, clip_high=0.2), batch)  # type: ignore[arg-type]
        plain = Trainer._loss(stand_in(policy), batch)  # type: ignore[arg-type]
        wide = Trainer._loss(stand_in(policy, clip_high=0.6), batch)  # type: ignore[arg-type]
    policy.eval()
    c = clipped.forward.batch
    first = len(rollouts[0].completion_tokens[: rollouts[0].turns[0].end])
    # only the positive session's first turn is past the clip (the others push nothing up)
    assert clipped.metrics["trust_clip_fraction"] == pytest.approx(first / float(c.mask.sum()))
    assert plain.metrics["trust_clip_fraction"] == 0.0 == wide.metrics["trust_clip_fraction"]
    assert not torch.equal(clipped.pg_loss, plain.pg_loss), "the clip changed the step"
    assert torch.equal(wide.pg_loss, plain.pg_loss), "a clip past every ratio changes nothing"


def _reference(policy, ref_policy, rollouts, coef: float, ref_version: int):
    """The objective written out over the sampled tokens only: truncated-IS policy gradient over
    them / their count, the IS-weighted k3 KL / their count, and the mismatch over the tokens
    sampled by `ref_version`."""
    adv = obj.advantages(torch.tensor([r.reward for r in rollouts]), [None] * len(rollouts))
    pg, kl, n, gaps = 0.0, 0.0, 0, []
    for i, r in enumerate(rollouts):
        lp = policy.logprobs([r.prompt_tokens], [r.completion_tokens], None, r.temperature)[0]
        with torch.no_grad():
            ref = ref_policy.logprobs(
                [r.prompt_tokens], [r.completion_tokens], None, r.temperature
            )[0]
        idx = torch.tensor([t for t, m in enumerate(r.loss_mask) if m])
        behav = torch.tensor(r.logprobs)[idx]
        rho = torch.exp(lp[idx].detach() - behav)
        assert 0.5 <= float(torch.exp((lp[idx].detach() - behav).mean())) <= 2.0  # none masked
        w = torch.clamp(rho, max=2.0)
        q = ref[idx] - lp[idx]
        pg = pg - (w * adv[i] * lp[idx]).sum()
        kl = kl + (w * (torch.exp(q) - q - 1.0)).sum()
        n += len(idx)
        turn = next(t for t in r.turns if int(t.model_version) == ref_version)
        gaps.append(
            (ref[turn.start : turn.end] - torch.tensor(r.logprobs[turn.start : turn.end])).abs()
        )
    return pg / n + coef * (kl / n), float(torch.cat(gaps).mean())


def test_loss_and_gradients_are_those_of_the_sum_over_the_sampled_tokens(policy, ref_policy):
    rollouts = parse(policy, [session(policy, i, float(i)) for i in range(3)])
    trainer = stand_in(policy, ref_policy, ref_version=3)
    o, grads = loss_and_grads(trainer, rollouts)
    ref_loss, ref_mismatch = _reference(policy, ref_policy, rollouts, trainer.kl_ctl.coef, 3)
    params = [p for p in policy.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)
    policy.eval()
    assert float(o.loss) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-7)
    for g, rg in zip(grads, ref_grads):
        rg = torch.zeros_like(g) if rg is None else rg
        assert torch.allclose(g, rg, rtol=1e-4, atol=1e-7), float((g - rg).abs().max())
    # the mismatch is over the tokens the reference's version sampled: turn 0 of each record
    assert o.metrics["kl"] > 0 and o.metrics["mismatch"] > 0, o.metrics
    assert o.metrics["mismatch"] == pytest.approx(ref_mismatch, rel=1e-5)
    Trainer._step_metrics(o, Batch(rollouts=rollouts, staleness=[0] * 3), torch.tensor(1.0))
    trained = sum(sum(r.loss_mask) for r in rollouts)
    assert o.metrics["batch_tokens"] == trained and o.metrics["multi_turn_rollouts"] == 3.0


def test_what_sits_at_masked_positions_changes_nothing(policy, ref_policy):
    clean = [session(policy, i, float(i)) for i in range(2)]
    garbage = copy.deepcopy(clean)
    for rec in garbage:  # placeholders that are not 0.0, even ones no log-prob can be
        for t, m in enumerate(rec["loss_mask"]):
            if not m:
                rec["logprobs"][t] = [5.0, -1e30, -3.0][t % 3]
    trainer = stand_in(policy, ref_policy, ref_version=4)
    o_clean, g_clean = loss_and_grads(trainer, parse(policy, clean))
    o_garbage, g_garbage = loss_and_grads(trainer, parse(policy, garbage))
    trained = sum(sum(r["loss_mask"]) for r in clean)
    assert float(o_clean.forward.weights.keep.sum()) == trained  # no sequence masked: a real loss
    assert torch.equal(o_clean.loss, o_garbage.loss), (o_clean.loss, o_garbage.loss)
    assert all(torch.equal(a, b) for a, b in zip(g_clean, g_garbage))
    assert o_clean.metrics == o_garbage.metrics


def test_a_loss_mask_of_all_ones_without_turns_trains_bit_identically(policy, ref_policy):
    plain = [one_call(policy, i, float(i)) for i in range(3)]
    ones = [dict(r, loss_mask=[1] * len(r["completion_tokens"])) for r in plain]
    trainer = stand_in(policy, ref_policy, ref_version=4)
    o_plain, g_plain = loss_and_grads(trainer, parse(policy, plain))
    o_ones, g_ones = loss_and_grads(trainer, parse(policy, ones))
    assert torch.equal(o_plain.loss, o_ones.loss), (o_plain.loss, o_ones.loss)
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_ones))
    assert o_plain.metrics == o_ones.metrics


def test_a_batch_mixing_one_call_and_multi_turn_records_trains_each_on_its_own_tokens(policy):
    rollouts = parse(policy, [one_call(policy, 0, 1.0), session(policy, 0, 0.0)])
    c = collate(rollouts)
    assert c.masked and c.routes[0] is not None and c.routes[1] is None  # the session logged none
    n0 = len(rollouts[0].completion_tokens)
    assert float(c.mask[0].sum()) == n0 and float(c.mask[1].sum()) == sum(rollouts[1].loss_mask)
    r = rollouts[1]
    assert c.token_versions[1, : r.turns[0].end].tolist() == [3] * r.turns[0].end
    assert c.token_versions[1, r.turns[0].end : r.turns[1].start].tolist() == [-1] * len(TOOL)
    assert c.token_versions[0, :n0].tolist() == [4] * n0


# --- validation ----------------------------------------------------------------------------------


def record(**overrides) -> dict:
    """A 6-token two-turn record: turn 0 sampled [0, 2), a tool result [2, 4), turn 1 [4, 6)."""
    r = dict(
        _base("r1", [100, 101], 0.5),
        model_version="4",
        completion_tokens=[40, 41, 10, 11, 42, 43],
        logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
        turns=[
            {"request_id": "t0", "model_version": "3", "temperature": T, "start": 0, "end": 2},
            {"request_id": "t1", "model_version": "4", "temperature": T, "start": 4, "end": 6},
        ],
        loss_mask=[1, 1, 0, 0, 1, 1],
    )
    r.update(overrides)
    return r


def turns(*spans, temps=(T, T), versions=("3", "4")) -> list[dict]:
    return [
        {"request_id": f"t{k}", "model_version": v, "temperature": t, "start": a, "end": b}
        for k, ((a, b), t, v) in enumerate(zip(spans, temps, versions))
    ]


SPEC = VALIDATE_TINY  # vocabulary 259, context 64, 1 layer, top-1 of 2 experts


def routes_of(rows: list[list[int]]) -> dict:
    """`routes` and `route_shape` overrides: one [layers, top_k] row of expert ids per token."""
    routes, shape = encode_routes(torch.tensor(rows, dtype=torch.int32)[:, None].numpy())
    return {"routes": routes, "route_shape": list(shape)}


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return ModelSpec.of(build_policy(SPEC), replay_routes=True, max_abs_reward=1e6)


def refusal_of(rec: dict, spec: ModelSpec):
    return parse_rollout(json.dumps(rec).encode(), spec)[1]


@pytest.mark.parametrize(
    "overrides, reason, field, words",
    [
        ({"loss_mask": [1, 1, 0, 0, 1]}, "invalid_rollout", "loss_mask", "loss_mask has 5 values for 6 completion tokens"),
        ({"loss_mask": [0] * 6, "turns": None}, "invalid_rollout", "loss_mask", "loss_mask has no 1"),
        ({"loss_mask": [1, 1, 1, 0, 1, 1]}, "invalid_rollout", "loss_mask", "loss_mask[2] = 1 but the turns' spans say 0"),
        ({"turns": []}, "invalid_rollout", "turns", "turns must not be empty"),
        ({"turns": turns((0, 2), (4, 7))}, "invalid_rollout", "turns", "turns[1] spans [4, 7): not a non-empty span of the 6"),
        ({"turns": turns((0, 2), (2, 2))}, "invalid_rollout", "turns", "turns[1] spans [2, 2)"),
        ({"turns": turns((0, 3), (2, 6)), "loss_mask": None}, "invalid_rollout", "turns", "turns[1] starts at 2, before turns[0] ends at 3"),
        ({"model_version": "3"}, "invalid_rollout", "turns", "model_version '3' must be the newest turn's ('4')"),
        ({"temperature": 1.0}, "invalid_rollout", "turns", "turns[0].temperature 0.8 is not the record's temperature 1.0"),
        ({"temperature": None, "turns": turns((0, 2), (4, 6), temps=(0.8, 1.0))}, "mixed_temperature", "turns", "temperatures [0.8, 1.0]"),
        ({"temperature": None, "turns": turns((0, 2), (4, 6), temps=(0.8, None))}, "mixed_temperature", "turns", "temperatures [0.8, None]"),
        ({"turns": [dict(t, constrained=True) for t in turns((0, 2), (4, 6))]}, "constrained", "constrained", "grammar constraint"),
        ({"logprobs": [-0.1, 0.5, 0.0, 0.0, -0.3, -0.4]}, "invalid_logprobs", "logprobs.1", "logprobs[1] = 0.5"),
        (routes_of([[0]] * 5), "invalid_rollout", "(record)", "route_shape [5, 1, 1] must be [len(completion_tokens), layers, top_k] with len(completion_tokens) = 6 (a multi-turn record's routes cover its whole completion)"),
        (routes_of([[0, 1]] * 6), "route_mismatch", "route_shape", "route_shape [6, 1, 2] needs [6, 1, 1]"),
        (routes_of([[0]] * 4 + [[2]] * 2), "route_mismatch", "routes", "expert id 2, outside the model's [0, 2)"),
    ],
)  # fmt: skip
def test_a_broken_multi_turn_record_is_refused_naming_the_field(
    spec, overrides, reason, field, words
):
    refusal = refusal_of(record(**overrides), spec)
    assert refusal is not None and (refusal.reason, refusal.field) == (reason, field), refusal
    assert words in refusal.message, refusal


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"logprobs": [-0.1, -0.2, 7.0, float("-inf"), -0.3, -0.4]},  # placeholders are ignored
        {"loss_mask": None},  # the turns' spans are the mask
        {"turns": None},  # a mask alone: one call's version and temperature
        {"temperature": None},  # scored at the turns' one temperature
        {"turns": turns((0, 2), (4, 6), temps=(None, None))},  # the turns take the record's
        routes_of([[0]] * 6),  # the model's [n, layers, top_k], zeros between the turns
    ],
)  # fmt: skip
def test_a_well_formed_multi_turn_record_is_accepted(spec, overrides):
    assert refusal_of(record(**overrides), spec) is None


def test_a_record_without_its_own_temperature_is_scored_at_its_turns_one(spec):
    r, _ = parse_rollout(json.dumps(record(temperature=None)).encode(), spec)
    assert r.scoring_temperature() == T and collate([r], 0.5).temperatures.tolist() == [
        pytest.approx(T)
    ]


# --- staleness per turn --------------------------------------------------------------------------


class _Consumer:
    """A consumer holding the given record values on partition 0 (what `RolloutIntake.poll` reads)."""

    def __init__(self, values: list[bytes]):
        from kafka.structs import TopicPartition

        tp = TopicPartition("ns.rollouts", 0)
        self.records = {
            tp: [SimpleNamespace(offset=i, key=None, value=v) for i, v in enumerate(values)]
        }

    def subscribe(self, topics, listener=None):
        pass

    def poll(self, timeout_ms, max_records):
        out, self.records = self.records, {}
        return out


def taken(spec, records: list[dict], current: int, champion: int | None = None) -> Batch:
    consumer = _Consumer([json.dumps(r).encode() for r in records])
    intake = RolloutIntake(
        consumer, "ns.rollouts", positions={}, seen=DedupeSet(100), max_staleness=1, spec=spec
    )
    intake.poll(0)
    return intake.take(len(records), current, champion)


def test_a_stale_turn_is_masked_and_the_record_trains_on_its_fresh_turns(spec):
    batch = taken(spec, [record()], current=5)  # turn 0 (v3) is 2 behind: stale; turn 1 (v4) is not
    [r] = batch.rollouts
    assert r.train_mask() == [0, 0, 0, 0, 1, 1] and r.loss_mask == [0, 0, 0, 0, 1, 1]
    assert batch.stale_turn_tokens == 2 and batch.staleness == [1] and batch.skipped["stale"] == 0
    assert collate([r]).mask[0].tolist() == [0, 0, 0, 0, 1, 1]


def test_a_record_whose_turns_are_all_fresh_is_unchanged_and_lags_by_its_oldest_turn(spec):
    batch = taken(spec, [record()], current=4)
    assert batch.rollouts[0].loss_mask == [1, 1, 0, 0, 1, 1] and batch.staleness == [1]
    assert batch.stale_turn_tokens == 0


def test_a_constrained_turn_is_masked_and_the_record_trains_on_its_other_turns(spec):
    """Turn 0 was sampled under a tool-call grammar (its log-probs are of the masked
    distribution): it stays as context, untrained and counted; turn 1 trains."""
    rec = record(turns=[dict(turns((0, 2), (4, 6))[0], constrained=True), turns((0, 2), (4, 6))[1]])
    assert refusal_of(rec, spec) is None
    batch = taken(spec, [rec], current=4)
    [r] = batch.rollouts
    assert r.loss_mask == [0, 0, 0, 0, 1, 1] and batch.constrained_turn_tokens == 2
    assert batch.stale_turn_tokens == 0 and batch.staleness == [0]
    # and a stale free turn beside it: nothing fresh and free is left
    batch = taken(spec, [dict(rec, request_id="r2")], current=6)
    assert batch.rollouts == [] and batch.skipped["stale"] == 1


def test_a_record_with_no_fresh_turn_is_skipped_as_stale(spec):
    batch = taken(spec, [record()], current=6)
    assert batch.rollouts == [] and batch.skipped["stale"] == 1 and batch.stale_turn_tokens == 0


def test_a_turn_of_the_serving_champion_or_a_relabelled_record_is_never_stale(spec):
    assert taken(spec, [record()], current=6, champion=3).rollouts[0].loss_mask == [
        1,
        1,
        0,
        0,
        1,
        1,
    ]
    relabelled = taken(spec, [record(relabel_run="run-1")], current=9)
    assert relabelled.rollouts[0].loss_mask == [1, 1, 0, 0, 1, 1]


def test_stale_turn_tokens_are_counted_in_the_step_metrics(policy):
    rollouts = parse(policy, [session(policy, 0, 1.0), session(policy, 1, 0.0)])
    batch = Batch(rollouts=rollouts, staleness=[0, 0], stale_turn_tokens=7)
    o, _ = loss_and_grads(stand_in(policy), rollouts)
    Trainer._step_metrics(o, batch, torch.tensor(1.0))
    assert o.metrics["stale_turn_tokens"] == 7.0 and o.metrics["multi_turn_rollouts"] == 2.0


def test_sessions_sharing_a_task_are_centred_on_their_group_and_every_sampled_token_shares_it(
    policy,
):
    """Group baselines on trajectories: two sessions of one task (group_id) are centred on each
    other, apart from the others; the one advantage covers every token the model sampled."""
    task = [
        dict(session(policy, i, reward), group_id="task-1") for i, reward in enumerate((1.5, -0.5))
    ]
    others = [session(policy, 2, 0.25), one_call(policy, 3, 1.0)]
    rollouts = parse(policy, [*task, *others])
    c = collate(rollouts, policy)
    adv = obj.advantages(c.rewards, c.group_ids, scale="none")
    assert c.group_ids[:2] == ["task-1", "task-1"]
    assert adv[:2].tolist() == pytest.approx([1.0, -1.0])  # centred on the task's mean 0.5
    assert adv[2:].tolist() == pytest.approx([-0.375, 0.375])  # the rest on each other's mean
    # the policy-gradient weight of each sampled token of a session is its one advantage
    rows = c.mask[:2] > 0
    assert int(rows[0].sum()) == sum(task[0]["loss_mask"])


def test_a_groups_baseline_counts_a_sessions_segments_once_and_each_choice_of_a_request(policy):
    """The baseline keys `collate` gives `objective.advantages`: a session's segments share one
    (the ledger split it: one attempt), two choices of one request do not (two attempts), though
    an editor's records carry the same session id."""
    split = [dict(session(policy, i, -1.0), group_id="g1") for i in range(2)]  # session "s"
    other = dict(session(policy, 2, 1.0), group_id="g1", session_id="t")
    choices = [dict(one_call(policy, i, r), group_id="g2") for i, r in enumerate((1.0, 0.0))]
    lone = [dict(session(policy, 3 + i, r), group_id="g3") for i, r in enumerate((1.0, 0.0))]
    c = collate(parse(policy, [*split, other, *choices, *lone]))
    assert c.baseline_keys[:3] == ["session:s", "session:s", "session:t"]
    assert c.baseline_keys[3:5] == ["request:o0", "request:o1"]
    assert obj.grouped(c.group_ids, c.baseline_keys) == [True] * 5 + [False] * 2
    adv = obj.advantages(c.rewards, c.group_ids, "none", baseline_keys=c.baseline_keys)
    # g1: sessions s (-1, in two segments) and t (+1): mean 0, not -1/3 per segment
    assert adv[:3].tolist() == [-1.0, -1.0, 1.0]
    assert adv[3:5].tolist() == [0.5, -0.5]  # g2: two attempts of one request
