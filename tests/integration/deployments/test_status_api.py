"""The read-only status API over real HTTP (httpx ASGI transport; the endpoints only read
SQL) on SQLite and PostgreSQL, with projections built from the shared event scenario."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from app.api.main import create_app
from app.contracts.deployments import LoggedEvent
from app.db.keys import create_key
from app.projector.projector import apply_events
from app.settings import Settings
from tests.unit.deployments.scenario import MODEL, OTHER, scenario_events

pytestmark = pytest.mark.integration

ENDPOINTS = ["/v1/deployments", "/v1/deployments/history", "/v1/models/2"]


@dataclass
class StatusApi:
    client: httpx.Client
    keys: dict[str, str]
    settings: Settings
    db_url: str

    def get(self, path: str, key: str | None = "read", **params) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[key]}"} if key else {}
        return self.client.get(path, params=params, headers=headers)

    def project(self, events) -> None:
        engine = sa.create_engine(self.db_url)
        with Session(engine) as s:
            apply_events(s, [LoggedEvent(0, i, e) for i, e in enumerate(events)])
            s.commit()
        engine.dispose()


@pytest.fixture()
def api(db_url: str, tmp_path: Path) -> Iterator[StatusApi]:
    settings = Settings(data_dir=tmp_path / "data", database_url=db_url, ship_interval="5h")
    engine = sa.create_engine(db_url)
    keys = {}
    with Session(engine) as s:
        for name, scopes in {"read": ["read"], "ingest": ["ingest"], "admin": ["admin"]}.items():
            keys[name], _ = create_key(s, scopes, name=name)
        s.commit()
    engine.dispose()
    app = create_app(settings)  # lifespan not run: these endpoints only read SQL (no Kafka needed)
    transport = httpx.ASGITransport(app=app)

    class _SyncClient:
        """A tiny sync facade over httpx.AsyncClient + ASGITransport."""

        def __init__(self) -> None:
            self.loop = asyncio.new_event_loop()
            self.client = httpx.AsyncClient(transport=transport, base_url="http://flywheel.test")

        def get(self, path, **kw):
            return self.loop.run_until_complete(self.client.get(path, **kw))

        def close(self) -> None:
            self.loop.run_until_complete(self.client.aclose())
            self.loop.close()

    client = _SyncClient()
    yield StatusApi(client, keys, settings, db_url)
    client.close()


@pytest.mark.parametrize("path", ENDPOINTS)
def test_status_endpoints_need_a_key_with_the_read_scope(api: StatusApi, path: str) -> None:
    r = api.get(path, key=None)
    assert r.status_code == 401 and "bearer" in r.json()["detail"].lower(), r.text
    assert r.headers.get("www-authenticate") == "Bearer"
    r = api.client.get(path, headers={"Authorization": "Bearer fw_00000000_nope"})
    assert r.status_code == 401 and "invalid" in r.json()["detail"], r.text
    for key in ("ingest", "admin"):
        r = api.get(path, key=key)
        assert r.status_code == 403 and "'read'" in r.json()["detail"], r.text


def test_deployments_before_any_event_is_empty(api: StatusApi) -> None:
    r = api.get("/v1/deployments")
    assert r.status_code == 200 and r.json()["models"] == []


def test_deployments_mid_canary_shows_split_phase_step_analysis_and_replicas(
    api: StatusApi,
) -> None:
    events = scenario_events()
    api.project(events[:10])  # v2 in canary at 50% (step 2); r-a serves v2 to canary sessions
    before = datetime.now(UTC)
    body = api.get("/v1/deployments").json()
    (m,) = body["models"]
    assert (m["model"], m["champion"], m["candidate"], m["phase"], m["step"]) == (
        MODEL,
        "1",
        "2",
        "canary",
        2,
    )
    assert m["traffic"] == {"champion_pct": 50.0, "candidate_pct": 50.0}
    assert m["last_analysis"]["verdict"] == "better" and m["last_analysis"]["candidate"]["n"] == 900
    reps = {r["replica_id"]: r for r in m["replicas"]}
    assert set(reps) == {"r-a", "r-b"}
    assert (reps["r-a"]["champion_version"], reps["r-a"]["candidate_version"]) == ("1", "2")
    assert (reps["r-b"]["champion_version"], reps["r-b"]["candidate_version"]) == ("1", None)
    hb = datetime.fromisoformat(reps["r-a"]["last_heartbeat"])
    assert hb == events[7].ts
    assert reps["r-a"]["heartbeat_age_s"] == pytest.approx((before - hb).total_seconds(), abs=30)
    eta = datetime.fromisoformat(m["next_checkpoint_eta"])
    assert eta == events[4].ts + timedelta(hours=5), (
        "ETA = last version_registered ts + ship_interval"
    )
    assert m["next_checkpoint_in_s"] == pytest.approx((eta - before).total_seconds(), abs=30)


def test_deployments_after_the_whole_scenario(api: StatusApi) -> None:
    events = scenario_events()
    api.project(events)
    body = api.get("/v1/deployments").json()
    assert [m["model"] for m in body["models"]] == sorted([MODEL, OTHER])
    m = next(x for x in body["models"] if x["model"] == MODEL)
    assert (m["champion"], m["candidate"], m["phase"], m["step"]) == ("1", None, "idle", None)
    assert m["traffic"] == {"champion_pct": 100.0, "candidate_pct": 0.0}
    assert m["last_registered_version"] == "5"
    reps = {r["replica_id"]: r for r in m["replicas"]}
    assert reps["r-b"]["status"] == "serving" and reps["r-b"]["details"]["error"].startswith(
        "sha256 mismatch"
    )
    only = api.get("/v1/deployments", model=OTHER).json()["models"]
    assert [x["model"] for x in only] == [OTHER] and only[0]["replicas"] == []


def test_history_is_newest_first_and_pages_cover_everything_once(api: StatusApi) -> None:
    events = scenario_events()
    api.project(events)
    full = api.get("/v1/deployments/history", limit=500).json()
    assert full["next_cursor"] is None
    seqs = [e["seq"] for e in full["events"]]
    assert seqs == sorted(seqs, reverse=True)
    non_heartbeat = [e for e in events[:-1] if e.type != "replica_heartbeat"]
    assert [e["event_id"] for e in full["events"]] == [e.event_id for e in reversed(non_heartbeat)]
    first = full["events"][0]
    assert set(first) >= {
        "event_id",
        "type",
        "model",
        "version",
        "from_version",
        "traffic_pct",
        "source",
        "actor",
        "reason",
        "details",
        "ts",
        "seq",
        "kafka_partition",
        "kafka_offset",
    }

    paged, cursor = [], None
    while True:
        params = {"limit": 7} | ({"cursor": cursor} if cursor is not None else {})
        page = api.get("/v1/deployments/history", **params).json()
        assert len(page["events"]) <= 7
        paged += page["events"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert paged == full["events"], "keyset pages must cover the history exactly once, in order"


def test_history_filters(api: StatusApi) -> None:
    events = scenario_events()
    api.project(events)
    gates = api.get("/v1/deployments/history", type="gate_passed").json()["events"]
    assert [e["version"] for e in gates] == ["5", "4", "2"]
    both = api.client.get(
        "/v1/deployments/history",
        params=[("type", "gate_passed"), ("type", "gate_failed")],
        headers={"Authorization": f"Bearer {api.keys['read']}"},
    ).json()["events"]
    assert [e["type"] for e in both] == ["gate_passed", "gate_passed", "gate_failed", "gate_passed"]
    v4 = api.get("/v1/deployments/history", version="4").json()["events"]
    assert [e["type"] for e in v4] == [
        "rolled_back",
        "traffic_shifted",
        "canary_resumed",
        "canary_paused",
        "canary_started",
        "gate_passed",
        "version_registered",
    ]
    beats = api.get("/v1/deployments/history", type="replica_heartbeat").json()["events"]
    assert len(beats) == 2 and all(e["source"] == "replica" for e in beats)
    ui = api.get("/v1/deployments/history", source="mlflow-ui").json()["events"]
    assert [(e["version"], e["from_version"], e["actor"]) for e in ui] == [
        ("1", "2", "alice"),
        ("1", None, "alice"),
    ]
    other = api.get("/v1/deployments/history", model=OTHER).json()["events"]
    assert [e["version"] for e in other] == ["2", "1"]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"limit": 501}, "limit"),
        ({"limit": 0}, "limit"),
        ({"type": "shipped"}, "type"),
        ({"cursor": -1}, "cursor"),
        ({"source": "cron"}, "source"),
    ],
)
def test_history_rejects_bad_parameters(api: StatusApi, params: dict, field: str) -> None:
    r = api.get("/v1/deployments/history", **params)
    assert r.status_code == 422 and field in r.text, r.text


def test_model_version_shows_lineage_gate_online_and_rollout(api: StatusApi) -> None:
    events = scenario_events()
    api.project(events[:10])  # v2 at 50% in canary
    v2 = api.get("/v1/models/2").json()
    assert v2["lineage"]["parent_version"] == "1" and v2["lineage"]["ancestors"] == ["1"]
    assert (
        v2["lineage"]["run_id"],
        v2["lineage"]["rollouts_consumed"],
        v2["lineage"]["reward_spec"],
    ) == ("run-2", 5000, "v1")
    assert v2["lineage"]["details"]["offsets"] == {"0": [4900, 5000]}
    assert v2["gate"]["snips"] == 0.31 and v2["gate"]["ci95"] == [0.27, 0.35]
    assert v2["online"] == {"reward_mean": 0.42, "n": 900}
    assert v2["rollout"] == {
        "status": "canary",
        "is_champion": False,
        "is_candidate": True,
        "traffic_pct": 50.0,
        "phase": "canary",
        "step": 2,
        "replicas": ["r-a"],
    }
    assert [e["type"] for e in v2["events"]][:3] == [
        "traffic_shifted",
        "traffic_shifted",
        "replica_synced",
    ]
    v1 = api.get("/v1/models/1").json()
    assert (
        v1["rollout"]["is_champion"]
        and v1["rollout"]["traffic_pct"] == 50.0
        and v1["rollout"]["replicas"] == ["r-a", "r-b"]
    )

    api.project(events)
    v4 = api.get("/v1/models/4").json()
    assert v4["lineage"]["ancestors"] == ["2", "1"]
    assert v4["rollout"]["status"] == "rolled_back" and not v4["rollout"]["is_candidate"]
    assert v4["rollout"]["traffic_pct"] == 0.0
    v3 = api.get("/v1/models/3").json()
    assert v3["rollout"]["status"] == "gate_failed" and v3["gate"]["reason"] == "NaN in weights"
    o2 = api.get("/v1/models/2", model=OTHER).json()
    assert o2["model"] == OTHER and o2["lineage"]["run_id"] == "o-2"


def test_unknown_model_version_is_a_clear_404(api: StatusApi) -> None:
    r = api.get("/v1/models/99")
    assert (
        r.status_code == 404
        and "no versions of 'flywheel-policy' are known yet" in r.json()["detail"]
    ), r.text
    api.project(scenario_events())
    r = api.get("/v1/models/99")
    detail = r.json()["detail"]
    assert (
        r.status_code == 404
        and "'99'" in detail
        and "unknown" in detail
        and "known versions: 1, 2, 3, 4, 5" in detail
    ), detail
    assert api.get("/v1/models/1", model="nope").status_code == 404


def test_model_version_shows_the_reward_specs_it_trained_on(api: StatusApi) -> None:
    """What trainer/shipping.py publishes for a version trained on live v1 and relabelled v2 rollouts:
    counts per spec in `reward_specs`, the relabelled share, and a comma list that may be too long
    for the 16-character column (then null, the counts still complete)."""
    from app.contracts.deployments import DeploymentEvent

    def registered(version: str, specs: dict[str, int], joined: str | None) -> DeploymentEvent:
        return DeploymentEvent(
            type="version_registered",
            model=MODEL,
            version=version,
            source="trainer",
            details={
                "run_id": "run-r",
                "rollouts_consumed": sum(specs.values()),
                "reward_spec": joined,
                "reward_specs": specs,
                "rollouts_relabelled": specs.get("v2", 0),
            },
        )

    api.project(
        [
            registered("1", {"v1": 40}, "v1"),
            registered("2", {"v1": 30, "v2": 70}, "v1,v2"),
            registered("3", {"v1": 5, "v2-no-tool-hack": 9}, None),
        ]
    )
    v2 = api.get("/v1/models/2").json()["lineage"]
    assert (v2["reward_spec"], v2["reward_specs"], v2["rollouts_relabelled"]) == (
        "v1,v2",
        {"v1": 30, "v2": 70},
        70,
    )
    v3 = api.get("/v1/models/3").json()["lineage"]
    assert (v3["reward_spec"], v3["reward_specs"]) == (None, {"v1": 5, "v2-no-tool-hack": 9})
    v1 = api.get("/v1/models/1").json()["lineage"]
    assert (v1["reward_specs"], v1["rollouts_relabelled"]) == ({"v1": 40}, 0)


def test_an_imported_version_is_projected_and_found_by_its_source(api: StatusApi) -> None:
    """`flywheel model import`'s event (trainer/model_import.py `registered_event`, built from a
    registered MLflow version) and the controller's recording of its champion alias: the history
    finds it by `source=import`, and v1's lineage is the import's."""
    from mlflow.entities.model_registry import ModelVersion, ModelVersionTag

    from app.contracts.deployments import Decision, DeploymentEvent
    from trainer.model_import import registered_event

    sha, ckpt = "a" * 64, "b" * 64
    tags = {
        "kind": "import",
        "ship_id": f"import-{sha[:16]}",
        "hf_files_sha256": sha,
        "imported_from": "/models/my-qwen-moe",
        "delta": json.dumps({"checkpoint_sha256": ckpt, "anchor": True}),
    }
    mv = ModelVersion(
        "m",
        "1",
        0,
        source="mlflow-artifacts:/1/run1/artifacts/ships/import-aaaa/model",
        run_id="run1",
        tags=[ModelVersionTag(k, v) for k, v in tags.items()],
    )
    registered = registered_event(MODEL, mv, {"type": "hf", "files_sha256": sha})
    recorded = DeploymentEvent.model_validate(
        Decision(
            type="alias_changed", version="1", details={"alias": "champion", "recorded": True}
        ).to_event(MODEL)
    )
    api.project([registered, recorded])
    found = api.get("/v1/deployments/history", source="import").json()["events"]
    assert [(e["type"], e["version"], e["actor"]) for e in found] == [
        ("version_registered", "1", "flywheel-model-import")
    ]
    v1 = api.get("/v1/models/1").json()
    assert (v1["lineage"]["run_id"], v1["lineage"]["rollouts_consumed"]) == ("run1", 0)
    assert v1["lineage"]["parent_version"] is None
    details = v1["lineage"]["details"]
    assert details["hf_files_sha256"] == sha and details["ship_id"] == tags["ship_id"]
    assert details["artifacts"]["checkpoint_sha256"] == ckpt
    assert v1["rollout"]["is_champion"]
