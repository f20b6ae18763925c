"""Full trainer state on disk, written atomically (temp file + fsync + rename + fsync dir).

One file, `<state_dir>/trainer_state.pt`, holds everything a killed trainer needs to resume
without losing a rollout or training on one twice: the fp32 masters of what trains
(`Policy.train_state_dict()`: every weight, or a LoRA policy's adapter alone, whose frozen base
is rebuilt from the model files the saved policy config names and verifies), optimizer state,
step, the Kafka positions the weights have processed, the dedupe set, the last shipped
version, the lineage accumulated since that ship, and the pending ship intent (see
docs/TRAINER.md, "Crash safety"). Weights and positions live in the same file, so they can
never disagree. Loading uses `torch.load(weights_only=True)`: only tensors and plain
Python containers, no arbitrary pickles.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
FORMAT_VERSION = 1


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


def save_state(state_dir: Path, state: dict[str, Any]) -> Path:
    """Atomically replace `<state_dir>/trainer_state.pt` with `state`."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    final = state_path(state_dir)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    payload = dict(state, format_version=FORMAT_VERSION)
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_state(state_dir: Path) -> dict[str, Any] | None:
    """The last saved state, or None on a first start. Stray temp files are removed."""
    state_dir = Path(state_dir)
    for stray in state_dir.glob(f".{STATE_FILE}.*.tmp"):
        log.info("removing incomplete state write %s", stray)
        stray.unlink(missing_ok=True)
    path = state_path(state_dir)
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state.get("format_version") == FORMAT_VERSION, (
        f"{path} has format {state.get('format_version')}, this trainer reads {FORMAT_VERSION}"
    )
    return state
