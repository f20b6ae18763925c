"""The inference replica, `flywheel replica`: serves completions, follows deployments, syncs weights.

- `config.py`: `ReplicaConfig` (env prefix `FLYWHEEL_REPLICA_`).
- `routing.py`: stable hash of session_id against the candidate's traffic share.
- `weights.py`: the versions a replica holds (champion, candidate), the verified local cache,
  the atomic swap.
- `fetch.py`: reconstructing a version from MLflow artifacts (delta chain or anchor), verified.
- `sync.py`: the sync agent that follows `flywheel.deployments` and publishes replica events.
- `server.py`: the FastAPI app (`POST /v1/complete`, /healthz, /readyz, /metrics, /v1/status).
- `openai_api.py`: the OpenAI-compatible routes (`/v1/completions`, `/v1/chat/completions`,
  `/v1/models`), streaming as server-sent events.
- `admission.py`: the bounded, cost-aware queue in front of the generation threads.
- `engines/`: what generates: the built-in torch engine or vLLM servers updated in place.

See docs/REPLICA.md.
"""
