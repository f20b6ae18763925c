"""The streams role, `flywheel streams`: Faust workers that join the editors' interactions into
reward-labelled rollouts (`<ns>.interactions` -> `<ns>.rollouts`, late and invalid records to
`<ns>.late` and `<ns>.dlq`).

- `app.py`: the Faust app and its agents; `worker.py` runs a worker; `runtime.py`: an agent's
  machinery on one input (batches, ticks, progress, resume, at-least-once order).
- `labels.py`: the join itself, pure (typed per-request label state, wait windows, dedupe, close).
- `session_stage.py`: the second agent, the session ledger over `<ns>.streams-turns`;
  `ledger.py`, `segments.py`: its logic, pure (a session's chat turns grouped into segments, one
  rollout each, with loss_mask, turn spans and the session's outcome).
- `reward.py`: the versioned reward spec; `relabel.py` re-derives rewards under another spec.
- `state.py`, `outbox.py`, `consumer.py`: table write-back, the batched output path, Faust's
  consumer with a per-record delivery path (one function copied from Faust, guarded by a hash test).

May import: app.contracts, app.infra, app.settings
Tests: tests/unit/streams/, tests/integration/streams/
Docs: docs/STREAMS.md
"""
