"""Poison records on the real broker: one bad record to each consumer, and the role goes on.

For the streams worker, the projector, the replica's sync agent and the controller: bad
records are written to the topics the role consumes (bytes that are not JSON; JSON of an
impossible shape; for streams also a malformed tick and metrics partial, and a
record that must not stop labelling: a feedback event with a lower-case `z` accepted through
the real API, whose label then closes). Then a good record follows, and each test asserts
that the role is still running, that it processed the good record, and that every bad
record is on `<ns>.dlq` with its reason and its original bytes.

Real parts: Kafka broker, PostgreSQL, MLflow server, uvicorn servers, a `python -m
streams.worker` subprocess. One failure is injected: no valid deployment event makes the SQL
projections raise any more (the event schema refuses what they cannot store), so the
projector's `apply_failed` path is provoked by replacing the fold the projector applies with one
that raises for one event type.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from tests.integration.api.conftest import api_factory  # noqa: F401  (fixture)
from tests.integration.replica.conftest import (  # noqa: F401  (fixtures)
    publish_deployment,
    register_chain,
    registered,
    replica_factory,
    status,
)
from tests.integration.rollout.stack import wait_for
from tests.integration.streams.conftest import (  # noqa: F401  (fixture)
    STALL_S,
    metric,
    produce,
    read_topic,
    read_until,
    start_worker,
)

pytestmark = pytest.mark.integration

NOT_JSON = b"\xff\xfe{not json at all"


def dead_letters(settings, consumer_prefix: str, want: int, timeout: float = 60.0) -> list[dict]:
    """The DLQ records written by `consumer_prefix*`, read until `want` arrived (and 1 s more)."""
    recs = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = [
            json.loads(r.value)
            for r in read_topic(settings, settings.topic("dlq"), 10**9, timeout=3.0, settle=0.0)
        ]
        recs = [r for r in recs if (r.get("consumer") or "").startswith(consumer_prefix)]
        if len(recs) >= want:
            break
    return recs


def original(letter: dict) -> bytes:
    return base64.b64decode(letter["value_b64"]) if letter["value_b64"] is not None else None


def produce_raw(
    settings,
    topic: str,
    records: list[tuple[bytes | None, bytes | None]],
    partition: int | None = None,
    headers: list | None = None,
) -> None:
    from app.infra.kafka import make_producer

    # a topic the worker has not created yet is waited for (the broker creates no topic on
    # request: app/infra/broker.py), however long a loaded machine takes to start the worker
    prod = make_producer(settings, key_serializer=None, max_block_ms=int(STALL_S * 1000))
    for key, value in records:
        prod.send(topic, key=key, value=value, partition=partition, headers=headers)
    prod.flush(30)
    prod.close()


def _event(type_: str, rid: str, eid: str, ts: str) -> dict:
    ev = {"type": type_, "event_id": eid, "request_id": rid, "session_id": "s-poison", "ts": ts}
    if type_ == "generation":
        ev.update(
            model_version="3",
            prompt_tokens=[72, 105],
            completion_tokens=[33, 10],
            logprobs=[-0.5, -0.25],
            temperature=1.0,
            tokenizer="byte-v1",
        )
    return ev


# --- streams --------------------------------------------------------------------------------------
def test_streams_worker_dead_letters_bad_records_and_closes_the_lower_case_z_label(
    api_factory, start_worker
):
    api = api_factory()
    settings = api.settings
    worker = start_worker(settings)
    # the exact scenario: a feedback event whose ts ends in a lower-case z is accepted (202), its label closes
    z = api.post_events(
        {
            "events": [
                _event("generation", "req-z", "g-z", "2026-11-21T10:00:00Z"),
                _event("accept", "req-z", "a-z", "2026-11-21T10:00:01.5z"),
            ]
        }
    )
    assert z.status_code == 202, z.text
    stored = [
        json.loads(r.value) for r in read_topic(settings, settings.topic("interactions"), 2, 30.0)
    ]
    assert [e["ts"] for e in stored] == [
        "2026-11-21T10:00:00.000000Z",
        "2026-11-21T10:00:01.500000Z",
    ], "ingest writes the canonical form"

    ns = settings.topic_namespace
    impossible = json.dumps(
        _event("accept", "req-bad", "a-bad", "2026-02-30T10:00:00Z")
    ).encode()  # no 30 February
    # a lower-case z as a producer other than ingest may write it, inside the next good label. The
    # good label's three records go in one batch, in order, on one partition: the reject joins an
    # open label. (Sent apart, a reject waiting for its generation is orphaned at its 2.5 s window
    # when the machine stalls between the two, and the accept then decides.)
    raw_z = json.dumps(_event("reject", "req-good", "r-raw", "2026-11-21T10:00:02z")).encode()
    good = [
        json.dumps(_event("generation", "req-good", "g-good", "2026-11-21T10:00:03Z")).encode(),
        raw_z,
        json.dumps(_event("accept", "req-good", "a-good", "2026-11-21T10:00:04Z")).encode(),
    ]
    produce(
        settings,
        [(b"k", NOT_JSON), (b"req-bad", impossible), *((b"req-good", v) for v in good)],
    )
    produce_raw(settings, f"{ns}.streams-ticks", [(None, b"tick?")], partition=0)
    bad_partial = json.dumps({"model_version": "3", "bucket_start": "soon"}).encode()
    produce_raw(settings, f"{ns}.streams-metric-partials", [(b"3", bad_partial)], partition=0)

    # waits on progress (a stuck worker fails with its thread stacks), not on a deadline
    rollouts = read_until(
        settings, settings.topic("rollouts"), 2, key_of=lambda r: r.key, alive=[worker]
    )
    by_key = {r.key: json.loads(r.value) for r in rollouts}
    assert set(by_key) == {b"req-z", b"req-good"}, f"rollouts: {sorted(by_key)}\n{worker.tail()}"
    assert by_key[b"req-z"]["reward"] == 0.75 and by_key[b"req-z"]["components"]["decision"] == 0.75
    assert by_key[b"req-good"]["reward"] == -0.25, (
        "the raw z reject (10:00:02) is the earliest decision"
    )

    letters = dead_letters(settings, "streams", 4)
    by_reason = {d["reason"]: d for d in letters}
    assert set(by_reason) == {"invalid_json", "invalid_event", "invalid_tick", "invalid_partial"}, (
        letters
    )
    assert original(by_reason["invalid_json"]) == NOT_JSON
    assert original(by_reason["invalid_event"]) == impossible
    assert by_reason["invalid_event"]["errors"][0]["field"] == "ts"
    assert (
        original(by_reason["invalid_tick"]) == b"tick?"
        and by_reason["invalid_tick"]["topic"] == f"{ns}.streams-ticks"
    )
    assert original(by_reason["invalid_partial"]) == bad_partial
    assert worker.proc.poll() is None, f"the worker exited\n{worker.tail()}"
    assert metric(worker, 'flywheel_streams_dlq_total{reason="invalid_tick"}') == 1.0
    assert metric(worker, 'flywheel_streams_dlq_total{reason="invalid_partial"}') == 1.0


# --- projector ------------------------------------------------------------------------------------
def test_projector_dead_letters_bad_records_and_keeps_projecting(
    make_settings, fresh_postgres_url, monkeypatch
):
    from app.contracts.deployments import DeploymentEvent, DeploymentLog
    from app.db.migrate import upgrade
    from app.db.models import DeploymentState
    from app.projector import projector

    settings = make_settings(model_name=f"policy-{uuid.uuid4().hex[:8]}")
    model = settings.model_name
    upgrade(fresh_postgres_url)

    fold = projector.fold

    def refuse(state, ev):  # the injected failure (see the module docstring)
        if ev.type == "canary_paused":
            raise RuntimeError("this projection cannot take a canary_paused")
        return fold(state, ev)

    monkeypatch.setattr(projector, "fold", refuse)
    stop = threading.Event()
    follower = threading.Thread(
        target=projector.follow,
        args=(settings, fresh_postgres_url, stop),
        kwargs={"group_id": f"proj-{uuid.uuid4().hex[:6]}", "poll_timeout_s": 0.5},
        daemon=True,
    )
    follower.start()
    try:
        impossible = json.dumps(
            {"type": "promoted", "model": model, "version": "latest", "source": "controller"}
        ).encode()
        mistyped = json.dumps(
            {
                "type": "version_registered",
                "model": model,
                "version": "1",
                "source": "trainer",
                "details": {"rollouts_consumed": "lots"},
            }
        ).encode()
        nul = json.dumps(
            {
                "type": "promoted",
                "model": model,
                "version": "1",
                "source": "api",
                "reason": "x\u0000y",
            }
        ).encode()
        produce_raw(
            settings,
            settings.topic("deployments"),
            [(model.encode(), v) for v in (NOT_JSON, impossible, mistyped, nul)],
        )
        with DeploymentLog(settings) as dlog:
            dlog.publish(
                DeploymentEvent(
                    type="promoted", model=model, version="1", source="controller", actor="test"
                )
            )
            paused = DeploymentEvent(
                type="canary_paused", model=model, version="1", source="api", actor="test"
            )
            dlog.publish(paused)
            dlog.publish(
                DeploymentEvent(
                    type="promoted",
                    model=model,
                    version="2",
                    from_version="1",
                    source="controller",
                    actor="test",
                )
            )

        engine = sa.create_engine(fresh_postgres_url)
        try:

            def champion():
                with engine.connect() as conn:
                    return conn.execute(
                        sa.select(DeploymentState.champion).where(DeploymentState.model == model)
                    ).scalar()

            wait_for(
                lambda: champion() == "2",
                60,
                "the projector to apply the good events after the bad ones",
            )
            with engine.connect() as conn:
                types = (
                    conn.execute(sa.text("select type from deployment_events order by seq"))
                    .scalars()
                    .all()
                )
        finally:
            engine.dispose()
        assert types == ["promoted", "promoted"], (
            "the bad records and the refused event left no row"
        )
        letters = dead_letters(settings, "projector", 5)
        assert sorted(d["reason"] for d in letters) == [
            "apply_failed",
            "invalid_event",
            "invalid_event",
            "invalid_event",
            "invalid_json",
        ], letters
        assert {original(d) for d in letters} >= {NOT_JSON, impossible, mistyped, nul}
        [failed] = [d for d in letters if d["reason"] == "apply_failed"]
        assert (
            json.loads(original(failed))["event_id"] == paused.event_id
            and "canary_paused" in failed["errors"][0]["message"]
        )
        assert all(
            d["topic"] == settings.topic("deployments") and d["offset"] is not None for d in letters
        )
        assert follower.is_alive()
    finally:
        stop.set()
        follower.join(30)


# --- replica sync agent ---------------------------------------------------------------------------
def test_replica_sync_agent_dead_letters_bad_records_and_syncs_the_next_version(
    registered, replica_factory
):
    settings, make = registered
    reg = make(anchor_every=8)
    register_chain(reg, 2, seed=3)
    publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
    srv = replica_factory(settings, id="replica-poison", retry_interval=0.5)
    wait_for(lambda: status(srv)["champion"] == "1", 90, "champion v1")

    model = settings.model_name
    impossible = json.dumps(
        {"type": "canary_started", "model": model, "version": "2", "source": "controller"}
    ).encode()  # no traffic_pct
    produce_raw(
        settings,
        settings.topic("deployments"),
        [(model.encode(), NOT_JSON), (model.encode(), impossible)],
    )
    bad_delta = b"not a delta"
    produce_raw(
        settings,
        settings.topic("deltas"),
        [(model.encode(), bad_delta)],
        headers=[("model", model.encode()), ("version", b"two")],
    )
    publish_deployment(settings, "promoted", "2", from_version="1", traffic_pct=100.0)

    wait_for(
        lambda: status(srv)["champion"] == "2", 90, "the replica to sync v2 after the bad records"
    )
    letters = dead_letters(settings, "replica:replica-poison", 3)
    by_original = {original(d): d["reason"] for d in letters}
    assert by_original == {
        NOT_JSON: "invalid_json",
        impossible: "invalid_event",
        bad_delta: "invalid_pushed_delta",
    }, letters
    assert srv.replica.agent._thread.is_alive(), "the sync agent's thread ended"


# --- controller -----------------------------------------------------------------------------------
def test_controller_dead_letters_bad_records_and_folds_the_next_event(make_settings):
    from app.contracts.deployments import DeploymentEvent, DeploymentLog
    from app.controller.config import ControllerSettings
    from app.controller.controller import Controller

    settings = make_settings(model_name=f"policy-{uuid.uuid4().hex[:8]}")
    model = settings.model_name
    cs = ControllerSettings(
        tick_interval=0.2, poll_interval=0.5, gate_enabled=False, metrics_port=0
    )
    ctl = Controller(settings, cs, client=None)
    stop, ready = threading.Event(), threading.Event()
    loop = threading.Thread(target=ctl.run, args=(stop, ready.set), daemon=True)
    loop.start()
    try:
        assert ready.wait(60), "the controller did not catch up with an empty log"
        # a version the controller orders as an int: "latest" must not raise in a tick's gate selection
        impossible = json.dumps(
            {"type": "version_registered", "model": model, "version": "latest", "source": "trainer"}
        ).encode()
        produce_raw(
            settings,
            settings.topic("deployments"),
            [(model.encode(), NOT_JSON), (model.encode(), impossible)],
        )
        bad_metrics = json.dumps(
            {"model_version": "1", "bucket_start": 0.0, "sums": {"n": -5}}
        ).encode()
        produce_raw(
            settings, settings.topic("version-metrics"), [(b"1", NOT_JSON), (b"1", bad_metrics)]
        )
        with DeploymentLog(settings) as dlog:
            dlog.publish(
                DeploymentEvent(
                    type="version_registered",
                    model=model,
                    version="1",
                    source="trainer",
                    actor="test",
                )
            )

        wait_for(
            lambda: ctl.state.gate.get("1") is True,
            60,
            "the controller to register and (not) gate v1",
        )
        assert ctl.state.registered == ["1"]
        letters = dead_letters(settings, "controller", 4)
        assert sorted((d["topic"].rsplit(".", 1)[1], d["reason"]) for d in letters) == [
            ("deployments", "invalid_event"),
            ("deployments", "invalid_json"),
            ("version-metrics", "invalid_json"),
            ("version-metrics", "invalid_metrics"),
        ], letters
        assert {original(d) for d in letters} == {NOT_JSON, impossible, bad_metrics}
        time.sleep(1.0)  # several ticks after the bad records
        assert loop.is_alive(), "the controller loop exited"
    finally:
        stop.set()
        loop.join(30)
