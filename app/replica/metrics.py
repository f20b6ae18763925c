"""Prometheus metrics of `flywheel replica` (served at GET /metrics from the default registry).

Every metric carries `replica_id`, so several replicas in one process (tests, bench) stay apart.

| metric | labels | what |
|---|---|---|
| `flywheel_replica_requests_total` | replica_id, slot, outcome | POST /v1/complete by slot and outcome (ok, invalid, unauthorized, not_ready, rejected, disconnected, unavailable) |
| `flywheel_replica_openai_requests_total` | replica_id, endpoint, outcome | OpenAI-compatible requests (`completions`, `chat`, `models`) by outcome (ok, cancelled, invalid, unauthorized, model_not_found, not_ready, rejected, disconnected, unavailable) |
| `flywheel_replica_streams_open` | replica_id | streamed responses open now |
| `flywheel_replica_streams_cancelled_total` | replica_id, recorded | streams whose client went away before the end: `recorded="yes"` when tokens had been generated (their events say `finish_reason: "cancelled"`), `"no"` when nothing had been generated (no event) |
| `flywheel_replica_queue_depth` | replica_id | requests waiting for the generation thread (not counting the running one) |
| `flywheel_replica_queue_cost` | replica_id | sum of `n * max_tokens` of the waiting requests |
| `flywheel_replica_queue_wait_seconds` | replica_id | time from admission to the start of a request's model call |
| `flywheel_replica_queue_rejections_total` | replica_id, reason | requests refused with 503 because the queue was full (`requests` or `cost` bound) |
| `flywheel_replica_request_seconds` | replica_id | request latency (generation + Kafka ack) |
| `flywheel_replica_generation_seconds` | replica_id | model time of one request |
| `flywheel_replica_tokens_total` | replica_id, version, kind | prompt / completion tokens |
| `flywheel_replica_tool_calls_total` | replica_id, outcome | calls read from chat completions: `valid`, `invalid_arguments` (returned, but their arguments fail the function's schema), `malformed` (not a call: returned as content) |
| `flywheel_replica_constrained_total` | replica_id, choice | chat completions sampled under a tool-call grammar, by `tool_choice` (`required`, `function`) |
| `flywheel_replica_grammar_compile_seconds` | replica_id, cache | time to get a compiled tool-call grammar: `hit` (cached) or `miss` (compiled) |
| `flywheel_replica_serving_version` | replica_id, slot | version number served per slot (-1: none) |
| `flywheel_replica_traffic_pct` | replica_id | candidate's share of sessions |
| `flywheel_replica_sync_seconds` | replica_id, path | target seen -> swapped, by path (delta, anchor, cache, promote) |
| `flywheel_replica_sync_bytes_total` | replica_id, kind | artifact bytes fetched (delta, anchor) |
| `flywheel_replica_sync_failures_total` | replica_id, reason | failed syncs (the old weights keep serving) |
| `flywheel_replica_fallbacks_total` | replica_id | delta chains refused (hash mismatch, corrupt) and rebuilt from an anchor |
| `flywheel_replica_pushed_deltas_total` | replica_id, outcome | deltas from `<ns>.deltas`: received, used (no download), rejected (failed verification, downloaded instead) |
| `flywheel_replica_engine_update_seconds` | replica_id, stage | a vLLM engine's in-place update by stage: `drain` (requests on the replaced version finishing), `write` (the transfer file), `load` (vLLM's reload), `hash` (inside vLLM), `pause` (vLLM paused: load + hash + RPC) |
| `flywheel_replica_engine_verify_failures_total` | replica_id | in-place updates whose weights inside vLLM did not hash to the published checkpoint (the engine reloaded its previous version) |
| `flywheel_replica_engine_version` | replica_id, engine | version held by each vLLM engine (-1: none verified) |
| `flywheel_replica_engine_restarts_total` | replica_id | vLLM servers that exited and were restarted (their version reloaded and verified) |
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter(
    "flywheel_replica_requests_total",
    "POST /v1/complete requests by slot and outcome.",
    ["replica_id", "slot", "outcome"],
)
REQUEST_SECONDS = Histogram(
    "flywheel_replica_request_seconds",
    "POST /v1/complete latency (generation + Kafka ack).",
    ["replica_id"],
    buckets=_LAT,
)
GENERATION_SECONDS = Histogram(
    "flywheel_replica_generation_seconds",
    "Model time of one request.",
    ["replica_id"],
    buckets=_LAT,
)
OPENAI_REQUESTS = Counter(
    "flywheel_replica_openai_requests_total",
    "OpenAI-compatible requests by endpoint and outcome.",
    ["replica_id", "endpoint", "outcome"],
)


def count_openai(replica_id: str, endpoint: str, outcome: str) -> None:
    """One OpenAI-compatible request answered (`flywheel_replica_openai_requests_total`)."""
    OPENAI_REQUESTS.labels(replica_id, endpoint, outcome).inc()


STREAMS_OPEN = Gauge(
    "flywheel_replica_streams_open", "Streamed responses open now.", ["replica_id"]
)
STREAMS_CANCELLED = Counter(
    "flywheel_replica_streams_cancelled_total",
    "Streams whose client went away before the end, by whether anything was generated and recorded.",
    ["replica_id", "recorded"],
)
QUEUE_DEPTH = Gauge(
    "flywheel_replica_queue_depth", "Requests waiting for the generation thread.", ["replica_id"]
)
QUEUE_COST = Gauge(
    "flywheel_replica_queue_cost", "Sum of n * max_tokens of the waiting requests.", ["replica_id"]
)
QUEUE_WAIT_SECONDS = Histogram(
    "flywheel_replica_queue_wait_seconds",
    "Admission to the start of the model call.",
    ["replica_id"],
    buckets=(0.001,) + _LAT,
)
QUEUE_REJECTIONS = Counter(
    "flywheel_replica_queue_rejections_total",
    "Requests refused because the generation queue was full, by bound (requests, cost).",
    ["replica_id", "reason"],
)
TOKENS = Counter(
    "flywheel_replica_tokens_total",
    "Prompt and completion tokens by serving version.",
    ["replica_id", "version", "kind"],
)
SERVING_VERSION = Gauge(
    "flywheel_replica_serving_version",
    "Version served per slot (-1: none).",
    ["replica_id", "slot"],
)
TRAFFIC_PCT = Gauge(
    "flywheel_replica_traffic_pct", "Candidate's share of sessions, percent.", ["replica_id"]
)
SYNC_SECONDS = Histogram(
    "flywheel_replica_sync_seconds",
    "From seeing a target version to serving it, by path.",
    ["replica_id", "path"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
SYNC_BYTES = Counter(
    "flywheel_replica_sync_bytes_total", "Artifact bytes fetched for syncs.", ["replica_id", "kind"]
)
SYNC_FAILURES = Counter(
    "flywheel_replica_sync_failures_total",
    "Syncs that failed (old weights keep serving).",
    ["replica_id", "reason"],
)
FALLBACKS = Counter(
    "flywheel_replica_fallbacks_total",
    "Delta chains refused and rebuilt from an anchor.",
    ["replica_id"],
)
PUSHED = Counter(
    "flywheel_replica_pushed_deltas_total",
    "Deltas received on <ns>.deltas, used instead of a download, or rejected by verification.",
    ["replica_id", "outcome"],
)


def observe_serving(replica_id: str, versions: dict[str, str | None], traffic_pct: float) -> None:
    for slot, v in versions.items():
        SERVING_VERSION.labels(replica_id, slot).set(-1 if v is None else int(v))
    TRAFFIC_PCT.labels(replica_id).set(traffic_pct)


ENGINE_UPDATE_SECONDS = Histogram(
    "flywheel_replica_engine_update_seconds",
    "In-place update of a vLLM engine by stage (drain, write, load, hash, pause).",
    ["replica_id", "stage"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
ENGINE_VERIFY_FAILURES = Counter(
    "flywheel_replica_engine_verify_failures_total",
    "In-place updates whose weights inside vLLM did not hash to the published checkpoint.",
    ["replica_id"],
)
ENGINE_VERSION = Gauge(
    "flywheel_replica_engine_version",
    "Version held by each vLLM engine (-1: none verified).",
    ["replica_id", "engine"],
)
ENGINE_RESTARTS = Counter(
    "flywheel_replica_engine_restarts_total",
    "vLLM servers that exited and were restarted by their replica.",
    ["replica_id"],
)

TOOL_CALLS = Counter(
    "flywheel_replica_tool_calls_total",
    "Tool calls read from chat completions by outcome (valid, invalid_arguments, malformed).",
    ["replica_id", "outcome"],
)
CONSTRAINED = Counter(
    "flywheel_replica_constrained_total",
    "Chat completions sampled under a tool-call grammar, by tool_choice.",
    ["replica_id", "choice"],
)
GRAMMAR_COMPILE_SECONDS = Histogram(
    "flywheel_replica_grammar_compile_seconds",
    "Time to get a compiled tool-call grammar, by cache hit or miss.",
    ["replica_id", "cache"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
