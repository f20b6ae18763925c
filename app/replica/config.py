"""Replica settings, env prefix `FLYWHEEL_REPLICA_` (the shared ones — Kafka, MLflow, model name,
data dir — come from `app.settings.Settings`).

    FLYWHEEL_REPLICA_ID=replica-1 FLYWHEEL_REPLICA_HEARTBEAT_INTERVAL=10s flywheel replica --port 8100

Durations accept the same forms as the main settings (`90`, `30s`, `15m`, `1h30m`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from app.settings import Duration
from app.settings_base import FlywheelSettings


class ReplicaConfig(FlywheelSettings):
    """Serving limits, sync cadence and the local weight cache of one `flywheel replica`."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_REPLICA_", extra="ignore", validate_default=True
    )

    id: str = Field(
        "replica-1",
        min_length=1,
        max_length=128,
        description="This replica's id in deployment events and metrics (`--replica-id` overrides it).",
    )
    host: str = Field("127.0.0.1", description="Bind address of `flywheel replica`.")
    port: int = Field(8100, ge=1, le=65535, description="Port of `flywheel replica`.")
    advertise_url: str | None = Field(
        None, description="URL reported in heartbeats (default http://<host>:<port>)."
    )
    cache_dir: Path | None = Field(
        None,
        description="Verified weight cache (default `<data_dir>/replicas/<id>`); "
        "a restarted replica serves from it at once.",
    )
    cache_keep: int = Field(
        3, ge=2, description="Verified versions kept in the cache (the serving ones always stay)."
    )
    max_tokens: int = Field(
        256,
        ge=1,
        description="Largest `max_tokens` a request may ask for (also capped by the model's context).",
    )
    max_n: int = Field(8, ge=1, description="Largest `n` (candidates per request).")
    max_prompt_chars: int = Field(
        65536,
        ge=1,
        description="Longest prompt accepted; longer prompts get 422. "
        "Prompts longer than the model's context keep their end.",
    )
    min_temperature: float = Field(
        0.01,
        gt=0.0,
        le=1.0,
        description="Smallest non-zero `temperature` a request may "
        "ask for (0 = greedy); smaller ones get 422: logits / T overflows float32 long "
        "before T reaches 0, and such a distribution is greedy in effect.",
    )
    max_queued: int = Field(
        16,
        ge=0,
        description="Most requests waiting for the generation thread (besides the one "
        "running); more get 503 + Retry-After at once, without generating.",
    )
    max_queued_cost: int = Field(
        4096,
        ge=1,
        description="Most tokens the waiting requests may generate together "
        "(sum of `n * max_tokens`); a request that would exceed it "
        "gets 503 + Retry-After. At least `max_n * max_tokens`.",
    )
    default_max_tokens: int = Field(
        16,
        ge=1,
        description="`max_tokens` of an OpenAI-compatible request that sends none "
        "(capped by `max_tokens` and the model's context).",
    )
    max_stop_sequences: int = Field(
        4, ge=0, description="Most `stop` strings in an OpenAI-compatible request (OpenAI's is 4)."
    )
    max_stop_chars: int = Field(
        256, ge=1, description="Longest `stop` string accepted (characters)."
    )
    max_tools: int = Field(
        64, ge=0, description="Most `tools` in a chat request (docs/AGENTS.md); 0 refuses tools."
    )
    max_tools_bytes: int = Field(
        65536,
        ge=1,
        description="Largest `tools` list, as JSON bytes: bounds the schemas checked and the call "
        "grammar compiled for a required or named `tool_choice`.",
    )
    max_parallel_tool_calls: int = Field(
        8,
        ge=1,
        description="Most calls one completion may make under `tool_choice: required` with "
        "`parallel_tool_calls` (the constraint's grammar stops there).",
    )
    grammar_compile_fuel: int = Field(
        1_000_000,
        ge=1000,
        description="llguidance lexer fuel to compile one tool-call grammar (about 50k per ms): "
        "bounds the compile time a required or named `tool_choice` may cost; over it is a 400 on "
        "`tools`. The default is llguidance's own, which the vLLM engine compiles with.",
    )
    grammar_step_fuel: int = Field(
        200_000,
        ge=1000,
        description="llguidance lexer fuel of one token's grammar mask (about 14k per ms): bounds "
        "the time constrained decoding adds per token; a generation over it is a 400 on `tools`.",
    )
    max_open_streams: int = Field(
        64,
        ge=1,
        description="Most streamed responses open at once (`stream: true`); one more gets "
        "503 + Retry-After before anything is generated.",
    )
    api_key: SecretStr | None = Field(
        None,
        description="When set, `POST /v1/complete` and the OpenAI-compatible `/v1/...` "
        "routes need `Authorization: Bearer <key>` (401 otherwise); health, "
        "readiness and metrics stay open.",
    )
    torch_threads: int = Field(
        1,
        ge=1,
        description="torch intra-op threads for generation (the built-in engine: one model call "
        "at a time).",
    )
    standby: bool = Field(
        True,
        description="Built-in engine: keep the policy of the last version it stopped serving and load "
        "the next version into it in place once no request uses it (no module copy, no fresh "
        "allocation: faster loads of large models). Costs one policy's memory between syncs, "
        "as much as a sync holds while it builds; false frees it at each swap.",
    )
    decode_threads: int = Field(
        1,
        ge=1,
        description="Threads of the verified delta decode. The fast decoder is mostly "
        "Python per tensor (the GIL), so more threads only pay off for "
        "large models on a host the replica has to itself; 1 when "
        "several replicas share a host's cores.",
    )
    pushed_deltas: bool = Field(
        True,
        description="Follow `<ns>.deltas` too and sync from a delta pushed there (the "
        "trainer pushes small ones) instead of downloading it from MLflow; "
        "the bytes are verified the same way (app/contracts/pushed.py).",
    )
    pushed_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="Memory for received pushed deltas (the newest 8 at most are kept).",
    )
    heartbeat_interval: Duration = Field(
        15.0,
        description="How often the replica publishes `replica_heartbeat` to `<ns>.replica-status`.",
    )
    poll_interval: Duration = Field(
        1.0, description="Kafka poll timeout of the deployment follower."
    )
    retry_interval: Duration = Field(
        5.0, description="Wait before retrying a failed sync of the same target."
    )
    engine: Literal["torch", "vllm"] = Field(
        "torch",
        description="What generates (app/replica/engines/): `torch`, the built-in in-process "
        "engine, or `vllm`, vLLM servers updated in place by verified versions (HF models).",
    )
    vllm_python: Path | None = Field(
        None,
        description="Python of vLLM's own environment; None = the one deploy/vllm/ensure.sh "
        "builds (once per machine, under ~/.cache/flywheel).",
    )
    vllm_urls: list[str] = Field(
        default_factory=list,
        description="Running vLLM servers to use instead of starting them (JSON list; started "
        "with the flags of app/replica/engines/vllm.py server_args and its worker extension).",
    )
    vllm_engines: int = Field(
        2,
        ge=1,
        le=2,
        description="vLLM servers this replica starts: 2 serve champion and candidate side by "
        "side (a new version never pauses the champion); 1 serves no candidate.",
    )
    vllm_base_port: int = Field(
        0, ge=0, le=65534, description="Port of the first vLLM server (0 = free ports)."
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="Extra `vllm serve` flags (JSON list), e.g. `--gpu-memory-utilization 0.4`.",
    )
    vllm_return_routes: bool = Field(
        False,
        description="Ask vLLM for the routed experts of MoE models "
        "(`--enable-return-routed-experts`; needs vLLM's Model Runner V2, i.e. a GPU with "
        "Triton) and log them in generation events; responses from vLLM are then not streamed.",
    )
    vllm_concurrency: int = Field(
        8,
        ge=1,
        description="Requests a vLLM replica lets generate at once (vLLM batches them); the "
        "built-in engine runs one at a time. The queue bounds apply to the requests waiting "
        "beyond these.",
    )
    vllm_kv_cache_gib: int = Field(
        1, ge=1, description="VLLM_CPU_KVCACHE_SPACE of each vLLM server on CPU (GiB)."
    )
    vllm_start_timeout: Duration = Field(
        900.0, description="Longest wait for a vLLM server to answer /health after it starts."
    )
    vllm_drain_timeout: Duration = Field(
        60.0,
        description="Longest wait for the requests on a version before a vLLM engine replaces "
        "it in place (the sync is retried after it).",
    )
    debug_pause_in_apply: Duration = Field(
        0.0,
        description="Testing only: stall this long in the middle of applying a "
        "version (reconstructed and verified, not yet loaded or "
        "swapped), so tests can kill a replica mid-apply. Keep 0.",
    )

    @field_validator("advertise_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"advertise_url must start with http:// or https://, got {v!r}")
        return v

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            return None  # an empty FLYWHEEL_REPLICA_API_KEY means no key
        if v is not None and not v.get_secret_value().isascii():
            raise ValueError("api_key must be ASCII (it travels in an HTTP header)")
        return v

    @model_validator(mode="after")
    def _a_maximal_request_fits(self) -> ReplicaConfig:
        if self.max_queued_cost < self.max_n * self.max_tokens:
            raise ValueError(
                f"max_queued_cost ({self.max_queued_cost}) must be at least max_n * max_tokens "
                f"({self.max_n} * {self.max_tokens}), or a maximal request could never queue; "
                f"raise FLYWHEEL_REPLICA_MAX_QUEUED_COST or lower the other two"
            )
        return self

    @model_validator(mode="after")
    def _vllm_urls(self) -> ReplicaConfig:
        for u in self.vllm_urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"vllm_urls: {u!r} must start with http:// or https://")
        return self

    def resolved_cache_dir(self, data_dir: Path) -> Path:
        return self.cache_dir or Path(data_dir) / "replicas" / self.id

    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"
