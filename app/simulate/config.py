"""Settings of `flywheel simulate` (env prefix FLYWHEEL_SIMULATE_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from app.settings_base import FlywheelSettings


class SimulateConfig(FlywheelSettings):
    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_SIMULATE_", extra="ignore")

    users: int = Field(
        16, ge=1, description="Simulated users (one editor session each) working concurrently."
    )
    rps: float = Field(
        4.0, gt=0, description="Completion requests per second across the whole population."
    )
    max_tokens: int = Field(48, ge=1, description="max_tokens of each completion request.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature the editor asks for.")
    candidates: int = Field(
        2, ge=1, description="Completions per request (n); candidates share a group_id."
    )
    seed: int = Field(0, description="Seed of the training population and its prompts.")
    feedback_delay_s: float = Field(
        0.5, ge=0, description="Mean delay between seeing a completion and reacting."
    )
    hard_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of argument lists whose requests are hard (0.3: 3 of 10; honest attempts are rarely accepted there, and a broken tool call draws a tool_error instead of a reject). The held-out evaluation uses the same share.",
    )
    agents: bool = Field(
        False,
        description="Simulate agent users instead of editor completions: coding-agent sessions on small real repositories in a sandbox, over the replicas' chat completions with tools (app/simulate/agents.py); the held-out evaluation scores task success.",
    )
    agent_outcome: Literal["user", "tests"] = Field(
        "user",
        description="Who reports a finished agent session's outcome: `user` (they check the fix, which the hidden tests decide) or `tests` (the repository's own tests as the harness runs them at the end; open on purpose: an edited test file passes too, docs/ROLLOUT.md).",
    )
    agent_parallel: int = Field(
        1,
        ge=1,
        description="Sessions an agent user runs at once on each task (parallel agents, as an editor's best-of-N runs them): with more than one, the task's sessions are one group (the X-Flywheel-Group header), and the trainer judges each against the group's mean instead of the batch's.",
    )
    agent_max_turns: int = Field(
        6, ge=1, description="Assistant turns before a session is abandoned."
    )
    agent_temperature: float = Field(
        1.0,
        ge=0,
        description="Sampling temperature of agent turns, live and in the held-out evaluation (`flywheel run --agents` sets 0.6: at 1 the built-in policy garbles its calls' tags now and then, and every garbled call is noise in the session's gradient).",
    )
    agent_retry_s: float = Field(
        60.0,
        ge=0,
        description="How long an agent session retries a turn that a replica refused before generating anything (503 or 429, honouring Retry-After, or no connection), with exponential backoff, as an editor's OpenAI client retries them. A turn still refused then, or that failed after the request was sent, interrupts the session: it reports its tool errors but no outcome and no rating (the service failed, not the agent; reported as `abandoned`, those sessions dragged their groups' baselines down, docs/TRAINER.md \"Why it falls short\").",
    )
    agent_max_tokens: int = Field(
        192,
        ge=1,
        description="max_tokens of each agent turn (an `apply_edit` call that implements a stub is about 140 bytes).",
    )
    agent_eval_tasks: int = Field(
        32,
        ge=1,
        description="Held-out tasks the agent evaluation runs 2 sessions on for every registered version (in process, with the agent turns' max_tokens and max turns above).",
    )
    agent_think_s: float = Field(
        1.0, ge=0, description="Longest pause of an agent user between two sessions (uniform)."
    )
