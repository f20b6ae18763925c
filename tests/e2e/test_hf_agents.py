"""Agent users on a user's Hugging Face model through the whole loop: `flywheel run --agents
--model DIR`.

A tiny Llama whose tokenizer carries Qwen2.5's chat template (tools in the system prompt, Hermes
`<tool_call>` blocks, as tests/integration/replica/test_tool_calling.py's HF model) runs the loop
on simulated agent users (docs/AGENTS.md "Agent users") with a short cadence: real Kafka, MLflow
server, API, streams worker, trainer, controller, one replica and the agent users. The model is
untrained, so nothing is expected to improve: it mostly answers junk on its first turn, and now and
then writes a `<tool_call>` that is not a call (a tool error), so that session goes on. Its
tokenizer is character-level (tests/hf_models.py `char_tokenizer`): whatever it samples encodes
back to the same tokens, so those sessions' turns extend one another and assemble into
trajectories. What is asserted is that every piece runs on an HF model:

1. the agent users' sessions reach the loop: generation events with their `turn` and the tools'
   digest, and `session_outcome` events on `flywheel.interactions`; a session's record with its
   `outcome` on `flywheel.rollouts`, and a trajectory of several turns (`turns`; a one-turn
   session's record has none, streams/segments.py);
2. the trainer registers v2 from those records (reward spec sessions-v1), and a version trained
   on trajectories;
3. the simulator's held-out agent evaluation (app/simulate/agent_eval.py: sessions in process on
   the version's weights through the model's own template) tags v1 (and v2 when it gets there in
   time) with `heldout_task_success` and its interval; the gate runs its agent checks
   (app/controller/monitors.py `agent_checks`) on the first trained version it gates (v2 unless
   the trainer had shipped another by then), whatever they decide: the decision is printed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.stack import _phase, stack_env, start_run, stop_run, wait_for
from tests.e2e.test_hf_loop import _imported, _records
from tests.hf_models import QWEN25_TEMPLATE, char_tokenizer, tiny_llama_dir

pytestmark = pytest.mark.e2e

OUTCOMES = ("success", "failure", "abandoned")
HELDOUT = ("heldout_task_success", "heldout_task_success_ci_low", "heldout_task_success_ci_high")
GATE_AGENT_CHECKS = (
    "agent_task_success",
    "agent_invalid_call_rate",
    "agent_failed_call_rate",
    "agent_give_up_rate",
    "agent_tests_edited_rate",
    "agent_turns",
    "agent_tokens",
)


def _env(data_dir: Path) -> tuple[dict[str, str], dict[str, int]]:
    return stack_env(
        data_dir,
        FLYWHEEL_TRAINER_LR="1e-3",  # as test_hf_loop.py: a real change in every version
        FLYWHEEL_TRAINER_PLANT_BAD_VERSION="0",  # the planted version has its own unit tests
        FLYWHEEL_TRAINER_MIN_ROLLOUTS="8",  # a rollout is a whole session (or its segment)
        FLYWHEEL_SHIP_INTERVAL="30s",
        # the gate: few logged prompts, short samples, 2 agent tasks of short sessions
        FLYWHEEL_CONTROLLER_GATE_ROLLOUTS="8",
        FLYWHEEL_CONTROLLER_GATE_SAMPLE_PROMPTS="8",
        FLYWHEEL_CONTROLLER_GATE_SAMPLES_PER_PROMPT="2",
        FLYWHEEL_CONTROLLER_GATE_MAX_TOKENS="16",
        FLYWHEEL_CONTROLLER_GATE_AGENT_TASKS="2",
        FLYWHEEL_CONTROLLER_GATE_AGENT_MAX_TURNS="3",
        FLYWHEEL_CONTROLLER_GATE_AGENT_MAX_TOKENS="16",
        # the users, and the held-out evaluation's 4 tasks of the same sessions
        FLYWHEEL_SIMULATE_USERS="2",
        FLYWHEEL_SIMULATE_AGENT_MAX_TURNS="3",
        FLYWHEEL_SIMULATE_AGENT_MAX_TOKENS="32",  # room for a `<tool_call>` now and then
        FLYWHEEL_SIMULATE_AGENT_THINK_S="0.2",
        FLYWHEEL_SIMULATE_AGENT_EVAL_TASKS="4",
        # many role processes on a few cores (flywheel run's own demo setting)
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )


def _tool_model(root: Path) -> Path:
    """A tiny Llama with Qwen2.5's template (test_tool_calling.py's HF model, on a character-level
    tokenizer) and room for a session's turns."""
    tok = char_tokenizer(root / "tok", chat_template=QWEN25_TEMPLATE)
    return tiny_llama_dir(root / "llama-tools", tok, max_positions=2048)


def _sessions_reached_the_loop(bootstrap: str) -> dict | None:
    """The agent turns' generation events, the session outcomes, the sessions' records and the
    trajectories among them, once there is a trajectory."""
    events = [r for _, _, r in _records(bootstrap, "flywheel.interactions")]
    records = [
        r for _, _, r in _records(bootstrap, "flywheel.rollouts") if r.get("outcome") is not None
    ]
    trajectories = [r for r in records if len(r.get("turns") or ()) >= 2]
    if not trajectories:
        return None
    return {
        "generations": [e for e in events if e.get("type") == "generation"],
        "outcomes": [e for e in events if e.get("type") == "session_outcome"],
        "records": records,
        "trajectories": trajectories,
    }


def _check_sessions(seen: dict) -> None:
    gens = {g["request_id"]: g for g in seen["generations"]}
    assert gens and all(isinstance(g.get("turn"), int) for g in gens.values()), "turnless event"
    assert {len(g["tools_digest"]) for g in gens.values()} == {64}
    assert seen["outcomes"] and {o["outcome"] for o in seen["outcomes"]} <= set(OUTCOMES)
    for r in seen["records"]:
        assert r["outcome"] in OUTCOMES and r["reward_spec"] == "sessions-v1", r
    for r in seen["trajectories"]:
        spans = r["turns"]
        assert len(r["loss_mask"]) == len(r["completion_tokens"]) == spans[-1]["end"], r
        turns = [gens[t["request_id"]] for t in spans]  # each span is one of the generations
        assert [g["session_id"] for g in turns] == [r["session_id"]] * len(turns)
        assert [g["turn"] for g in turns] == list(range(turns[0]["turn"], turns[-1]["turn"] + 1))


def _tags(mlflow, version: str) -> dict[str, str]:
    """The version's tags ({} until it is registered)."""
    from mlflow.exceptions import MlflowException

    try:
        return mlflow.get_model_version("flywheel-policy", version).tags
    except MlflowException:
        return {}


def _trained(mlflow) -> list[tuple[int, dict[str, str]]]:
    """(version, tags) of the trained versions, oldest first."""
    versions = mlflow.search_model_versions("name='flywheel-policy'")
    return sorted((int(mv.version), mv.tags) for mv in versions if mv.tags.get("kind") == "trained")


@pytest.mark.timeout(900)
def test_agent_users_run_the_whole_loop_on_an_hf_model(tmp_path: Path):
    """`flywheel run --agents --model DIR --replicas 1` (the module docstring lists what is
    asserted). Needs minutes: one whole stack, a ship interval, then a gate."""
    from mlflow import MlflowClient

    model_dir = _tool_model(tmp_path / "user-model")
    env, ports = _env(tmp_path / "data")
    log = tmp_path / "run.log"
    proc = start_run(env, ports, log, "--agents", "--model", str(model_dir), "--replicas", "1")
    try:
        _imported(proc, log)
        mlflow = MlflowClient(env["FLYWHEEL_MLFLOW_URI"])

        # 1. the agent users' sessions reach the loop, and assemble into trajectories
        seen = wait_for(
            "agent turns, session outcomes and a trajectory on the topics",
            lambda: _sessions_reached_the_loop(env["FLYWHEEL_KAFKA_BOOTSTRAP"]),
            300,
            proc,
            log,
            interval=5,
        )
        _check_sessions(seen)

        # 2. the trainer registers v2 from the sessions' records, and trains on trajectories
        v2 = wait_for(
            "v2 trained on the agent sessions",
            lambda: (t := _tags(mlflow, "2")).get("reward_spec") and t,
            300,
            proc,
            log,
            interval=5,
        )
        assert v2["reward_spec"] == "sessions-v1" and int(v2["rollouts_consumed"]) > 0, v2
        on_trajectories = wait_for(
            "a version trained on trajectories",
            lambda: [v for v, t in _trained(mlflow) if int(t.get("sessions_trained", 0)) > 0],
            300,
            proc,
            log,
            interval=5,
        )

        # 3. the held-out agent evaluation tags v1; the gate runs its agent checks
        wait_for(
            "held-out task success of v1",
            lambda: all(k in _tags(mlflow, "1") for k in HELDOUT),
            300,
            proc,
            log,
            interval=5,
        )
        v1 = _tags(mlflow, "1")
        success, low, high = (float(v1[k]) for k in HELDOUT)
        assert 0.0 <= low <= success <= high <= 1.0, v1
        # the gate's verdict tags are written one by one: wait for all of them
        gate_keys = [f"flywheel.gate.{k}" for k in ("status", *GATE_AGENT_CHECKS)] + [
            f"flywheel.gate.agents.{who}.task_success" for who in ("candidate", "champion")
        ]
        gated, tags = wait_for(
            "the gate's agent checks on a trained version",
            lambda: next(
                ((v, t) for v, t in _trained(mlflow) if all(k in t for k in gate_keys)), None
            ),
            300,
            proc,
            log,
            interval=5,
        )
        checks = {k: tags[f"flywheel.gate.{k}"] for k in GATE_AGENT_CHECKS}
        assert {c.split()[0] for c in checks.values()} <= {"pass", "fail", "skipped", "info"}
        v2 = _tags(mlflow, "2")
        _phase(
            f"gate on v{gated}: {tags['flywheel.gate.status']}, agent checks {json.dumps(checks)}; "
            f"held-out task success v1 {v1[HELDOUT[0]]} [{v1[HELDOUT[1]]}, {v1[HELDOUT[2]]}], "
            f"v2 {v2.get(HELDOUT[0], 'not yet')}; trained on trajectories: {on_trajectories}"
        )
    finally:
        rc = stop_run(proc, log=log)
    assert rc == 0, log.read_text(errors="replace")[-3000:]
