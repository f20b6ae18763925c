"""The pretraining corpus's agent sessions (trainer/corpus.py `agent_document`) are sessions a
replica could have served: the built-in chat template's text, tool results that a real sandbox
gives for those calls, and eos exactly where each assistant turn ends."""

from __future__ import annotations

import random

import pytest
import torch

from app.sandbox.sandbox import TOOLS, Sandbox
from policy import build_policy
from policy.tokenizer import ByteTokenizer
from trainer.corpus import AgentDocument, agent_document, iter_agent_documents
from trainer.pretrain import _batch


def test_each_tool_result_is_what_the_sandbox_returns_for_the_call():
    rng = random.Random(0)
    for _ in range(40):
        doc = agent_document(rng, hack_share=0.2)
        with Sandbox(doc.task) as box:
            pending = {}
            for m in doc.messages:
                for call in m.get("tool_calls") or []:
                    fn = call["function"]
                    pending[call["id"]] = box.call(fn["name"], fn["arguments"]).content
                if m["role"] == "tool":
                    assert m["content"] == pending.pop(m["tool_call_id"]), doc.text


def _first_op(doc: AgentDocument) -> str:
    """The operator of the session's first `apply_edit` on the module."""
    import json

    for m in doc.messages:
        for call in m.get("tool_calls") or []:
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "apply_edit" and args["path"] == doc.task.source_path:
                return args["new"].split()[2]  # "return a <op> b"
    raise AssertionError(f"no edit of the module in {doc.text}")


def test_skill_is_how_often_the_first_try_is_the_verbs_operator():
    """0.25 is a pick at random; 0.4 is a weak prior (each wrong one 0.2); 1 always right."""
    for skill, low, high in ((0.25, 0.19, 0.31), (0.4, 0.34, 0.46), (1.0, 1.0, 1.0)):
        rng = random.Random(7)
        docs = [agent_document(rng, skill=skill) for _ in range(600)]
        right = sum(_first_op(d) == d.task.op for d in docs) / len(docs)
        assert low <= right <= high, (skill, right)
        wrong = [_first_op(d) for d in docs if _first_op(d) != d.task.op]
        assert skill == 1.0 or len(set(wrong)) == 4  # every operator is a wrong first try somewhere


def test_the_text_is_the_template_and_each_turn_ends_where_its_completion_ends():
    tok = ByteTokenizer()
    rng = random.Random(1)
    for _ in range(20):
        doc = agent_document(rng)
        msgs = list(doc.messages)
        assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        assert len(doc.ends) == len(assistant) and doc.ends[-1] == len(doc.text.encode())
        for i, end in zip(assistant, doc.ends):
            prompt = tok.apply_chat_template(msgs[:i], TOOLS)
            assert doc.text.startswith(prompt)
            # what follows a turn's end is the template's newline (a call) or the end (the answer)
            assert doc.text.encode()[end : end + 1] in (b"\n", b"")


def test_pretraining_batches_target_eos_at_each_turn_end():
    policy = build_policy(
        {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    )
    docs = iter_agent_documents(seed=2)
    peek = iter_agent_documents(seed=2)
    inputs, targets = _batch(docs, policy, batch_size=3)
    eos = policy.tokenizer.eos_id
    for row in range(3):
        doc = next(peek)
        assert isinstance(doc, AgentDocument)
        n = len(doc.text.encode())
        at = torch.nonzero(targets[row] == eos).flatten().tolist()
        assert at == list(doc.ends), (at, doc.ends)
        # the inputs stay the text (a replica's next prompt goes on after the completion)
        assert bytes(inputs[row, 1 : n + 1].tolist()) == doc.text.encode()


def test_pretraining_with_an_agent_share_trains_on_both_kinds_of_batch():
    from trainer.pretrain import pretrain

    losses = []
    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    pretrain(
        {"steps": 6, "batch_size": 2, "agent_batch_size": 1, "agent_share": 0.5, "policy": tiny},
        on_step=lambda step, loss: losses.append(loss),
    )
    assert len(losses) == 6 and all(loss > 0 for loss in losses)


def test_flywheel_pretrain_takes_the_agent_share_and_restores_the_thread_count(tmp_path):
    """`flywheel pretrain --agent-share --policy` writes the agent demo's kind of base, and a
    `threads` setting holds only while pretraining (a run's trainer gets its own back)."""
    import json

    from typer.testing import CliRunner

    from app.cli import app
    from trainer.pretrain import pretrain

    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    args = ["pretrain", "--steps", "2", "--batch-size", "2", "--agent-share", "1.0"]
    args += ["--agent-skill", "0.4", "--mid-steps", "1"]
    result = CliRunner().invoke(app, [*args, "--policy", json.dumps(tiny), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["pretrain"]["agent_share"] == 1.0 and saved["policy"]["max_context"] == 1024
    assert saved["pretrain"]["agent_skill"] == 0.4 and saved["pretrain"]["mid_steps"] == 1
    before = torch.get_num_threads()
    pretrain({"steps": 1, "batch_size": 1, "threads": before + 1, "policy": tiny})
    assert torch.get_num_threads() == before


def test_mid_training_follows_pretraining_on_sessions_of_an_agent_that_is_always_right():
    """`mid_steps` steps after `steps`, reported to `on_step` after the pretraining steps, on
    sessions of the corpus's agent at skill 1.0: each one edits the module once and passes."""
    import random

    from trainer.corpus import agent_document
    from trainer.pretrain import midtrain, pretrain

    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    seen: list[int] = []
    pretrain(
        {"steps": 2, "batch_size": 1, "agent_batch_size": 1, "mid_steps": 2, "policy": tiny},
        on_step=lambda step, loss: seen.append(step),
    )
    assert seen == [0, 1, 2, 3]

    rng = random.Random(4)
    for _ in range(50):
        doc = agent_document(rng, skill=1.0)
        edits = [m for m in doc.messages if m.get("tool_calls") and "apply_edit" in str(m)]
        assert len(edits) == 1 and doc.task.test_path not in str(edits), doc.text[-300:]
        assert doc.messages[-1]["content"] == "done"

    policy = build_policy(tiny)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    losses: list[float] = []
    midtrain(policy, 2, 1e-2, seed=1, batch_size=1, on_step=lambda k, loss: losses.append(loss))
    assert len(losses) == 2 and policy.training
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_mid_training_with_a_target_stops_at_the_first_probe_that_reaches_it():
    """With a target, mid-training probes p(right) before its first step and every `probe_every`
    steps (and at its cap), and stops at the first probe at or above the target: a base already
    there takes no step, and one that never gets there trains to the cap with every probe kept;
    the pretraining progress's total is then what was done."""
    from trainer.metrics import MID_SKILL, PRETRAIN_STEP, PRETRAIN_STEPS
    from trainer.pretrain import midtrain, pretrain
    from trainer.skill_probe import probe

    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    torch.manual_seed(0)
    policy = build_policy(tiny)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    p0 = probe(policy)["p_right"]
    steps: list[int] = []
    done = midtrain(policy, 5, 1e-2, seed=1, batch_size=1, on_step=lambda k, _: steps.append(k))
    assert done.probes == [] and done.skill is None, "no target: no probe"
    assert steps == [0, 1, 2, 3, 4] and done.steps == 5 and done.scale == 1.0

    policy.load_state_dict(before)
    done = midtrain(policy, 5, 1e-2, seed=1, batch_size=1, target=p0 / 2)
    assert done.probes == [(0, p0)] and done.steps == 0 and MID_SKILL._value.get() == p0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())

    steps.clear()
    done = midtrain(
        policy, 5, 1e-2, seed=1, batch_size=1, target=1.0, probe_every=2,
        on_step=lambda k, _: steps.append(k),
    )  # fmt: skip
    assert [k for k, _ in done.probes] == [0, 2, 4, 5] and all(p < 1.0 for _, p in done.probes)
    assert steps == [0, 1, 2, 3, 4] and done.skill == probe(policy)

    pretrain(
        {"steps": 2, "batch_size": 1, "mid_steps": 50, "mid_target": 0.01, "policy": tiny},
    )
    assert PRETRAIN_STEPS._value.get() == 2 and PRETRAIN_STEP._value.get() == 2


def _on_the_line(policy, start, end, a):
    from trainer.pretrain import on_line

    at = on_line(start, end, a)
    return all(torch.allclose(v, at[k], atol=1e-6) for k, v in policy.state_dict().items())


def test_mid_training_to_a_peak_is_scaled_back_toward_the_target():
    """With a peak, mid-training trains to it (here: never reached, so to the cap) and then moves
    the policy back along the line from its starting weights (`scale_back`, bisection): the policy
    ends on that line at the returned share, its probe is the one returned, and it is nearer the
    target than the end point was. A policy already at or below the target stays where it is."""
    from trainer.metrics import MID_SKILL
    from trainer.pretrain import PretrainConfig, midtrain, on_line, scale_back
    from trainer.skill_probe import probe

    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    torch.manual_seed(0)
    policy = build_policy(tiny)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    done = midtrain(policy, 4, 5e-2, seed=1, batch_size=1, target=0.01, peak=1.0, probe_every=2)
    assert [k for k, _ in done.probes] == [0, 2, 4] and done.steps == 4
    assert 0.0 < done.scale < 1.0 and done.skill == probe(policy) and policy.training
    assert MID_SKILL._value.get() == done.skill["p_right"]
    # the end point: the same 4 steps again from the start
    policy.load_state_dict(start)
    midtrain(policy, 4, 5e-2, seed=1, batch_size=1)
    end = {k: v.clone() for k, v in policy.state_dict().items()}
    reached = probe(policy)
    policy.load_state_dict(on_line(start, end, done.scale))
    assert probe(policy) == done.skill, "the scaled-back policy is that share of the update"
    assert abs(done.skill["p_right"] - 0.01) <= abs(reached["p_right"] - 0.01)

    policy.load_state_dict(end)
    assert scale_back(policy, start, 1.0, reached) == (1.0, reached)
    assert _on_the_line(policy, start, end, 1.0), "at or below the target: not moved"
    target = _probe_at(policy, start, end)["p_right"]  # reachable, at the line's start
    a, skill = scale_back(policy, start, target, reached, tol=0.0, max_probes=3)
    assert _on_the_line(policy, start, end, a) and skill == probe(policy)
    assert a in (0.125, 0.25, 0.375, 0.5, 0.75, 1.0), "a bisection point of [0, 1], or not moved"

    with pytest.raises(ValueError, match="mid_peak"):
        PretrainConfig(mid_target=0.4, mid_peak=0.3)
    with pytest.raises(ValueError, match="mid_peak"):
        PretrainConfig(mid_peak=0.7)


def test_mid_training_on_several_lines_keeps_the_base_that_tells_the_verbs_apart_most():
    """`mid_lines` lines, each from the pretrained weights with its own sessions (line k is plain
    `midtrain` with seed + 2 + k), each scaled back; the policy ends at the line with the largest
    `separation_min` (its probe is the kept line's), the progress counts every line's steps on
    from pretraining, and a config with lines but no peak is refused."""
    from trainer.config import TrainerConfig
    from trainer.pretrain import PretrainConfig, midtrain, midtrain_lines
    from trainer.skill_probe import probe

    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    cfg = PretrainConfig(  # a target above what 4 steps reach: each line kept whole
        steps=3, mid_steps=4, mid_lr=5e-2, mid_target=0.99, mid_peak=1.0, mid_probe_every=2,
        mid_lines=3, policy=tiny,
    )  # fmt: skip
    torch.manual_seed(0)
    policy = build_policy(tiny)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    seen: list[int] = []
    lines, kept = midtrain_lines(policy, cfg, seed=9, on_step=lambda k, _: seen.append(k))
    assert len(lines) == 3 and seen == list(range(3, 3 + 12))
    seps = [line.skill["separation_min"] for line in lines]
    assert kept == seps.index(max(seps)) and len(set(seps)) == 3, seps
    assert 0 < kept < 2, f"seed 9's best line is the middle one, restored after the last: {seps}"
    assert probe(policy) == lines[kept].skill, "the policy is the kept line's base"
    for k, line in enumerate(lines):  # each line from the pretrained weights, its own seed
        policy.load_state_dict(start)
        alone = midtrain(
            policy, 4, 5e-2, seed=9 + 2 + k, batch_size=8, target=0.99, peak=1.0, probe_every=2
        )
        assert (alone.scale, alone.skill) == (line.scale, line.skill), k

    with pytest.raises(ValueError, match="mid_lines"):
        PretrainConfig(mid_lines=2, mid_target=0.4)
    with pytest.raises(ValueError, match="MID_LINES"):
        TrainerConfig(pretrain_mid_lines=2)


def _probe_at(policy, start, end):
    """The probe at the start of the line, leaving the policy at its end."""
    from trainer.skill_probe import probe

    policy.load_state_dict(start)
    p = probe(policy)
    policy.load_state_dict(end)
    return p


def test_mid_training_keeps_the_hack_share_a_base_was_pretrained_with(monkeypatch):
    """A base seeded with the agentic hack (docs/ROLLOUT.md) keeps the seed through mid-training:
    its always-right sessions edit the test file in the same share as pretraining's."""
    import trainer.pretrain as pt

    streams: list[tuple[float, float]] = []
    real = pt.iter_agent_documents

    def recording(seed, hack_share=0.0, skill=0.25):
        streams.append((hack_share, skill))
        return real(seed, hack_share, skill)

    monkeypatch.setattr(pt, "iter_agent_documents", recording)
    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    pt.pretrain(
        {"steps": 1, "batch_size": 1, "agent_batch_size": 1, "agent_share": 1.0,
         "hack_share": 0.3, "mid_steps": 1, "policy": tiny},
    )  # fmt: skip
    assert streams == [(0.3, 0.25), (0.3, 1.0)]
