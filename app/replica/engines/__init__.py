"""The engine seam: what generates behind a replica.

The replica (app/replica/server.py and its routes/, openai/) is the HTTP front, the generation-event writer
and the sync agent's host; an engine loads verified versions and generates with them:

- `builtin` (base.py, `FLYWHEEL_REPLICA_ENGINE=torch`, the default): every version is a new
  in-process torch policy (policy), loaded and hashed by `weights.load_verified`; a swap
  publishes it and the old one stays until its requests are done.
- `vllm` (vllm.py, `flywheel replica --engine vllm`): versions are loaded in place into `vllm serve`
  processes from the environment deploy/vllm/ensure.sh provisions (or servers given by URL),
  through Flywheel's worker extension (vllm_worker/flywheel_vllm_ext.py), and hashed inside vLLM.

Both give `LoadedVersion`s (app/replica/weights.py) whose `policy.generate()` the front calls, so
routing, admission, events and the OpenAI-compatible API are the same for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.replica.config import ReplicaConfig
    from app.replica.engines.base import Engine
    from app.settings import Settings


def make_engine(settings: Settings, cfg: ReplicaConfig) -> Engine:
    """The engine `cfg.engine` names."""
    if cfg.engine == "vllm":
        from app.replica.engines.vllm import VLLMEngines

        return VLLMEngines(settings, cfg)
    from app.replica.engines.base import BuiltinEngine

    return BuiltinEngine(cfg)
