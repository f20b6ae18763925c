"""Event sourcing on the real broker: publish deployment events, project them incrementally
with the consumer-group follower, rebuild into a second empty database and in place, and
compare every projection table row for row (docs/DESIGN.md §Invariants: replaying flywheel.deployments from
the beginning rebuilds the SQL projections exactly). SQLite and PostgreSQL.

    .venv/bin/pytest tests/integration/deployments/test_event_sourcing.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from kafka import KafkaConsumer, KafkaProducer
from sqlalchemy.orm import Session

from app.contracts.deployments import DeploymentEvent, DeploymentLog
from app.db.models import DeploymentState
from app.projector.projector import follow, projection_rows, rebuild
from tests.unit.deployments.scenario import EXPECTED_STATUS, MODEL, scenario_events

pytestmark = pytest.mark.integration


def _count(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("select count(*) from deployment_events")).scalar()
    finally:
        engine.dispose()


def _wait_for(url: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (have := _count(url)) < n:
        assert time.monotonic() < deadline, f"projector applied {have}/{n} events in {timeout}s"
        time.sleep(0.2)


def _rows(url: str) -> dict:
    engine = sa.create_engine(url)
    try:
        with Session(engine) as s:
            return projection_rows(s)
    finally:
        engine.dispose()


def test_publish_is_acknowledged_keyed_by_model_and_read_back_in_order(make_settings) -> None:
    settings = make_settings()
    events = scenario_events()[:6]
    with DeploymentLog(settings) as dlog:
        positions = [dlog.publish(e) for e in events]
        assert [p for p, _ in positions] == [0] * 6
        assert [o for _, o in positions] == sorted(o for _, o in positions) and len(
            {o for _, o in positions}
        ) == 6
        logged = list(dlog.read())
    assert [le.event for le in logged] == events
    assert [(le.partition, le.offset) for le in logged] == positions

    raw = KafkaConsumer(
        settings.topic("deployments"),
        bootstrap_servers=settings.kafka_bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=5000,
    )
    records = [r for r, _ in zip(raw, range(6))]
    raw.close()
    assert [r.key for r in records] == [MODEL.encode()] * 6
    assert [DeploymentEvent.from_bytes(r.value) for r in records] == events


def test_read_of_an_empty_topic_returns_at_once(make_settings) -> None:
    settings = make_settings()
    started = time.monotonic()
    assert list(DeploymentLog(settings).read()) == []
    assert time.monotonic() - started < 30


def test_incremental_projection_equals_a_rebuild_into_an_empty_database(
    make_settings, db_pair
) -> None:
    incremental, rebuilt = db_pair
    settings = make_settings()
    events = scenario_events()
    unique = len({e.event_id for e in events})
    stop = threading.Event()
    errors: list[BaseException] = []

    def _follow() -> None:
        try:
            follow(
                settings,
                db_url=incremental,
                stop=stop,
                group_id="projector-test",
                poll_timeout_s=0.2,
            )
        except BaseException as exc:  # surfaced by the asserts below
            errors.append(exc)

    follower = threading.Thread(target=_follow, daemon=True)
    follower.start()
    try:
        with DeploymentLog(settings) as dlog:
            half = len(events) // 2
            for e in events[:half]:
                dlog.publish(e)
            _wait_for(incremental, half)  # applied while the rest is not yet published
            mid = _rows(incremental)
            mid_status = {
                r["version"]: r["status"] for r in mid["model_versions"] if r["model"] == MODEL
            }
            assert mid_status == {"1": "retired", "2": "champion", "3": "gate_failed"}, mid_status
            for e in events[half:]:
                dlog.publish(e)
            # a record that is not an event: skipped identically by both paths
            raw = KafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
            raw.send(settings.topic("deployments"), key=MODEL.encode(), value=b"{not json").get(10)
            raw.close()
            dlog.publish(events[0])  # a late re-publish of the first event: deduped
        _wait_for(incremental, unique)
        time.sleep(1.0)  # let the follower pass the tail (the duplicates) and commit
    finally:
        stop.set()
        follower.join(30)
    assert not follower.is_alive() and not errors, errors

    a = _rows(incremental)
    assert len(a["deployment_events"]) == unique
    assert {
        r["version"]: r["status"] for r in a["model_versions"] if r["model"] == MODEL
    } == EXPECTED_STATUS
    state = next(r for r in a["deployment_state"] if r["model"] == MODEL)
    assert (state["champion"], state["candidate"], state["phase"]) == ("1", None, "idle")

    report = rebuild(settings, db_url=rebuilt)
    assert (report.events_read, report.events_applied) == (len(events) + 1, unique)
    b = _rows(rebuilt)
    for table in a:
        assert a[table] == b[table], f"{table} differs between incremental projection and rebuild"

    rebuild(settings, db_url=incremental)  # in place: resets through the append-only guard
    c = _rows(incremental)
    for table in a:
        assert c[table] == a[table], f"{table} differs after an in-place rebuild"
    with (
        sa.create_engine(incremental).connect() as conn,
        pytest.raises(sa.exc.DBAPIError, match="append-only"),
    ):
        conn.execute(sa.text("delete from deployment_events"))


def test_follower_resumes_from_its_committed_offsets(make_settings, tmp_path: Path) -> None:
    from app.db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'p.db'}"
    upgrade(url)
    settings = make_settings()
    events = scenario_events()[:10]
    with DeploymentLog(settings) as dlog:
        for e in events[:5]:
            dlog.publish(e)
        for batch_end in (5, 10):
            stop = threading.Event()
            t = threading.Thread(
                target=follow,
                kwargs={
                    "settings": settings,
                    "db_url": url,
                    "stop": stop,
                    "group_id": "resume-test",
                    "poll_timeout_s": 0.2,
                },
                daemon=True,
            )
            t.start()
            _wait_for(url, batch_end)
            time.sleep(0.5)
            stop.set()
            t.join(30)
            if batch_end == 5:
                for e in events[5:]:
                    dlog.publish(e)
    from kafka import TopicPartition

    from app.infra.kafka import make_consumer

    c = make_consumer(settings, group_id="resume-test")
    committed = c.committed(TopicPartition(settings.topic("deployments"), 0))
    c.close()
    assert committed == 10, f"the follower committed offset {committed}, expected 10"
    assert _count(url) == 10


def test_cli_projections_rebuild(make_settings, tmp_path: Path) -> None:
    settings = make_settings()
    with DeploymentLog(settings) as dlog:
        for e in scenario_events():
            dlog.publish(e)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_DATA_DIR=str(tmp_path / "cli"),
        FLYWHEEL_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        FLYWHEEL_TOPIC_NAMESPACE=settings.topic_namespace,
    )
    flywheel = Path(sys.executable).parent / "flywheel"
    for _ in range(2):  # the second run rebuilds over a populated database
        proc = subprocess.run(
            [str(flywheel), "projections", "rebuild"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "33 events read, 32 applied, 1 duplicates" in " ".join(proc.stderr.split()), (
            proc.stderr
        )
    engine = sa.create_engine(f"sqlite:///{(tmp_path / 'cli' / 'flywheel.db').resolve()}")
    with Session(engine) as s:
        state = s.get(DeploymentState, MODEL)
        assert (state.champion, state.candidate, state.phase) == ("1", None, "idle")
    engine.dispose()
