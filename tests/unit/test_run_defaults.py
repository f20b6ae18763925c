"""`flywheel run`'s demo cadence only sets variables some settings class reads, with valid values."""

from __future__ import annotations

from app.config_reference import known_env_names, settings_classes
from app.run import DEMO_ENV


def test_demo_env_names_are_known_settings():
    unknown = sorted({k for k in DEMO_ENV if k.startswith("FLYWHEEL_")} - known_env_names())
    assert not unknown, f"DEMO_ENV sets variables no settings class reads: {unknown}"


def test_demo_env_values_validate(monkeypatch):
    for name, value in DEMO_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLYWHEEL_PROFILE", "local")
    for cls in settings_classes():
        cls()  # raises a ValidationError naming the bad variable


def test_roles_started_together_have_distinct_default_ports():
    from app.controller.config import ControllerSettings as ControllerConfig
    from app.settings import Settings
    from streams.config import StreamsConfig
    from trainer.config import TrainerConfig

    ports = {
        "api": Settings().api_port,
        "streams metrics": StreamsConfig().metrics_port,
        "trainer metrics": TrainerConfig().metrics_port,
        "controller metrics": ControllerConfig().metrics_port,
    }
    assert len(set(ports.values())) == len(ports), (
        f"default ports collide under `flywheel run`: {ports}"
    )


# a stand-in for `flywheel run`: installs its signal handling, then waits as the run's view does
# (on STOP, in a try/except KeyboardInterrupt). A signal that lands while the interpreter runs a
# finaliser has its KeyboardInterrupt swallowed; the handler's STOP still ends the wait, as in the run.
_RUN_LIKE = (
    "from app.run import STOP, _stop_on_signals\n_stop_on_signals()\n"
    "try:\n    print('ready', flush=True)\n    STOP.wait(120)\n"
    "    print('cleanup ran' if STOP.is_set() else 'no signal came', flush=True)\n"
    "except KeyboardInterrupt:\n    print('cleanup ran', flush=True)\n"
)


def _signal_a_run(sig, preexec_fn=None):
    """Start the stand-in, send `sig` once it is ready; (stdout, return code)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_LIKE], stdout=subprocess.PIPE, text=True, preexec_fn=preexec_fn
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)  # the stand-in gives up waiting after 120 s
    return out, proc.returncode


def test_sigterm_stops_the_run_like_ctrl_c():
    """`flywheel run` under a process manager gets SIGTERM: it must take the Ctrl-C path (stop every
    role, which run in their own sessions) instead of dying and orphaning them."""
    import signal

    out, rc = _signal_a_run(signal.SIGTERM)
    assert "cleanup ran" in out and rc == 0, (out, rc)


def test_ctrl_c_stops_the_run_even_when_sigint_was_inherited_as_ignored():
    """A run started from a background job of a non-interactive shell inherits SIGINT as ignored
    (the test suite launched that way once, and `flywheel run` then ignored the e2e test's Ctrl-C)."""
    import signal

    out, rc = _signal_a_run(
        signal.SIGINT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
    )
    assert "cleanup ran" in out and rc == 0, (out, rc)


def test_with_a_model_the_trainer_gets_its_hf_policy_and_no_built_in_demo_tuning(tmp_path):
    """`flywheel run --model DIR`: the trainer trains DIR's HF policy at its own learning rate
    (the demo's 1e-4 and pretraining are the built-in policy's); HF options already set in
    FLYWHEEL_TRAINER_POLICY are kept; the rest of the demo cadence is the same."""
    import json

    import pytest

    from app.run import HF_DEMO_SKIP, RunModelError, demo_env

    model = tmp_path / "my-model"
    assert demo_env(None, {}) == DEMO_ENV
    env = demo_env(model, {})
    assert json.loads(env["FLYWHEEL_TRAINER_POLICY"]) == {"type": "hf", "model_dir": str(model)}
    assert env["FLYWHEEL_MODEL_DIR"] == str(model)
    assert set(HF_DEMO_SKIP) <= set(DEMO_ENV) and not set(HF_DEMO_SKIP) & set(env)
    assert {k: v for k, v in env.items() if k in DEMO_ENV} == {
        k: v for k, v in DEMO_ENV.items() if k not in HF_DEMO_SKIP
    }
    kept = demo_env(model, {"FLYWHEEL_TRAINER_POLICY": '{"type": "hf", "kernels": "default"}'})
    assert json.loads(kept["FLYWHEEL_TRAINER_POLICY"]) == {
        "type": "hf",
        "kernels": "default",
        "model_dir": str(model),
    }
    with pytest.raises(RunModelError, match="built-in policy"):
        demo_env(model, {"FLYWHEEL_TRAINER_POLICY": '{"d_model": 32}'})


def test_agents_run_the_loop_on_agent_sessions_with_their_defaults(tmp_path):
    """`flywheel run --agents`: the agent users, the sessions spec, the gate's agent checks, and for
    the built-in policy a 1,024-token context pretrained on agent sessions; a variable already set
    wins, and `--model DIR` keeps its own context and weights."""
    import json

    from app.run import AGENT_DEMO_ENV, AGENT_HF_SKIP, demo_env

    env = demo_env(None, {}, agents=True)
    assert env["FLYWHEEL_SIMULATE_AGENTS"] == "true"
    assert env["FLYWHEEL_STREAMS_REWARD_SPEC"] == "sessions-v1"
    assert env["FLYWHEEL_CONTROLLER_GATE_AGENT_TASKS"] == "12"
    assert json.loads(env["FLYWHEEL_TRAINER_POLICY"]) == {"max_context": 1024}
    assert env["FLYWHEEL_TRAINER_PRETRAIN_AGENT_SHARE"] == "0.7"
    assert env["FLYWHEEL_TRAINER_PRETRAIN_STEPS"] == "700"
    assert env["FLYWHEEL_TRAINER_PRETRAIN_THREADS"] == "0"  # the base takes the machine
    # mid-trained past every verb's onset and scaled back to 0.4, then groups of 4 with
    # positive-only advantages at 1e-4
    assert env["FLYWHEEL_TRAINER_PRETRAIN_MID_TARGET"] == "0.4"
    assert env["FLYWHEEL_TRAINER_PRETRAIN_MID_PEAK"] == "0.7"
    assert env["FLYWHEEL_TRAINER_PRETRAIN_MID_STEPS"] == "400"
    assert env["FLYWHEEL_TRAINER_PRETRAIN_MID_LINES"] == "3"  # the best-separated of three kept
    assert env["FLYWHEEL_SIMULATE_AGENT_PARALLEL"] == "4"
    assert env["FLYWHEEL_TRAINER_ADV_NEGATIVE_SCALE"] == "0"
    assert env["FLYWHEEL_TRAINER_ADV_SCALE"] == "none"  # in reward units (Dr. GRPO)
    assert env["FLYWHEEL_TRAINER_ADV_POSITIVE_NEEDS_SUCCESS"] == "true"  # only successes pushed up
    assert env["FLYWHEEL_TRAINER_DISTILL_COEF"] == "0"  # self-distillation on tool errors off
    # broken calls are not pushed down on their own: measured in runs 16 and 17, not adopted
    assert "FLYWHEEL_TRAINER_ERROR_TURN_ADVANTAGE" not in env
    # training waits for the verdict on a version 3 ahead of the champion
    assert env["FLYWHEEL_TRAINER_VERDICT_WAIT_AHEAD"] == "3"
    # agent turns at 0.6 live, held-out and in the gate; steps of 16 whole sessions at 1e-4
    assert env["FLYWHEEL_SIMULATE_AGENT_TEMPERATURE"] == "0.6"
    assert env["FLYWHEEL_CONTROLLER_GATE_AGENT_TEMPERATURE"] == "0.6"
    assert (env["FLYWHEEL_TRAINER_MAX_WAIT_S"], env["FLYWHEEL_TRAINER_LR"]) == ("60", "1e-4")
    assert {k: env[k] for k in DEMO_ENV if k not in AGENT_DEMO_ENV} == {
        k: v for k, v in DEMO_ENV.items() if k not in AGENT_DEMO_ENV
    }
    assert "FLYWHEEL_SIMULATE_AGENTS" not in demo_env(None, {})
    assert "FLYWHEEL_SIMULATE_USERS" not in demo_env(None, {"FLYWHEEL_SIMULATE_USERS": "3"}, True)
    model = tmp_path / "my-model"
    hf = demo_env(model, {}, agents=True)
    assert json.loads(hf["FLYWHEEL_TRAINER_POLICY"]) == {"type": "hf", "model_dir": str(model)}
    assert hf["FLYWHEEL_SIMULATE_AGENTS"] == "true"
    assert "FLYWHEEL_TRAINER_PRETRAIN_AGENT_SHARE" not in hf and set(AGENT_HF_SKIP) <= set(
        AGENT_DEMO_ENV
    )
    for built_in_only in (
        "MAX_WAIT_S",
        "LR",
        "AGENT_TEMPERATURE",
        "MID_TARGET",
        "MID_PEAK",
        "NEGATIVE_SCALE",
        "DISTILL_COEF",
    ):
        assert not [k for k in hf if k.endswith(f"_{built_in_only}")], built_in_only


def test_model_dir_must_be_a_model_directory(tmp_path, monkeypatch):
    import pytest
    from pydantic import ValidationError

    from app.settings import Settings

    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tmp_path))
    with pytest.raises(
        ValidationError, match="FLYWHEEL_MODEL_DIR .* not a Hugging Face model directory"
    ):
        Settings()
    (tmp_path / "config.json").write_text("{}")
    assert Settings().model_dir == tmp_path
