"""The replica's HTTP routes, one module per resource (app/replica/server.py includes them):

- `complete.py`: `POST /v1/complete`, the replica's own completion API.
- `completions.py`: `POST /v1/completions` (OpenAI-compatible).
- `chat.py`: `POST /v1/chat/completions` (OpenAI-compatible).
- `models.py`: `GET /v1/models`, `GET /v1/models/{model}` (OpenAI-compatible).
- `health.py`: `/healthz`, `/readyz`, `/metrics`, `/v1/status`.
- `deps.py`: the typed dependencies the routes take (the app's `Replica`, its open streams).

What the OpenAI-compatible routes share (planning, generation, streams, errors) is in
app/replica/openai/; what both APIs share (body parsing, refusals, the generation path) in
app/replica/bodies.py and app/replica/replica.py.
"""
