"""Numerics shared by the trainer and the replicas, with no dependency on the rest of the project.

- `invariant.py`, `exact_matmul.py`, `fixed_order.py`, `hf_mode.py`, `logprobs.py`: batch-invariant
  fp32 kernels, so the trainer's log-probabilities of a completion equal the replica's bit for bit.
- `moe.py`: top-k MoE routing that records and replays expert ids.
- `delta/`: the lossless, verified weight-delta codec of the delta sync.

May import: nothing
Tests: tests/unit/kernels/, tests/unit/delta/
Docs: docs/NUMERICS.md, docs/DELTA.md
"""
