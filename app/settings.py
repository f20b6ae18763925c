"""Process settings: one pydantic-settings `Settings`, environment prefix `FLYWHEEL_`.

The names in docs/DESIGN.md §Settings and CLI (`FLYWHEEL_DATA_DIR`, `FLYWHEEL_KAFKA_BOOTSTRAP`,
`FLYWHEEL_DATABASE_URL`, `FLYWHEEL_MLFLOW_URI`, `FLYWHEEL_MODEL_NAME`,
`FLYWHEEL_SHIP_INTERVAL`, `FLYWHEEL_WAIT_WINDOW`) are a contract. Every other field is
documented here and listed by `flywheel config` / docs/CONFIGURATION.md.

Durations accept `90`, `90s`, `15m`, `5h`, `1d` (or combinations such as `1h30m`) and are
stored as float seconds. A bad value fails at start-up with a message that says how to fix it.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from app.contracts.topics import KAFKA_MESSAGE_MAX_BYTES, KAFKA_RECORD_OVERHEAD_BYTES, TOPICS
from app.settings_base import FlywheelSettings

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Parse `90`, `1.5`, `250ms`, `30s`, `15m`, `5h`, `1d`, `1h30m` into seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        pos, seconds = 0, 0.0
        if not text:
            raise ValueError("empty duration; use e.g. '30s', '15m' or '5h'")
        for m in _DURATION_PART.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
            pos = m.end()
        if pos != len(text):
            raise ValueError(
                f"cannot parse duration {value!r}; use e.g. '30s', '15m', '5h' or '1h30m'"
            )
    else:
        raise ValueError(
            f"duration must be a number of seconds or a string like '15m', got {value!r}"
        )
    if seconds < 0:
        raise ValueError(f"duration must be >= 0, got {value!r}")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


# The embedded broker's JVM: C1 only, one compiler thread, serial GC (app/infra/broker.py)
KAFKA_LIGHT_JVM = "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC"


class Settings(FlywheelSettings):
    """Configuration shared by every role. Each field maps to `FLYWHEEL_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", extra="ignore", validate_default=True)

    # --- contract (docs/DESIGN.md §Settings and CLI) ----------------------------------
    data_dir: Path = Field(
        Path(".flywheel"),
        description="Directory for local state: broker logs, SQLite DB, MLflow store, checkpoints.",
    )
    kafka_bootstrap: str = Field(
        "localhost:9092", description="Kafka bootstrap servers, comma-separated host:port."
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL of the app database. Default: SQLite file `<data_dir>/flywheel.db`.",
    )
    mlflow_uri: str = Field(
        "http://127.0.0.1:5000", description="MLflow tracking/registry server URI."
    )
    model_name: str = Field("flywheel-policy", description="Registered model name in MLflow.")
    model_dir: Path | None = Field(
        None,
        description="`flywheel run` only (its `--model` flag): a Hugging Face causal LM directory (config.json, *.safetensors, tokenizer files) to run the whole loop on. Once MLflow is up, `flywheel model import DIR --resume` runs before the roles start: an empty registry gets DIR as version 1 (champion); a registry whose first version was imported from DIR itself (same config, tokenizer and weights) resumes; one holding another model is refused. The trainer gets DIR's HF policy. Unset: the built-in policy.",
    )
    ship_interval: Duration = Field(
        5 * 3600.0, description="How often the trainer ships a checkpoint (e.g. `5h`, `2m`, `30s`)."
    )
    wait_window: Duration = Field(
        15 * 60.0, description="How long a generation waits for feedback before its label closes."
    )

    # --- profile & secrets ------------------------------------------------------------
    profile: Literal["local", "production"] = Field(
        "local",
        description="`local` allows built-in development secrets; `production` requires every secret to be set.",
    )
    webhook_secret: str | None = Field(
        None,
        description="HMAC secret shared with MLflow webhooks. Required outside the local profile.",
    )

    # --- Kafka ------------------------------------------------------------------------
    topic_namespace: str = Field(
        "flywheel",
        description="Prefix of every topic (`<ns>.interactions`, ...). Keep `flywheel` unless several deployments share a cluster.",
    )
    interactions_partitions: int = Field(
        6,
        ge=1,
        description="Partitions of `<ns>.interactions` (the parallelism of the streams workers).",
    )
    rollouts_partitions: int = Field(6, ge=1, description="Partitions of `<ns>.rollouts`.")
    default_partitions: int = Field(
        1,
        ge=1,
        description="Partitions of the other topics (deployments stays ordered on 1 partition per model).",
    )
    replication_factor: int = Field(
        1,
        ge=1,
        description="Replication factor of created topics (1 for the embedded single-node broker).",
    )
    kafka_produce_timeout: Duration = Field(
        5.0, description="Upper bound for one produce+ack round trip before the API answers 503."
    )
    kafka_controller_port: int | None = Field(
        None, description="KRaft controller port of the embedded broker (default: broker port + 1)."
    )
    kafka_heap: str = Field("512m", description="JVM heap (-Xmx) of the embedded broker.")
    kafka_jvm_opts: str = Field(
        KAFKA_LIGHT_JVM,
        description="JVM options of the embedded broker, a development broker: by default the "
        "quick JIT only and the serial collector, which take half the CPU of Kafka's own G1 "
        "options to start and serve a small load, and two thirds of it idle (bench/kafka_jvm.py). "
        '"-XX:+UseG1GC -XX:MaxGCPauseMillis=20" gives Kafka\'s own.',
    )
    delta_push_max_bytes: int = Field(
        4 * 1024 * 1024,
        ge=0,
        le=7 * 1024 * 1024,
        description="The trainer also writes each delta up to this size to `<ns>.deltas`, so replicas get it with the deployment event instead of downloading it from MLflow (app/contracts/pushed.py). 0: never push.",
    )
    kafka_cache_dir: Path = Field(
        Path.home() / ".cache" / "flywheel",
        description="Where Kafka's jars are cached after the Maven resolve (outside the repo).",
    )

    # --- HTTP API -----------------------------------------------------------------------
    api_host: str = Field("127.0.0.1", description="Bind address of `flywheel api`.")
    api_port: int = Field(8000, description="Port of `flywheel api`.")
    max_batch_events: int = Field(
        1000, ge=1, description="Maximum events per POST /v1/events (contract: 1000)."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1,
        description="Maximum request body of POST /v1/events (contract: 4 MiB).",
    )
    max_event_bytes: int = Field(
        1_000_000,
        ge=1024,
        le=KAFKA_MESSAGE_MAX_BYTES - KAFKA_RECORD_OVERHEAD_BYTES,
        description="Maximum size of one event of POST /v1/events, as compact JSON (the Kafka record value); a batch with a larger event is refused with 413 naming it. At most the interactions topic's record limit (1048588) minus 1024 bytes for the key and record-batch framing.",
    )
    rate_limit_per_s: float = Field(
        200.0, gt=0, description="Per-key sustained request rate (token bucket refill, requests/s)."
    )
    rate_limit_burst: int = Field(400, ge=1, description="Per-key burst size of the token bucket.")
    key_cache_ttl: Duration = Field(
        1.0,
        ge=0,
        le=60,
        description="How long the API trusts a key it looked up in the database: a key revoked with `flywheel keys revoke` is refused by every request that reaches the API more than this long after the revocation committed. 0: look the key up on every request.",
    )
    key_negative_cache_ttl: Duration = Field(
        30.0,
        ge=0,
        le=3600,
        description="How long the API remembers a well-formed token that is not an active key, so repeating it costs no database lookup.",
    )
    key_cache_max_entries: int = Field(
        10_000,
        ge=1,
        description="Entries in each of the API's key caches (valid keys; unknown or revoked tokens); the oldest is evicted past it.",
    )
    auth_failure_burst: int = Field(
        20,
        ge=1,
        description="Failed authentications one client address may make in a burst before its requests are answered 429.",
    )
    auth_failure_rate_per_s: float = Field(
        0.5,
        gt=0,
        description="Refill of each client address's failed-authentication budget (failures/s).",
    )
    auth_max_clients: int = Field(
        10_000,
        ge=1,
        description="Client addresses whose failed-authentication budget the API tracks; the longest-idle is forgotten past it.",
    )
    auth_known_key_window: Duration = Field(
        600.0,
        ge=0,
        le=86400,
        description="A client address over its failed-authentication budget still gets requests with a key that authenticated within this window checked (and served); any other token from it is answered 429 without a database lookup.",
    )
    trusted_proxies: str = Field(
        "",
        description="Comma-separated addresses or networks (`127.0.0.1`, `10.0.0.0/8`, `*`) of proxies in front of `flywheel api` whose `X-Forwarded-For` names the client (the rightmost address that is not itself a trusted proxy). Empty: `X-Forwarded-For` is ignored and the client is the TCP peer. Failed authentications are budgeted per client address.",
    )

    # --- HTTP server limits (the API and every replica; app/httplimits.py, docs/API.md "Limits") --------------
    http_head_timeout: Duration = Field(
        10.0,
        gt=0,
        description="A connection must send a complete request head (request line and headers) within this long of opening, or of the first byte of its next request; otherwise it is closed (408 if part of a head arrived).",
    )
    http_body_idle_timeout: Duration = Field(
        10.0,
        gt=0,
        description="Longest wait for the next chunk of a request body; then 408 and the connection is closed.",
    )
    http_body_timeout: Duration = Field(
        60.0,
        gt=0,
        description="Total time a request may keep the server waiting for its body; then 408 and the connection is closed.",
    )
    http_keepalive_timeout: Duration = Field(
        5.0, gt=0, description="An idle keep-alive connection is closed after this long."
    )
    http_max_connections: int = Field(
        512,
        ge=1,
        description="Open connections per server process; one more is answered 503 with Retry-After and closed.",
    )
    http_max_head_bytes: int = Field(
        16384,
        ge=1024,
        description="Largest request head (request line and headers); larger ones are answered 431 and closed.",
    )
    http_max_body_bytes: int = Field(
        1024 * 1024,
        ge=1,
        description="Largest request body on routes without their own limit (413). POST /v1/events uses `max_body_bytes`, the admin verbs `admin_max_body_bytes`, the webhook receiver `webhook_max_body_bytes`.",
    )
    http_drain_max_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="A request answered before its body was read (413, 401, ...) has the rest of its body read and discarded up to this many bytes, so that clients which send the whole body before reading get the answer; beyond it the answer is sent with Connection: close.",
    )
    http_drain_timeout: Duration = Field(
        10.0,
        ge=0,
        description="Longest time spent draining such a body (see `http_drain_max_bytes`).",
    )
    admin_max_body_bytes: int = Field(
        16 * 1024,
        ge=1024,
        description="Largest body of the admin verbs (POST /v1/deployments/{verb}).",
    )
    webhook_max_body_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest MLflow webhook delivery (POST /v1/hooks/mlflow); checked on Content-Length before the body is read.",
    )
    webhook_clock_skew: Duration = Field(
        60.0,
        ge=0,
        description="Extra time a webhook delivery id is remembered beyond the replay window on either side, against clock steps.",
    )
    webhook_dedupe_max_ids: int = Field(
        20_000,
        ge=100,
        description="Most webhook delivery ids remembered at once (at most ~400 bytes each: 8 MB at the default); when full, new deliveries get 503 + Retry-After until ids expire, rather than forgetting ids that could still be replayed.",
    )

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap_has_ports(cls, v: str) -> str:
        for part in v.split(","):
            host, sep, port = part.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(
                    f"FLYWHEEL_KAFKA_BOOTSTRAP entry {part!r} must be host:port, e.g. localhost:9092"
                )
        return v

    @field_validator("model_dir")
    @classmethod
    def _model_dir_is_a_model(cls, v: Path | None) -> Path | None:
        if v is not None and not (v / "config.json").is_file():
            raise ValueError(
                f"FLYWHEEL_MODEL_DIR {str(v)!r} is not a Hugging Face model directory (no "
                "config.json in it); give the directory save_pretrained wrote"
            )
        return v

    @field_validator("topic_namespace")
    @classmethod
    def _namespace_is_topic_safe(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,100}", v):
            raise ValueError(
                f"FLYWHEEL_TOPIC_NAMESPACE {v!r} may only contain letters, digits, '.', '_' and '-'"
            )
        return v

    @model_validator(mode="after")
    def _one_event_fits_in_a_body(self) -> Settings:
        if self.max_body_bytes < self.max_event_bytes + len(b'{"events":[]}'):
            raise ValueError(
                f"FLYWHEEL_MAX_BODY_BYTES ({self.max_body_bytes}) must hold one event of "
                f'FLYWHEEL_MAX_EVENT_BYTES ({self.max_event_bytes}) plus the {{"events":[...]}} envelope'
            )
        return self

    @model_validator(mode="after")
    def _secrets_outside_local(self) -> Settings:
        if self.profile != "local" and not self.webhook_secret:
            raise ValueError(
                "FLYWHEEL_WEBHOOK_SECRET must be set when FLYWHEEL_PROFILE is not 'local'"
            )
        return self

    # --- derived --------------------------------------------------------------------------
    @property
    def db_url(self) -> str:
        """The effective SQLAlchemy URL (SQLite in the data dir unless configured)."""
        return self.database_url or f"sqlite:///{(self.data_dir / 'flywheel.db').resolve()}"

    @property
    def effective_webhook_secret(self) -> str:
        return self.webhook_secret or "flywheel-local-webhook-secret"

    def topic(self, name: str) -> str:
        """Full topic name for a logical topic (`interactions` -> `flywheel.interactions`)."""
        assert name in TOPICS, f"unknown topic {name!r}; known: {sorted(TOPICS)}"
        return f"{self.topic_namespace}.{name}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once from the environment)."""
    return Settings()
