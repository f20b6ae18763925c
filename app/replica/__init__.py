"""The inference replica, `flywheel replica`: serves completions, follows deployments, syncs weights.

- `config.py`: `ReplicaConfig` (env prefix `FLYWHEEL_REPLICA_`).
- `routing.py`: stable hash of session_id against the candidate's traffic share.
- `weights.py`: the versions a replica holds (champion, candidate), the verified local cache,
  the atomic swap.
- `fetch.py`: reconstructing a version from MLflow artifacts (delta chain or anchor), verified.
- `sync.py`: the sync agent that follows `flywheel.deployments` and publishes replica events.
- `replica.py`: one replica process's state and the generation path both APIs share.
- `server.py`: the FastAPI app (`create_app`): the Replica, its lifespan, the routes.
- `routes/`: one module per resource: `routes/complete.py` (`POST /v1/complete`),
  `routes/completions.py`, `routes/chat.py`, `routes/models.py` (the OpenAI-compatible
  `/v1/completions`, `/v1/chat/completions`, `/v1/models`), `routes/health.py` (/healthz,
  /readyz, /metrics, /v1/status).
- `openai/`: what the OpenAI-compatible routes share: request bodies, planning, generation,
  the JSON answer, streaming as server-sent events, OpenAI's error shape.
- `bodies.py`: strict request-body parsing and the refusals both APIs share.
- `admission.py`: the bounded, cost-aware queue in front of the generation threads.
- `engines/`: what generates: the built-in torch engine or vLLM servers updated in place.

See docs/REPLICA.md.

May import: app.contracts, app.httplimits, app.infra, app.settings, kernels, policy
Tests: tests/unit/replica/, tests/integration/replica/
Docs: docs/REPLICA.md
"""
