"""The streams role, `flywheel streams`: Faust workers that join the editors' interactions into
reward-labelled rollouts (`<ns>.interactions` -> `<ns>.rollouts`, late and invalid records to
`<ns>.late` and `<ns>.dlq`).

- `app.py`: the Faust app and its one agent; `worker.py` runs a worker.
- `labels.py`: the join itself, pure (typed per-request label state, wait windows, dedupe, close).
- `ledger.py`, `segments.py`: the session ledger's logic, pure (a session's chat turns grouped
  into segments, one multi-turn rollout each, with loss_mask and turn spans); no worker runs it.
- `reward.py`: the versioned reward spec; `relabel.py` re-derives rewards under another spec.
- `state.py`, `outbox.py`, `consumer.py`: table write-back, the batched output path, Faust's
  consumer with a per-record delivery path (one function copied from Faust, guarded by a hash test).

May import: app.contracts, app.infra, app.settings
Tests: tests/unit/streams/, tests/integration/streams/
Docs: docs/STREAMS.md
"""
