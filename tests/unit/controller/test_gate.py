"""Gate statistics against hand-computed values, and the gate's verdicts on small real policies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from app.controller import ope
from app.controller.gate import GateConfig, GateInputs, log_weights, run_gate
from app.controller.monitors import behaviour_checks, kl_check, regression_check, weight_sanity
from tests.unit.controller.unigram import UnigramPolicy, favouring

LOGW4 = np.log(np.array([1.0, 2.0, 3.0, 4.0]))
R4 = np.array([1.0, 0.0, 1.0, 0.0])


def test_snips_on_four_samples_by_hand():
    # sum w r / sum w = (1*1 + 3*1) / (1+2+3+4) = 0.4
    assert ope.snips(R4, LOGW4) == pytest.approx(0.4, abs=1e-15)
    assert ope.snips(R4, LOGW4 + 700.0) == pytest.approx(0.4, abs=1e-12), (
        "huge log weights do not overflow"
    )


def test_ess_by_hand():
    assert ope.effective_sample_size(LOGW4) == pytest.approx(100.0 / 30.0)
    assert ope.effective_sample_size(np.zeros(7)) == pytest.approx(7.0)
    assert ope.effective_sample_size(np.array([0.0, -50.0, -50.0])) == pytest.approx(1.0, abs=1e-12)


def test_doubly_robust_by_hand():
    # normalised w = .1 .2 .3 .4; residuals +.5 -.5 +.5 -.5 -> correction -0.1; DM term 0.6 -> 0.5
    dr = ope.doubly_robust(R4, LOGW4, np.full(4, 0.5), np.full(4, 0.6))
    assert dr == pytest.approx(0.5, abs=1e-15)
    # a perfect reward model leaves only the direct-method term
    assert ope.doubly_robust(R4, LOGW4, R4, np.full(4, 0.7)) == pytest.approx(0.7)


def test_sequence_log_weights_sum_token_ratios():
    lw = ope.sequence_log_weights([[-1.0, -2.0], [-0.5]], [[-1.5, -1.0], [-0.5]])
    assert lw.dtype == np.float64 and lw.tolist() == pytest.approx([-0.5, 0.0])
    with pytest.raises(AssertionError):
        ope.sequence_log_weights([[-1.0]], [[-1.0, -2.0]])


def test_snips_recovers_target_value_on_synthetic_bandit():
    rng = np.random.default_rng(1)
    n = 20_000
    a = rng.integers(0, 2, n)  # behaviour: uniform over two actions
    r = (a == 1).astype(np.float64) + rng.normal(0, 0.1, n)
    target = np.where(a == 1, 0.8, 0.2)  # target takes action 1 w.p. 0.8 -> value 0.8
    lw = np.log(target) - np.log(0.5)
    assert ope.snips(r, lw) == pytest.approx(0.8, abs=0.02)
    res = ope.estimate(r, lw, n_boot=200)
    assert res.snips_ci[0] < 0.8 < res.snips_ci[1]
    assert res.improvement_ci[0] > 0.2, "target (0.8) is clearly better than behaviour (0.5)"


def test_bootstrap_interval_covers_the_mean_at_about_its_level():
    rng = np.random.default_rng(2)
    hits, trials = 0, 200
    for t in range(trials):
        x = rng.exponential(1.0, 100)
        lo, hi = ope.bootstrap_ci(lambda i: float(x[i].mean()), 100, n_boot=200, alpha=0.1, seed=t)
        hits += lo <= 1.0 <= hi
    assert 0.80 <= hits / trials <= 0.97, (
        f"90% bootstrap interval covered the true mean {hits}/{trials} times"
    )


def test_ridge_recovers_a_linear_reward():
    rng = np.random.default_rng(3)
    X = np.column_stack([np.ones(500), rng.normal(size=(500, 2))])
    y = X @ np.array([0.3, -1.0, 2.0])
    m = ope.RidgeRewardModel(lam=1e-6).fit(X, y)
    assert np.allclose(m.beta, [0.3, -1.0, 2.0], atol=1e-5)


# --- monitors -----------------------------------------------------------------------------------
def test_nan_checkpoint_fails_sanity():
    state = {"w": torch.tensor([1.0, float("nan")]), "step": torch.tensor([3])}
    finite, change = weight_sanity(state, {"w": torch.ones(2), "step": torch.tensor([2])}, 0.5, 2.0)
    assert finite.status == "fail" and "w" in finite.detail and change.status == "skipped"


def test_big_weight_change_fails_and_small_one_passes():
    parent = {"a": torch.ones(100), "b": torch.ones(10)}
    small = {"a": torch.ones(100) * 1.01, "b": torch.ones(10)}
    big = {"a": torch.ones(100), "b": torch.ones(10) * 5.0}  # one tensor blown up by 4x of its norm
    assert weight_sanity(small, parent, 0.5, 2.0)[1].status == "pass"
    c = weight_sanity(big, parent, 0.5, 2.0)[1]
    assert c.status == "fail" and "b" in c.detail and c.value == pytest.approx(math.sqrt(160 / 110))


def test_a_zero_initialized_tensor_that_trains_is_not_an_infinite_change():
    """Qwen2's q/k/v biases start at zero (so does a LoRA B matrix): a first step moves them
    from a zero norm. Their change is measured against a tensor of their size at the checkpoint's
    RMS; blowing them up, or any tensor x64 as the demo's planted version does, still fails."""
    g = torch.Generator().manual_seed(0)
    parent = {"w": torch.randn(64, 64, generator=g) * 0.02, "bias": torch.zeros(64)}
    trained = {"w": parent["w"] + 1e-3, "bias": torch.full((64,), 1e-3)}
    ok = weight_sanity(trained, parent, 0.5, 2.0)[1]
    assert ok.status == "pass", ok.detail
    blown_bias = {"w": parent["w"], "bias": torch.full((64,), 1.0)}
    c = weight_sanity(blown_bias, parent, 0.5, 2.0)[1]
    assert c.status == "fail" and "bias" in c.detail, c.detail
    planted = {"w": parent["w"] * 64.0, "bias": parent["bias"]}
    c = weight_sanity(planted, parent, 0.5, 2.0)[1]
    assert c.status == "fail" and "w" in c.detail, c.detail


def test_kl_and_regression_checks_by_hand():
    cand = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    champ = cand - 0.1  # candidate is 0.1 nats more likely on each of its own 3 tokens
    assert kl_check(cand, champ, [2, 1], max_kl=None).status == "info"
    c = kl_check(cand, champ, [2, 1], max_kl=0.05)
    assert c.value == pytest.approx(0.1) and c.status == "fail"
    assert kl_check(cand, champ, [2, 1], max_kl=0.2).status == "pass"
    r = regression_check(
        champ, cand, [2, 1], tolerance=0.05
    )  # candidate's NLL is 0.1 higher per token
    assert r.value == pytest.approx(0.1) and r.status == "fail"


def test_behaviour_monitors_catch_empty_and_length_collapse():
    champ = [10, 12, 8, 11, 9, 10]
    ok = behaviour_checks([11, 9, 10, 12, 8, 10], champ, max_empty_increase=0.1, length_k_std=2.0)
    assert [c.status for c in ok] == ["pass", "pass", "skipped"]
    hacked = behaviour_checks(
        [0, 0, 0, 1, 0, 0], champ, max_empty_increase=0.1, length_k_std=2.0, tool_error=(0.5, 0.1)
    )
    assert [c.status for c in hacked] == ["fail", "fail", "fail"]


def test_the_tool_error_estimate_follows_the_reward_estimate_ess_rule():
    """Measured in the demo: a version whose reward estimate was inconclusive (ESS 7.7 of 60) was
    failed on the tool-error estimate made with the same weights (0.203 vs 0.083 logged), though it
    was the best version so far on held-out users. Both estimates follow one rule."""
    champ = [10, 12, 8, 11, 9, 10]
    cand = [11, 9, 10, 12, 8, 10]
    kw = {
        "max_empty_increase": 0.1,
        "length_k_std": 2.0,
        "tool_error": (0.203, 0.083),
        "min_ess": 20.0,
    }
    [*_, low] = behaviour_checks(cand, champ, tool_error_ess=7.7, **kw)
    assert low.status == "skipped" and "effective sample size" in low.detail and low.value == 7.7
    [*_, strict] = behaviour_checks(cand, champ, tool_error_ess=7.7, require_ess=True, **kw)
    assert strict.status == "fail"
    [*_, enough] = behaviour_checks(cand, champ, tool_error_ess=40.0, **kw)
    assert enough.status == "fail" and enough.value == 0.203  # a confident estimate still gates


# --- the gate end to end on tiny real policies --------------------------------------------------
def logged_rollouts(behaviour: UnigramPolicy, n: int, reward_of) -> list[dict]:
    prompts = [[65 + i % 5] for i in range(n)]
    samples = behaviour.generate(prompts, max_tokens=6, seed=11)
    return [
        {
            "prompt_tokens": p,
            "completion_tokens": s.tokens,
            "logprobs": s.logprobs,
            "reward": reward_of(s.tokens),
            "tool_errors": [],
        }
        for p, s in zip(prompts, samples)
    ]


CFG = GateConfig(n_boot=100, sample_prompts=8, max_tokens=8, min_ess=5)


def test_a_trajectory_is_weighed_on_the_tokens_the_model_sampled_only():
    """Tool results between turns (loss_mask 0, behaviour 0.0) weigh nothing in the estimate."""
    cand = favouring([97], 3.0)
    prompt, completion = [65], [97, 120, 121, 98, 97]  # turn, tool result (2 tokens), turn
    mask, behaviour = [1, 0, 0, 1, 1], [-0.5, 0.0, 0.0, -1.0, -0.25]
    record = {"prompt_tokens": prompt, "completion_tokens": completion, "logprobs": behaviour}
    new = cand.logprobs([prompt], [completion], routes=None, temperature=1.0)[0].tolist()
    want = sum(n - b for n, b, m in zip(new, behaviour, mask) if m)
    [got] = log_weights(cand, [{**record, "loss_mask": mask}])
    assert got == pytest.approx(want, abs=1e-9)
    [unmasked] = log_weights(cand, [record])  # a one-call record: every token counts
    assert unmasked == pytest.approx(sum(n - b for n, b in zip(new, behaviour)), abs=1e-9)
    assert abs(unmasked - got) > 1.0  # the tool result's tokens would have moved it


def reward_a(tokens):  # reward: share of tokens that are 'a'
    return sum(t == 97 for t in tokens) / max(len(tokens), 1)


def test_gate_passes_a_mild_improvement_and_records_tags():
    champ = favouring([97, 98, 99], 3.0)
    cand = favouring([97, 98, 99], 3.0)
    with torch.no_grad():
        cand.logits[97] += 0.3  # a little more 'a': better reward, small KL
    res = run_gate(
        GateInputs(
            candidate_state=cand.serving_state_dict(),
            parent_state=champ.serving_state_dict(),
            candidate=cand,
            champion=champ,
            rollouts=logged_rollouts(champ, 200, reward_a),
        ),
        CFG,
    )
    assert res.passed, res.summary()
    names = {c.name: c.status for c in res.checks}
    assert names["ope_reward"] == "pass" and names["weights_finite"] == "pass"
    assert names["reward_vs_champion"] == "pass" and names["kl_to_champion"] == "info"
    assert res.ope["dr"] is not None and res.ope["ess"] > 5
    assert res.ope["snips"] > res.ope["behaviour_value"], "more 'a' must estimate a higher reward"
    tags = res.tags()
    assert tags["flywheel.gate.status"] == "passed" and "flywheel.gate.ope.dr" in tags
    assert res.decision("2", "1").type == "gate_passed"


def test_gate_fails_a_policy_that_learned_to_say_nothing():
    champ = favouring([97, 98, 99], 3.0)
    hacker = favouring([256], 8.0)  # emits EOS right away: empty completions, huge KL
    res = run_gate(
        GateInputs(
            candidate_state=hacker.serving_state_dict(),
            parent_state=None,
            candidate=hacker,
            champion=champ,
            rollouts=logged_rollouts(champ, 100, reward_a),
        ),
        CFG,
    )
    failed = {c.name for c in res.failed}
    # the reward model never saw an empty completion logged, so its prediction for one is the mean
    # (no verdict either way): the behaviour monitor is what catches it
    assert not res.passed and "empty_completion_rate" in failed, res.summary()
    kl = next(c for c in res.checks if c.name == "kl_to_champion")
    assert kl.status == "info" and kl.value > 1.0, "the KL is recorded, not a verdict"
    strict = run_gate(
        GateInputs(
            candidate_state=hacker.serving_state_dict(),
            parent_state=None,
            candidate=hacker,
            champion=champ,
            rollouts=logged_rollouts(champ, 100, reward_a),
        ),
        CFG.model_copy(update={"max_kl": 0.5}),
    )
    assert "kl_to_champion" in {c.name for c in strict.failed}, "a configured bound still fails"
    d = res.decision("3", "1")
    assert d.type == "gate_failed" and "empty_completion_rate" in d.reason


def test_gate_stops_a_nan_checkpoint_before_running_anything():
    champ = favouring([97], 3.0)
    state = champ.serving_state_dict()
    state["logits"] = state["logits"].clone()
    state["logits"][5] = float("nan")
    res = run_gate(
        GateInputs(candidate_state=state, parent_state=champ.serving_state_dict(), candidate=None),
        CFG,
    )
    assert not res.passed and [c.name for c in res.checks] == ["weights_finite", "weight_change"]


def test_gate_without_policies_or_data_skips_honestly():
    champ = favouring([97], 3.0)
    res = run_gate(
        GateInputs(
            candidate_state=champ.serving_state_dict(), parent_state=champ.serving_state_dict()
        ),
        CFG,
    )
    assert res.passed
    assert {c.name: c.status for c in res.checks}["ope_reward"] == "skipped"
    assert "skipped" in res.decision("2", "1").reason


# --- the quality verdict: predicted reward of the candidate's own completions vs the champion's ----
def test_text_reward_model_learns_a_taste_it_is_not_told():
    """Users like completions that start with `return` (the simulator's hidden taste, here as data)."""
    rng = np.random.default_rng(0)
    texts, rewards = [], []
    for _ in range(600):
        direct = rng.random() < 0.3
        body = (
            "return a + b"
            if direct
            else rng.choice(["x = a\n    return x", "if a:\n        pass", "s = 0"])
        )
        texts.append(str(body) + " " * int(rng.integers(0, 3)))
        rewards.append((1.6 if direct else -0.3) + rng.normal(0, 0.3))
    m = ope.TextRewardModel().fit(texts, rewards)
    assert m.cv_r2 > 0.8, m.cv_r2
    direct, other = m.predict(["return b - a", "y = 1\n    return y"])
    assert direct - other > 0.7, (
        direct,
        other,
    )  # unseen texts: shrunk towards the mean, same order


def test_paired_difference_interval_by_hand():
    c = np.array([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    h = np.zeros((3, 2))
    diff, (lo, hi) = ope.paired_difference(c, h, n_boot=400)
    assert diff == pytest.approx(0.5)  # prompt means 1, 0, 0.5
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0


def reward_b(tokens):  # reward: share of tokens that are 'b'
    return sum(t == 98 for t in tokens) / max(len(tokens), 1)


def test_gate_judges_quality_against_the_champion_in_both_directions():
    """A clearly worse candidate fails on reward_vs_champion even though its KL is small, and a
    clearly better one passes even though it moved far (large KL), where the sequence-level
    importance weights collapse (ope_reward skipped for its ESS)."""
    champ = favouring([97, 98, 99], 5.0)  # ~21% 'b'
    logged = logged_rollouts(champ, 300, reward_b)
    worse = favouring([97, 98, 99], 5.0)
    better = favouring([98], 5.0)  # ~37% 'b'
    with torch.no_grad():
        worse.logits[98] -= 2.0  # ~5% 'b'
    cfg = CFG.model_copy(update={"sample_prompts": 32, "samples_per_prompt": 4, "min_ess": 20})
    res_w = run_gate(
        GateInputs(
            candidate_state=worse.serving_state_dict(),
            parent_state=champ.serving_state_dict(),
            candidate=worse,
            champion=champ,
            rollouts=logged,
        ),
        cfg,
    )
    checks_w = {c.name: c for c in res_w.checks}
    assert checks_w["reward_vs_champion"].status == "fail", checks_w["reward_vs_champion"].detail
    assert checks_w["kl_to_champion"].value < 0.2
    res_b = run_gate(
        GateInputs(
            candidate_state=better.serving_state_dict(),
            parent_state=champ.serving_state_dict(),
            candidate=better,
            champion=champ,
            rollouts=logged,
        ),
        cfg,
    )
    checks_b = {c.name: c for c in res_b.checks}
    assert (
        checks_b["reward_vs_champion"].status == "pass"
        and checks_b["reward_vs_champion"].value > 0.03
    ), checks_b["reward_vs_champion"].detail
    assert checks_b["kl_to_champion"].value > 0.5 and checks_b["kl_to_champion"].status == "info"
    assert res_b.ope["reward_model"]["n"] == 300


def test_reward_comparison_is_skipped_without_enough_logged_data():
    champ = favouring([97, 98, 99], 2.0)
    cand = favouring([97, 98, 99], 2.0)
    res = run_gate(
        GateInputs(
            candidate_state=cand.serving_state_dict(),
            parent_state=champ.serving_state_dict(),
            candidate=cand,
            champion=champ,
            rollouts=logged_rollouts(champ, 40, reward_b),
        ),
        CFG,
    )
    c = {c.name: c for c in res.checks}["reward_vs_champion"]
    assert c.status == "skipped" and "40 logged rollouts" in c.detail


def test_the_demos_planted_version_of_an_hf_moe_model_fails_the_weight_check(tmp_path):
    """`flywheel run`'s planted version (trainer/shipping.plant_bad_weights: the largest matrix
    x64) on a Qwen2-MoE's serving weights fails the gate's weight check; one optimizer-sized
    nudge of every tensor, the zero-initialized q/k/v biases included, passes it."""
    from policy import build_policy
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer
    from trainer.shipping import plant_bad_weights

    model = tiny_qwen2_moe_dir(tmp_path / "moe", train_bpe_tokenizer(tmp_path / "tok"))
    serving = build_policy({"type": "hf", "model_dir": str(model)}).serving_state_dict()
    assert any(k.endswith("k_proj.bias") and not v.any() for k, v in serving.items())
    nudged = {k: (v.float() + 1e-3).to(v.dtype) for k, v in serving.items()}
    ok = weight_sanity(nudged, serving, 0.5, 2.0)[1]
    assert ok.status == "pass", ok.detail
    planted = plant_bad_weights(serving)
    (blown,) = [k for k in serving if not torch.equal(planted[k], serving[k])]
    c = weight_sanity(planted, serving, 0.5, 2.0)[1]
    assert c.status == "fail" and f"in {blown} " in c.detail, c.detail


def test_the_paired_comparison_samples_the_given_prompts_not_only_the_few_held_out_ones():
    """A trainer that keeps up leaves a handful of rollouts it did not train on: the comparison of
    candidate and champion samples then runs on the newest distinct logged prompts (gate_io), not
    on those few (7-14 prompts in a demo run, where an equal version failed on its noise)."""
    from app.controller.gate import distinct_prompts

    champ = favouring([97, 98, 99], 5.0)
    worse = favouring([97, 98, 99], 5.0)
    with torch.no_grad():
        worse.logits[98] -= 2.0
    logged = logged_rollouts(champ, 300, reward_b)
    many = [[65 + i % 5, 70 + i // 5] for i in range(40)]
    grouped = [{"prompt_tokens": p} for p in many for _ in range(2)]  # groups of two share one
    assert distinct_prompts(grouped) == many[::-1]
    cfg = CFG.model_copy(update={"sample_prompts": 32, "samples_per_prompt": 4})
    details = {}
    for name, prompts in (("held-out only", None), ("given", distinct_prompts(grouped))):
        res = run_gate(
            GateInputs(
                candidate_state=worse.serving_state_dict(),
                parent_state=champ.serving_state_dict(),
                candidate=worse,
                champion=champ,
                rollouts=logged[-3:],
                reward_rollouts=logged,
                prompts=prompts,
            ),
            cfg,
        )
        details[name] = {c.name: c for c in res.checks}["reward_vs_champion"].detail
    assert "over 3 prompts x 4" in details["held-out only"], details
    assert "over 32 prompts x 4" in details["given"], details
