"""Start order: every role started before what it depends on stays up, says what it waits for,
and does its job once the dependency appears (app/infra/wait.py, docs/SCALING.md "Start order").

Real parts only. "Not up yet" is real too: a Kafka broker (app.infra.broker.LocalKafka) started
on a chosen free port after the roles, a second `mlflow server` started later on its port, and
the real PostgreSQL behind a TCP forwarder that starts listening later (the database is
"unreachable" until then, exactly as a database that is still booting).

- the controller, in-process on the session broker and MLflow server, before the model is
  registered: it waits (one log line), then records the champion the trainer set, gates the
  versions that get registered, starts a canary, and an alias move made in MLflow reaches the
  deployment log; an MLflow server that goes away later is waited for too;
- `flywheel api`, `flywheel projections follow`, `flywheel streams`, `flywheel trainer` and
  `flywheel replica` as processes before the broker, MLflow and the database: each stays up and
  logs what it waits for (the API's and the replica's /readyz say it); then the broker, the
  database and MLflow appear, and the API becomes ready, the trainer registers its base
  version, the projector writes it to the database, a controller started then records it as
  champion, the replica serves it (what /v1/deployments says), and the streams worker turns
  the replica's generation into a rollout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.settings import Settings
from tests.conftest import REPO, MlflowServer, free_port

pytestmark = pytest.mark.integration

TINY_POLICY = {
    "type": "moe-byte",
    "d_model": 16,
    "n_layers": 1,
    "n_heads": 2,
    "d_ff": 16,
    "n_experts": 2,
    "top_k": 1,
    "max_context": 128,
}


def wait_until(
    pred: Callable[[], Any],
    timeout_s: float,
    what: str,
    every: float = 0.5,
    detail: Callable[[], str] | None = None,
) -> Any:
    """`pred()` until truthy; on timeout the message ends with `detail()` (a role's log tail: CI
    shows the assertion message even where it cuts the captured output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = pred()
        except (httpx.HTTPError, OSError):
            got = None
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout_s:.0f}s waiting for {what}"
                + (f"\n{detail()}" if detail else "")
            )
        time.sleep(every)


def deployment_events(settings: Settings) -> list[dict[str, Any]]:
    from app.contracts.deployments import DeploymentLog

    return [le.event.model_dump(mode="json") for le in DeploymentLog(settings).read(until_end=True)]


# --- the controller before the registered model (in-process) --------------------------------
def test_controller_started_before_the_model_is_registered_waits_then_gates_and_carries_alias_moves(
    make_settings, mlflow_server, caplog, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from app.contracts.aliases import read_snapshot, sync_aliases
    from app.contracts.deployments import Decision, DeploymentEvent, DeploymentLog
    from app.controller.config import ControllerSettings
    from app.controller.controller import Controller
    from app.controller.gate import GateResult
    from app.controller.monitors import Check

    model = f"start-order-{uuid.uuid4().hex[:8]}"
    settings = make_settings(model_name=model, mlflow_uri=mlflow_server.uri)
    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    gated: list[tuple[str, str | None]] = []

    def gate(
        version: str, champion: str | None
    ) -> GateResult:  # the verdict; the real gate has its own tests
        gated.append((version, champion))
        return GateResult([Check("synthetic", "pass", detail=f"v{version} vs champion {champion}")])

    cs = ControllerSettings(
        tick_interval=0.2, poll_interval=0.5, webhooks_enabled=False, metrics_port=0
    )
    ctl = Controller(
        settings, cs, client, gate=gate, background_gate=True
    )  # as `flywheel controller` runs it
    stop, ready = threading.Event(), threading.Event()
    th = threading.Thread(
        target=ctl.run, args=(stop, ready.set), name="controller-start-order", daemon=True
    )
    caplog.set_level(logging.INFO)
    th.start()
    try:
        waiting_line = f"waiting for the registered model {model}"
        wait_until(
            lambda: any(waiting_line in r.getMessage() for r in caplog.records),
            60,
            "the waiting line",
        )
        time.sleep(3.0)  # a few backoff rounds: it must still be there, neither exited nor ready
        assert th.is_alive(), "the controller exited instead of waiting for the registered model"
        assert not ready.is_set()
        assert sum(waiting_line in r.getMessage() for r in caplog.records) == 1, (
            "one line per wait, not one per try"
        )

        # the trainer's first ship: model, base version, the champion alias (as Flywheel), the event
        client.create_registered_model(model)
        run = client.create_run(client.create_experiment(f"exp-{model}"))
        (tmp_path / "w.txt").write_text("weights")
        client.log_artifact(run.info.run_id, str(tmp_path / "w.txt"), artifact_path="w")
        for _ in range(2):
            client.create_model_version(
                model, source=f"{run.info.artifact_uri}/w", run_id=run.info.run_id
            )
        sync_aliases(client, model, {"champion": "1"})

        def announce(version: str) -> None:
            with DeploymentLog(settings) as dlog:
                dlog.publish(
                    DeploymentEvent.model_validate(
                        Decision(
                            type="version_registered",
                            version=version,
                            source="trainer",
                            actor="trainer",
                        ).to_event(model)
                    )
                )

        announce("1")
        assert ready.wait(60), "the controller did not go on once the model was registered"
        assert any(
            f"the registered model {model} is there" in r.getMessage() for r in caplog.records
        )

        def types() -> list[tuple[str, str | None, str]]:
            return [(e["type"], e["version"], e["source"]) for e in deployment_events(settings)]

        # what serves (the trainer's alias) is in the log, so replicas and the status API agree
        wait_until(
            lambda: ("alias_changed", "1", "controller") in types(), 30, "the recorded champion"
        )
        wait_until(lambda: ("gate_passed", "1", "controller") in types(), 30, "the gate of v1")
        assert ctl.state.champion == "1"
        assert read_snapshot(client, model).aliases["champion"] == "1", (
            "the trainer's alias must stay"
        )

        announce("2")
        wait_until(
            lambda: ("canary_started", "2", "controller") in types(),
            30,
            "the gate and canary of v2",
        )
        assert ("2", "1") in gated, gated

        client.set_registered_model_alias(
            model, "champion", "2"
        )  # an operator's move in the MLflow UI
        wait_until(
            lambda: ("alias_changed", "2", "mlflow-ui") in types(),
            30,
            "the UI move in the deployment log",
        )
        wait_until(
            lambda: ctl.state.champion == "2" and ctl.state.candidate is None, 30, "v2 champion"
        )
        assert ("promoted", "2", "mlflow-ui") in types()
        assert th.is_alive()
    finally:
        stop.set()
        th.join(30)
    assert not th.is_alive()


def test_controller_tick_waits_for_an_mlflow_server_that_went_away(
    make_settings, monkeypatch, caplog
) -> None:
    """Aliases are synced every tick; an MLflow server that is gone is waited for, not fatal."""
    from mlflow import MlflowClient

    from app.contracts.deployments import Decision
    from app.controller.config import ControllerSettings
    from app.controller.controller import Controller
    from app.infra.wait import waiting

    monkeypatch.setenv(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"
    )  # fail each call at once (default: minutes of retries)
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    model = f"start-order-{uuid.uuid4().hex[:8]}"
    settings = make_settings(model_name=model, mlflow_uri=gone)
    ctl = Controller(
        settings,
        ControllerSettings(webhooks_enabled=False, metrics_port=0),
        MlflowClient(tracking_uri=gone, registry_uri=gone),
    )
    ctl.caught_up = True
    caplog.set_level(logging.INFO)
    try:
        ctl.on_deployment(
            Decision(
                type="promoted", version="1", traffic_pct=100.0, source="api", actor="test"
            ).to_event(model)
        )
        for _ in range(3):
            ctl.tick()  # raised MlflowException out of the controller's loop before
        what = f"MLflow at {gone} to sync the aliases of {model}"
        assert what in waiting(), waiting()
        assert sum(f"waiting for {what}" in r.getMessage() for r in caplog.records) == 1
        assert ctl.state.champion == "1"
    finally:
        ctl.dlog.close()
        ctl._mlflow_wait.there()  # leave no waiting() entry behind for later tests in this process


# --- every other role before the broker, MLflow and the database (processes) ----------------
class TcpForwarder:
    """Accepts on 127.0.0.1:`port` and pipes each connection to `target`: a database that is
    reachable from the moment `start()` is called."""

    def __init__(self, port: int, target: tuple[str, int]):
        self.port, self.target = port, target
        self.sock: socket.socket | None = None
        self.closed = threading.Event()

    def start(self) -> TcpForwarder:
        self.sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, name=f"forward-{self.port}", daemon=True).start()
        return self

    def _accept(self) -> None:
        assert self.sock is not None
        while not self.closed.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.closed.set()
        if self.sock is not None:
            self.sock.close()


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the test process dies (a killed pytest leaves no role behind)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Role:
    """`python -m app.cli <argv>` with its output in a log file, in its own process group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.name, self.log_path = name, log_dir / f"{name}.log"
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", *argv],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n{self.text()[-4000:]}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_log(self, needle: str, timeout_s: float) -> None:
        def seen() -> bool:
            assert self.alive(), f"{self.name} exited instead of waiting:\n{self.tail()}"
            return needle in self.text()

        wait_until(seen, timeout_s, f"{needle!r} in the log of {self.name}")

    def wait_line(self, *parts: str, timeout_s: float) -> None:
        """Until one line of the log contains every one of `parts`."""

        def seen() -> bool:
            assert self.alive(), f"{self.name} exited:\n{self.tail()}"
            return any(all(p in line for p in parts) for line in self.text().splitlines())

        wait_until(seen, timeout_s, f"a line with {parts} in the log of {self.name}")

    def stop(self, timeout_s: float = 30.0) -> None:
        from app.infra.procs import stop_groups

        stop_groups([self.proc], timeout_s)


@dataclass
class _Stack:
    """What the steps share: the ports, the settings and environment of the roles, the roles
    (started first) and what they wait for, started later (the broker, the database's
    forwarder, MLflow; then a controller)."""

    postgres_url: str  # the real database, reached directly (not through the forwarder)
    ports: dict[str, int]
    settings: Settings
    env: dict[str, str]
    logs: Path
    roles: list[Role]  # api, projections, streams, trainer, replica
    broker: Any  # app.infra.broker.LocalKafka
    forwarder: TcpForwarder
    mlflow: MlflowServer | None = None
    controller: Role | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['api']}"

    @property
    def replica_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['replica']}"

    def role(self, name: str) -> Role:
        return next(role for role in self.roles if role.name == name)

    def write_tails(self) -> None:
        """Every role's log tail on stderr (on failure)."""
        for role in [*self.roles, *([self.controller] if self.controller else [])]:
            sys.stderr.write(role.tail() + "\n")

    def stop(self) -> None:
        for role in [*([self.controller] if self.controller else []), *reversed(self.roles)]:
            role.stop()
        if self.mlflow is not None:
            self.mlflow.stop()
        self.forwarder.stop()
        self.broker.stop()


def _role_env(
    settings: Settings, ports: dict[str, int], data_dir: Path, ns: str, model: str, db_url: str
) -> dict[str, str]:
    """Every role's environment: the settings, short waits and intervals, a tiny policy."""
    return dict(
        os.environ,
        COLUMNS="400",
        PYTHONUNBUFFERED="1",  # rich wraps log lines at the console width
        FLYWHEEL_DATA_DIR=str(data_dir),
        FLYWHEEL_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        FLYWHEEL_TOPIC_NAMESPACE=ns,
        FLYWHEEL_MODEL_NAME=model,
        FLYWHEEL_MLFLOW_URI=settings.mlflow_uri,
        MLFLOW_TRACKING_URI=settings.mlflow_uri,
        FLYWHEEL_DATABASE_URL=db_url,
        FLYWHEEL_WAIT_WINDOW="2s",
        FLYWHEEL_STREAMS_SESSION_TIMEOUT="8s",
        FLYWHEEL_TRAINER_POLICY=json.dumps(TINY_POLICY),
        FLYWHEEL_TRAINER_PRETRAIN_STEPS="0",
        FLYWHEEL_CONTROLLER_WEBHOOKS_ENABLED="false",
        FLYWHEEL_CONTROLLER_GATE_ENABLED="false",
        FLYWHEEL_CONTROLLER_TICK_INTERVAL="0.5s",
        FLYWHEEL_CONTROLLER_METRICS_PORT=str(ports["controller"]),
        FLYWHEEL_REPLICA_RETRY_INTERVAL="2s",
        FLYWHEEL_REPLICA_HEARTBEAT_INTERVAL="5s",
    )


def _start_roles_first(fresh_postgres_url: str, tmp_path: Path) -> _Stack:
    """The roles started, as processes, before anything they depend on: the broker and the
    database's forwarder are made (not started), MLflow not yet."""
    from sqlalchemy.engine import make_url

    from app.infra.broker import LocalKafka

    ports = {
        k: free_port()
        for k in (
            "kafka",
            "quorum",
            "mlflow",
            "db",
            "api",
            "replica",
            "streams",
            "trainer",
            "controller",
        )
    }
    real_db = make_url(fresh_postgres_url)
    db_url = real_db.set(host="127.0.0.1", port=ports["db"]).render_as_string(hide_password=False)
    model, ns = f"start-order-{uuid.uuid4().hex[:8]}", f"so{uuid.uuid4().hex[:8]}"
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    settings = Settings(
        data_dir=data_dir,
        kafka_bootstrap=f"127.0.0.1:{ports['kafka']}",
        topic_namespace=ns,
        model_name=model,
        mlflow_uri=f"http://127.0.0.1:{ports['mlflow']}",
        database_url=db_url,
    )
    env = _role_env(settings, ports, data_dir, ns, model, db_url)
    logs = tmp_path / "logs"
    logs.mkdir()
    roles = [
        Role("api", ["api", "--port", str(ports["api"])], env, logs),
        Role("projections", ["projections", "follow"], env, logs),
        Role("streams", ["streams", "--port", str(ports["streams"])], env, logs),
        Role("trainer", ["trainer", "--port", str(ports["trainer"])], env, logs),
        Role(
            "replica",
            ["replica", "--port", str(ports["replica"]), "--replica-id", "start-order-1"],
            env,
            logs,
        ),
    ]
    broker = LocalKafka(
        home=tmp_path / "kafka", port=ports["kafka"], controller_port=ports["quorum"], heap="512m"
    )
    forwarder = TcpForwarder(ports["db"], (real_db.host or "127.0.0.1", real_db.port or 5432))
    return _Stack(fresh_postgres_url, ports, settings, env, logs, roles, broker, forwarder)


def _alone_each_role_waits(s: _Stack) -> None:
    """Alone: each stays up and says what it waits for (in its log, /readyz, /metrics)."""
    api, projections, streams, trainer, replica = s.roles
    kafka_line = f"waiting for Kafka at {s.settings.kafka_bootstrap}"
    api.wait_log("waiting for the database at", 240)
    projections.wait_log("waiting for the database at", 240)
    streams.wait_log(kafka_line, 240)
    trainer.wait_log(f"waiting for the MLflow server at {s.settings.mlflow_uri}", 240)
    replica.wait_log(kafka_line, 240)
    r = httpx.get(f"{s.api_url}/readyz", timeout=30)
    assert r.status_code == 503 and r.json()["failed"] == ["database", "kafka"], r.text
    assert "migrations not applied yet" in r.json()["checks"]["database"]["detail"], r.text
    assert any("database" in k for k in r.json()["waiting_for"]), r.text
    r = httpx.get(f"{s.replica_url}/readyz", timeout=30)
    assert r.status_code == 503 and any("Kafka" in k for k in r.json()["waiting_for"]), r.text
    waiting_metric = httpx.get(f"http://127.0.0.1:{s.ports['streams']}/metrics", timeout=30).text
    assert (
        f'flywheel_waiting_for{{dependency="Kafka at {s.settings.kafka_bootstrap}"}} 1.0'
        in waiting_metric
    )
    assert all(role.alive() for role in s.roles), "\n".join(role.tail() for role in s.roles)


def _mlflow_first(s: _Stack, tmp_path: Path) -> None:
    """MLflow first: the trainer goes on to wait for the broker; the others still wait."""
    trainer = s.role("trainer")
    s.mlflow = MlflowServer(tmp_path, s.ports["mlflow"])
    s.mlflow.wait_ready()
    trainer.wait_log(f"the MLflow server at {s.settings.mlflow_uri} is there", 120)
    trainer.wait_log(f"waiting for Kafka at {s.settings.kafka_bootstrap}", 120)
    assert all(role.alive() for role in s.roles), "\n".join(role.tail() for role in s.roles)


def _broker_and_database_appear(s: _Stack) -> None:
    """The broker (with the topics, as `flywheel kafka start` makes them) and the database:
    the API becomes ready, every role waiting for them goes on."""
    from app.infra.broker import ensure_topics

    api, projections, streams, trainer, replica = s.roles
    s.broker.start(timeout=180)
    ensure_topics(s.settings)
    s.forwarder.start()
    wait_until(
        lambda: httpx.get(f"{s.api_url}/readyz", timeout=30).status_code == 200,
        180,
        "the API ready",
    )
    # (the API does not wait for Kafka, its producer connects lazily; projections waits for
    # the database first, so by then the broker is up and there is no Kafka wait to log)
    for role in (streams, trainer, replica):
        role.wait_line(f"Kafka at {s.settings.kafka_bootstrap}", "is there", timeout_s=120)
    projections.wait_log("projector following", 120)
    replica.wait_log(f"waiting for a champion named in {s.settings.topic('deployments')}", 120)


def _base_version_registered_and_projected(s: _Stack) -> dict[str, str]:
    """The trainer registers its base version; the projector writes it down. Returns an API key
    (made once the database is there)."""
    trainer = s.role("trainer")

    def base_registered() -> bool:
        assert trainer.alive(), f"the trainer exited:\n{trainer.tail()}"
        return any(
            e["type"] == "version_registered" and e["version"] == "1"
            for e in deployment_events(s.settings)
        )

    wait_until(base_registered, 300, "the trainer's base version", detail=lambda: trainer.tail())
    keys = _keys(s.postgres_url)
    wait_until(
        lambda: _projected_types(s.postgres_url) >= {"version_registered"},
        60,
        "the projection",
    )
    return keys


def _controller_records_what_serves(s: _Stack, keys: dict[str, str]) -> None:
    """A controller started now records what serves; the replica serves what the log says."""
    s.controller = Role("controller", ["controller"], s.env, s.logs)
    wait_until(
        lambda: httpx.get(f"{s.replica_url}/readyz", timeout=10).json().get("champion") == "1",
        240,
        "the replica serving v1",
    )

    def status_champion() -> str | None:
        r = httpx.get(
            f"{s.api_url}/v1/deployments",
            params={"model": s.settings.model_name},
            headers={"Authorization": f"Bearer {keys['read']}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        return r.json()["models"][0]["champion"] if r.json()["models"] else None

    wait_until(
        lambda: status_champion() == "1", 60, "GET /v1/deployments naming the served champion"
    )
    s.role("replica").wait_log(f"a champion named in {s.settings.topic('deployments')} is there", 5)


def _streams_labels_a_generation(s: _Stack) -> None:
    """The streams worker labels the replica's generation (no feedback: closed by the window);
    every role is still up, with no traceback in its log."""
    done = httpx.post(
        f"{s.replica_url}/v1/complete",
        json={"session_id": "s-1", "prompt": "def f(", "max_tokens": 4},
        timeout=60,
    )
    assert done.status_code == 200, done.text
    request_id = done.json()["request_id"]
    wait_until(
        lambda: request_id in _rollout_ids(s.settings),
        120,
        "the rollout of the replica's generation",
    )
    for role in (*s.roles, s.controller):
        assert role.alive(), role.tail()
        assert "Traceback" not in role.text(), role.tail()


def test_roles_started_before_the_broker_mlflow_and_database_wait_then_work(
    fresh_postgres_url: str, tmp_path: Path
) -> None:
    """The module docstring's roles as processes before the broker, MLflow and the database: each
    waits, then works once they appear (every role's log tail on stderr on failure). Needs over a
    minute: every role is its own process importing its stack, and the broker, MLflow and the
    database start after them."""
    s = _start_roles_first(fresh_postgres_url, tmp_path)
    try:
        # 1. alone: each stays up and says what it waits for
        _alone_each_role_waits(s)
        # 2. MLflow first: the trainer goes on to wait for the broker; the others still wait
        _mlflow_first(s, tmp_path)
        # 3. the broker and the database: the roles go on, the trainer registers its base
        # version and the projector writes it down
        _broker_and_database_appear(s)
        keys = _base_version_registered_and_projected(s)
        # 4. a controller started now records what serves; the replica serves what the log says
        _controller_records_what_serves(s, keys)
        # 5. the streams worker labels the replica's generation
        _streams_labels_a_generation(s)
    except BaseException:
        s.write_tails()
        raise
    finally:
        s.stop()


def _keys(db_url: str) -> dict[str, str]:
    from app.db.keys import create_key
    from app.db.session import session_scope

    with session_scope(db_url) as session:
        key, _ = create_key(session, ["read"], name="start-order")
    return {"read": key}


def _projected_types(db_url: str) -> set[str]:
    import sqlalchemy as sa

    from app.db.session import get_engine

    with get_engine(db_url).connect() as conn:
        return {row[0] for row in conn.execute(sa.text("SELECT type FROM deployment_events"))}


def _rollout_ids(settings: Settings) -> set[str]:
    from kafka import TopicPartition

    from app.infra.kafka import make_consumer

    consumer = make_consumer(settings, group_id=None)
    try:
        topic = settings.topic("rollouts")
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        ids: set[str] = set()
        while any(consumer.position(tp) < end[tp] for tp in tps):
            for records in consumer.poll(timeout_ms=1000).values():
                ids.update(json.loads(r.value).get("request_id") for r in records if r.value)
        return ids
    finally:
        consumer.close()
