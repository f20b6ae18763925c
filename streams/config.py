"""Settings of the streams worker (env prefix `FLYWHEEL_STREAMS_`).

The contract settings (FLYWHEEL_KAFKA_BOOTSTRAP, FLYWHEEL_WAIT_WINDOW, topic names) come
from app.settings.Settings; this class holds what only the streams role needs. A bad
value fails at start-up: `StreamsConfig().spec()` refuses a known reward spec version with
different weights.

    FLYWHEEL_STREAMS_REWARD_SPEC=v2 FLYWHEEL_STREAMS_REWARD_WEIGHTS='{"accept": 1.0}' flywheel streams
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from app.settings import Duration
from app.settings_base import FlywheelSettings
from streams.ledger import LedgerConfig
from streams.reward import RewardSpec, RewardWeights, resolve_spec


class StreamsConfig(FlywheelSettings):
    """Configuration of one `flywheel streams` worker."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_STREAMS_", extra="ignore", validate_default=True
    )

    reward_spec: str = Field(
        "v1",
        min_length=1,
        max_length=64,
        description="Reward spec version recorded in every rollout (known: v1, sessions-v1 (v1 plus session outcomes), sessions-v2 (sessions-v1 plus protected test files: a session that wrote one gets -1 for its outcome); hackable-tools and hackable-silence are exploitable on purpose, for reward-hack runs: docs/ROLLOUT.md).",
    )
    reward_weights: RewardWeights | None = Field(
        None,
        description="Weights (JSON) for a new spec version; must equal the fixed weights when the version is known.",
    )
    metrics_bucket: Duration = Field(
        60.0, description="Length of a version-metrics bucket (by label close time)."
    )
    closed_retention: Duration | None = Field(
        None,
        description="How long a closed label is remembered (late feedback -> after_close, duplicates dropped). Default: the wait window, at least one bucket.",
    )
    tick_interval: Duration = Field(
        0.2,
        description="How often the worker ticks its partitions to close labels on quiet partitions.",
    )
    skew_margin: Duration = Field(
        0.5,
        description="A tick closes labels up to wall time minus this margin (covers producer/worker clock skew and metadata lag).",
    )
    empty_completion_max_tokens: int = Field(
        1,
        ge=0,
        description="A completion with at most this many tokens counts as empty (e.g. only the stop token).",
    )
    store: str = Field(
        "memory://",
        description="Faust table store: memory:// (changelog replay on start) or rocksdb:// (needs rocksdict) in production.",
    )
    batch_max_events: int = Field(
        2000,
        ge=1,
        le=100_000,
        description="Records the agent takes per batch; each touched table key costs one changelog record per batch.",
    )
    batch_within: Duration = Field(
        0.05,
        description="Longest wait for a batch to fill before processing what arrived (adds at most this to label latency).",
    )
    stream_buffer_maxsize: int = Field(
        16384,
        ge=1,
        description="Records Faust buffers per stream before the fetch loop waits (back-pressure).",
    )
    eager_drain: bool = Field(
        True,
        description="Deliver fetched records to the agent without Faust's per-record asyncio tasks (streams/consumer.py); false = Faust's stock fetch loop.",
    )
    commit_interval: Duration = Field(
        1.0, description="Faust offset commit interval; bounds the replay after a crash."
    )
    session_timeout: Duration = Field(
        30.0,
        description="Kafka group session timeout: how long a crashed worker's partitions wait before another worker takes them.",
    )
    app_id: str | None = Field(
        None, description="Faust app id / consumer group. Default: '<topic_namespace>-streams'."
    )
    log_level: str = Field(
        "WARNING",
        pattern="^(DEBUG|INFO|WARNING|ERROR)$",
        description="Faust's log level (INFO shows rebalances, table recovery and commits).",
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Bind address of the Prometheus /metrics endpoint."
    )
    metrics_port: int = Field(
        9101,
        ge=0,
        le=65535,
        description="Port of the Prometheus endpoint; 0 disables it (trainer 9102, controller 9103).",
    )

    sessions: bool = Field(
        True,
        description="Assemble agent sessions (chat turns with a turn number) into one rollout per "
        "segment (streams/ledger.py); false: each chat turn is its own rollout.",
    )
    session_idle: Duration = Field(
        300.0,
        description="A session's open segment closes this long after its last turn; a turn that "
        "came early waits this long for the turns before it; an outcome waits this long for the "
        "turn it names.",
    )
    session_retention: Duration = Field(
        3600.0,
        description="How long a closed or ended session is remembered (duplicate turns dropped, "
        "late turns and outcomes routed to <ns>.late). At least session_idle and metrics_bucket.",
    )
    session_max_turns: int = Field(64, ge=1, description="Turns per segment.")
    session_max_tokens: int = Field(
        32768,
        ge=1,
        description="Tokens (prompt and completion) per segment: the model's context.",
    )
    session_max_bytes: int = Field(
        3 << 20,
        description="An upper bound of a segment's record and stored state in bytes (below the "
        "4 MiB record limit of <ns>.rollouts and the sessions changelog); a turn that would pass "
        "it closes the segment (max_bytes).",
    )
    max_open_sessions: int = Field(
        10_000,
        ge=1,
        description="Sessions with an open segment per turns partition; past it the least "
        "recently active closes (open_sessions).",
    )

    @model_validator(mode="after")
    def _check_spec(self) -> StreamsConfig:
        self.spec()  # raises ValueError with what to do
        self.ledger()
        if self.metrics_bucket <= 0:
            raise ValueError("FLYWHEEL_STREAMS_METRICS_BUCKET must be > 0, e.g. '60s'")
        if self.session_retention < self.metrics_bucket:
            raise ValueError(
                f"FLYWHEEL_STREAMS_SESSION_RETENTION ({self.session_retention:g}s) must cover "
                f"FLYWHEEL_STREAMS_METRICS_BUCKET ({self.metrics_bucket:g}s): an ended session is "
                "remembered until its bucket's session sums went out"
            )
        if self.batch_within <= 0:
            raise ValueError("FLYWHEEL_STREAMS_BATCH_WITHIN must be > 0, e.g. '50ms'")
        if self.tick_interval <= 0:
            raise ValueError("FLYWHEEL_STREAMS_TICK_INTERVAL must be > 0, e.g. '200ms'")
        return self

    def spec(self) -> RewardSpec:
        return resolve_spec(self.reward_spec, self.reward_weights)

    def ledger(self) -> LedgerConfig:
        """The session ledger's settings (raises ValueError naming what is wrong)."""
        return LedgerConfig(
            idle_s=self.session_idle,
            retention_s=self.session_retention,
            max_turns=self.session_max_turns,
            max_tokens=self.session_max_tokens,
            max_bytes=self.session_max_bytes,
            max_open_sessions=self.max_open_sessions,
        )

    def retention(self, wait_window: float) -> float:
        r = self.closed_retention if self.closed_retention is not None else wait_window
        return max(r, self.metrics_bucket)
