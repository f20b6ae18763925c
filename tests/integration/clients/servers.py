"""The real servers the client round-trip tests talk to: a replica serving tiny version 7 from its
verified cache (no MLflow needed for serving) and the ingest API with an ingest key."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def serve_replica(settings, tmp_path: Path, replica_id: str, max_context: int | None = None) -> Any:
    """A uvicorn replica for `settings` (its context `max_context` tokens when given)."""
    from app.api.server import ServerThread
    from app.replica.config import ReplicaConfig
    from app.replica.server import create_app
    from app.replica.weights import WeightCache, load_verified
    from kernels.delta.hashing import checkpoint_sha256
    from tests.unit.replica.conftest import tiny_state

    model_cfg, state = tiny_state(7, max_context)
    cache = WeightCache(tmp_path / "replica-cache")
    cache.put(load_verified("7", state, model_cfg, checkpoint_sha256(state)))
    cache.set_serving(cache.restore())
    cfg = ReplicaConfig(id=replica_id, cache_dir=tmp_path / "replica-cache")
    return ServerThread(create_app(settings, cfg, start_sync=False)).start()


def serve_api(settings, key_name: str) -> tuple[Any, str]:
    """A uvicorn ingest API on a migrated database, and an ingest-scoped key for it."""
    from app.api.main import create_app
    from app.api.server import ServerThread
    from app.db.keys import create_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    upgrade(settings.db_url)
    with session_scope(settings.db_url) as session:
        key, _ = create_key(session, ["ingest"], name=key_name)
    return ServerThread(create_app(settings)).start(), key
