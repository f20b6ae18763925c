"""The trainer role, `flywheel trainer`: consumes rollouts, trains the policy continuously (one
process or torchrun ranks) and ships a registered, lineage-tagged version to MLflow every interval.

- `launch.py`: the entry point; `config.py` its settings; `loop.py` the continuous loop.
- `rollouts.py`, `rollout_record.py`, `validate.py`, `dlq.py`: intake, checks, dead letters.
- `batch.py`, `objective.py`: rollouts to tensors, the RL objective as pure functions.
- `shipping.py`, `ship_state.py`, `registry.py`, `checkpoint.py`: crash-safe ships and state.
- `distributed.py`, `fsdp.py`: ranks (DDP-style all-reduce, FSDP2 for Hugging Face policies).
- `pretrain.py`, `corpus.py`: the built-in base version; `model_import.py`, `model_export.py`:
  bring your own Hugging Face model, and take a version out.

May import: app.contracts, app.infra, app.sandbox, app.settings, kernels, policy
Tests: tests/unit/trainer/, tests/integration/trainer/
Docs: docs/TRAINER.md
"""
