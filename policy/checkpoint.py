"""Save and load a policy as `config.json` + `model.safetensors` (fp32 masters or bf16 serving).

    save_policy(policy, "ckpt/")                      # fp32 master weights (resumable training)
    save_policy(policy, "serve/", serving=True)       # bf16 serving weights (what replicas load)
    policy = load_policy("ckpt/")                     # either kind; bf16 is upcast exactly

Both kinds give bit-identical forwards: the forward always uses bf16-rounded weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from policy.base import Policy

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_policy(
    policy: Policy, out_dir: str | Path, serving: bool = False, extra: dict[str, Any] | None = None
) -> Path:
    """Write config.json (the policy config + `weights_dtype` + `tokenizer` + extra) and the weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if serving:
        state = policy.serving_state_dict()
    else:
        state = {k: v.detach().contiguous() for k, v in policy.state_dict().items()}
    save_file(
        state, str(out / WEIGHTS_FILE), metadata={"weights_dtype": "bf16" if serving else "fp32"}
    )
    meta = {
        "policy": policy.config_dict(),
        "weights_dtype": "bf16" if serving else "fp32",
        "tokenizer": policy.tokenizer.name,
        **(extra or {}),
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out


def load_policy(path: str | Path) -> Policy:
    """Rebuild the policy from `path/config.json` and load `path/model.safetensors`."""
    from policy.factory import build_policy

    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: not a policy checkpoint directory")
    meta = json.loads(cfg_file.read_text())
    policy = build_policy(meta["policy"])
    state = load_file(str(path / WEIGHTS_FILE))
    if meta.get("weights_dtype") == "bf16":
        policy.load_serving_state_dict(state)
    else:
        policy.load_state_dict(state, strict=True)
    return policy
