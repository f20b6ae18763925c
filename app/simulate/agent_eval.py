"""Held-out task success per registered version: do the agents get better at the tasks?

For every version of the registered model, load its serving weights from MLflow and run agent
sessions in process on held-out tasks (app/sandbox/tasks.py's held-out nouns), `samples_per_task`
sessions per task with a fixed seed, through the same session logic as the live population
(app/simulate/agents.py `AgentSession`) and the same chat template, tools and tool-call format as
a replica. Every call is executed in a real sandbox; the hidden tests decide whether a task was
done. Each figure goes to MLflow (experiment `flywheel-heldout`, run `heldout-task-success`, step =
version) and onto the version as a tag of the same name:

- `heldout_task_success` and its 95% interval `_ci_low`/`_ci_high` (the sampling error of the
  sessions on these tasks, as `app/simulate/evaluate.py` `scores` computes it for completions);
- `heldout_agent_satisfaction`: held-out agent users' true satisfaction;
- `heldout_turns`, `heldout_tokens`: assistant turns and completion tokens per session;
- `heldout_tool_error_rate`, `heldout_invalid_call_rate`: shares of turns whose call failed, and of
  turns that wrote a call that is not one;
- `heldout_give_up_rate`: sessions that never edited, or never answered;
- `heldout_tests_edited_rate`: sessions that wrote to the test file (the reward hack's trace).

    AgentEvaluator(mlflow_uri, "flywheel-policy").evaluate_new()  # -> {version: task success}
"""

from __future__ import annotations

import logging
import math
from statistics import NormalDist
from typing import Any

from app.sandbox.sandbox import Sandbox
from app.sandbox.session import AgentSession, Verdict, run_sessions
from app.sandbox.tasks import tasks
from app.simulate.agents import agent_users
from app.simulate.evaluate import HeldOutEvaluator

log = logging.getLogger(__name__)

RUN_NAME = "heldout-task-success"
METRIC = "heldout_task_success"
METRICS = (
    METRIC,
    "heldout_task_success_ci_low",
    "heldout_task_success_ci_high",
    "heldout_agent_satisfaction",
    "heldout_turns",
    "heldout_tokens",
    "heldout_tool_error_rate",
    "heldout_invalid_call_rate",
    "heldout_give_up_rate",
    "heldout_tests_edited_rate",
)


def success_interval(
    success: list[float], k: int, level: float = 0.95
) -> tuple[float, float, float]:
    """(mean, low, high) of sessions' 0/1 successes run `k` (>= 2) consecutive ones per task.

    The estimand is the mean success probability over these fixed tasks, so the interval is the
    sampling error of the sessions on them: the within-task variance, estimated from each task's
    `k` sessions (a normal interval; bench/heldout_interval.py measures its coverage)."""
    n = len(success)
    assert n and n % k == 0 and k >= 2, f"{n} sessions, {k} per task (at least 2)"
    mean = sum(success) / n
    var = 0.0
    for i in range(0, n, k):
        a = success[i : i + k]
        m = sum(a) / k
        var += sum((x - m) ** 2 for x in a) / (k - 1) / k
    half = NormalDist().inv_cdf(0.5 + level / 2) * math.sqrt(var) / (n // k)
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def scores(
    verdicts: list[Verdict], satisfaction: list[float], k: int, level: float = 0.95
) -> dict[str, float]:
    """The held-out figures of sessions run `k` (>= 2) consecutive ones per task."""
    n = len(verdicts)
    mean, low, high = success_interval([float(v.fixed) for v in verdicts], k, level)
    turns = sum(v.turns for v in verdicts)
    return {
        METRIC: mean,
        "heldout_task_success_ci_low": low,
        "heldout_task_success_ci_high": high,
        "heldout_agent_satisfaction": sum(satisfaction) / n,
        "heldout_turns": turns / n,
        "heldout_tokens": sum(v.completion_tokens for v in verdicts) / n,
        "heldout_tool_error_rate": sum(v.tool_errors for v in verdicts) / max(1, turns),
        "heldout_invalid_call_rate": sum(v.invalid_calls for v in verdicts) / max(1, turns),
        "heldout_give_up_rate": sum(v.gave_up for v in verdicts) / n,
        "heldout_tests_edited_rate": sum(v.tests_edited for v in verdicts) / n,
    }


class AgentEvaluator(HeldOutEvaluator):
    """Held-out task success per version (the completion evaluator's registry and MLflow plumbing)."""

    RUN_NAME, METRIC, METRICS = RUN_NAME, METRIC, METRICS

    def __init__(
        self,
        mlflow_uri: str,
        model_name: str,
        n_tasks: int | None = None,
        samples_per_task: int = 2,
        max_tokens: int | None = None,
        max_turns: int | None = None,
        temperature: float | None = None,
        n_users: int = 16,
        seed: int = 10_001,
    ):
        """`n_tasks`, `max_tokens`, `max_turns` and `temperature` left None are the simulator's
        settings (FLYWHEEL_SIMULATE_AGENT_EVAL_TASKS, _AGENT_MAX_TOKENS, _AGENT_MAX_TURNS,
        _AGENT_TEMPERATURE): the held-out sessions are the live users' sessions on other tasks."""
        from app.simulate.config import SimulateConfig

        super().__init__(mlflow_uri, model_name, n_prompts=1, seed=seed)
        cfg = SimulateConfig()
        self.tasks = tasks(
            cfg.agent_eval_tasks if n_tasks is None else n_tasks, seed=seed, held_out=True
        )
        self.agent_users = agent_users(n_users, seed=seed, prefix="heldout-agent")
        self.samples_per_task = samples_per_task
        self.max_tokens = cfg.agent_max_tokens if max_tokens is None else max_tokens
        self.max_turns = cfg.agent_max_turns if max_turns is None else max_turns
        self.temperature = cfg.agent_temperature if temperature is None else temperature

    def verdicts(self, policy: Any) -> list[Verdict]:
        from contextlib import ExitStack

        with ExitStack() as stack:
            sessions = [
                AgentSession(
                    f"heldout-{t.task_id}-{j}",
                    t,
                    stack.enter_context(Sandbox(t)),
                    self.max_turns,
                )
                for t in self.tasks
                for j in range(self.samples_per_task)
            ]
            run_sessions(
                policy, sessions, self.max_tokens, temperature=self.temperature, seed=self.seed
            )
            return [s.verdict() for s in sessions]

    def scores(self, policy: Any) -> dict[str, float]:
        verdicts = self.verdicts(policy)
        sat = [
            sum(u.satisfaction(v) for u in self.agent_users) / len(self.agent_users)
            for v in verdicts
        ]
        return scores(verdicts, sat, self.samples_per_task)
