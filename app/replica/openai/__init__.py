"""The replica's OpenAI-compatible API, behind the routes `POST /v1/completions`,
`POST /v1/chat/completions` and `GET /v1/models` (app/replica/routes/), with `stream: true` as
server-sent events the way OpenAI's clients read them.

    client = openai.OpenAI(base_url="http://replica:8100/v1", api_key="<FLYWHEEL_REPLICA_API_KEY or any>")
    client.completions.create(model="flywheel-policy", prompt="def f(", max_tokens=32, user="session-1")

Same serving path as `POST /v1/complete` (app/replica/routes/complete.py): the session picks
champion or candidate, generation runs on the generation threads behind the bounded queue, and
every completion writes one `generation` event to `<ns>.interactions`, acknowledged by Kafka
before the answer (before `data: [DONE]` for a stream). What is specific to this API, by module:

- `serve.py`: the path both completion routes share: plan, hold the version, answer or stream.
- `requests.py`: the request bodies, and the OpenAI parameters refused unless neutral.
- `plan.py`: a request checked and ready to generate: ids, session, model, sampling, log-probs.
- `choice_text.py`: one choice's text as it is generated: stop strings, held-back text.
- `generation.py`: the generation and its events (`Outcome`), cancellation, error mapping.
- `answer.py`: the non-streamed JSON answer, log-probs.
- `stream.py`: the server-sent events of a stream, the open-streams bound.
- `errors.py`: OpenAI's error shape and which refusal is which status.
"""
