"""Shared fixtures: the real parts the tests run against.

- `kafka`: a real single-node Apache Kafka 4.x (KRaft) broker, started once per test run (one
  for all xdist workers, tests/shared.py) on free ports in a temporary data dir
  (app/infra/broker.py, jars from Maven Central).
- `make_settings`: Settings pointing at that broker, each call with its own topic namespace
  (so tests never see each other's records) and its topics created.
- `postgres_url`: the real PostgreSQL server that `make test` provisions
  (deploy/postgres/ensure.sh). Missing server = loud failure, never a skip.
  `fresh_postgres_url`: a new database per test, whose drop ends only the test's own sessions.
- `mlflow_server`: a real `mlflow server` (SQLite store, local artifacts) on a free port, one per
  test run like the broker.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.settings import Settings
from tests.scheduling import (
    CpuMeter,
    DurationRecorder,
    StackLimitedScheduling,
    load_durations,
    longest_first,
)
from tests.shared import shared_service, stop_all, under_xdist

pytest_plugins = ["pytester"]  # tests/unit/test_scheduling.py runs pytest inside pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:  # noqa: F821
    """The run's broker: one for all xdist workers (tests/shared.py), or this session's own."""
    from app.infra.broker import LocalKafka
    from app.infra.procs import group_alive

    existing = os.environ.get("FLYWHEEL_TEST_KAFKA_BOOTSTRAP")
    if existing:  # reuse a broker someone started (e.g. while iterating locally)
        host, _, port = existing.rpartition(":")
        broker = LocalKafka(home=tmp_path_factory.mktemp("kafka-ext"), port=int(port), host=host)
        broker.wait_ready(30)
        yield broker
        return

    def new_broker(home: Path) -> LocalKafka:
        return LocalKafka(home=home, port=free_port(), controller_port=free_port(), heap="1g")

    if under_xdist():

        def start(home: Path) -> dict:
            broker = new_broker(home)
            broker.start(timeout=120)
            return {"pgid": broker.pid(), "port": broker.port, "cport": broker.cport}

        record = shared_service(
            tmp_path_factory.getbasetemp(), "kafka", start, lambda r: group_alive(r["pgid"])
        )
        yield LocalKafka(
            home=Path(record["home"]), port=record["port"], controller_port=record["cport"]
        )
        return  # the controller stops it (pytest_sessionfinish)
    broker = new_broker(tmp_path_factory.mktemp("kafka"))
    broker.start(timeout=120)
    yield broker
    broker.stop()


@pytest.fixture()
def make_settings(kafka, tmp_path: Path) -> Callable[..., Settings]:
    """Build Settings on the test broker with a fresh topic namespace; topics are created."""
    from app.infra.broker import ensure_topics

    def _make(create_topics: bool = True, **overrides) -> Settings:
        values = {
            "data_dir": tmp_path / "data",
            "kafka_bootstrap": kafka.bootstrap,
            "topic_namespace": f"t{uuid.uuid4().hex[:10]}",
            "interactions_partitions": 3,
            "rollouts_partitions": 3,
        }
        values.update(overrides)
        s = Settings(**values)
        s.data_dir.mkdir(parents=True, exist_ok=True)
        if create_topics:
            ensure_topics(s)
        return s

    return _make


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """URL of the real PostgreSQL test database; fails loudly when it is not reachable."""
    import sqlalchemy as sa

    url = os.environ.get(
        "FLYWHEEL_TEST_POSTGRES_URL",
        "postgresql+psycopg://flywheel:flywheel@127.0.0.1:5432/flywheel_test",
    )
    try:
        with sa.create_engine(url).connect() as conn:
            conn.execute(sa.text("select 1"))
    except Exception as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {url} ({exc}); run deploy/postgres/ensure.sh (make test does)"
        )
    return url


@pytest.fixture()
def fresh_postgres_url(postgres_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database for one test (dropped afterwards). Its URL names every
    connection made through it (`application_name` = the database's name), so the drop ends
    only the sessions this test opened."""
    import sqlalchemy as sa

    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    name, url = create_test_database(admin, postgres_url)
    try:
        yield url
    finally:
        sa.create_engine(url).dispose()
        drop_test_database(admin, name)
        admin.dispose()


def create_test_database(admin, postgres_url: str) -> tuple[str, str]:
    """Create a uniquely named database; returns (name, URL of it whose connections carry
    `application_name=<name>`)."""
    import sqlalchemy as sa

    name = f"fw_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'create database "{name}"'))
    url = sa.make_url(postgres_url).set(database=name)
    url = url.update_query_dict({"application_name": name})
    return name, url.render_as_string(hide_password=False)


def drop_test_database(admin, name: str, patience_s: float = 30.0) -> None:
    """Drop a database made by `create_test_database`: end the sessions the test opened on it
    (its `application_name`; nobody else's), then drop it. A session that is not the test's
    keeps the database in use: a non-superuser may not end an autovacuum worker that happens
    to be vacuuming it, and such a worker finishes within moments, so the drop is retried for
    `patience_s` and then fails naming the sessions still there."""
    import sqlalchemy as sa
    from tenacity import RetryError, retry, retry_if_exception_type, stop_after_delay, wait_fixed

    @retry(
        retry=retry_if_exception_type(sa.exc.DBAPIError),
        stop=stop_after_delay(patience_s),
        wait=wait_fixed(0.5),
    )
    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "select pg_terminate_backend(pid) from pg_stat_activity "
                    "where datname = :db and application_name = :db and pid <> pg_backend_pid()"
                ),
                {"db": name},
            )
            conn.execute(sa.text(f'drop database if exists "{name}"'))

    try:
        drop()
    except RetryError as exc:
        with admin.connect() as conn:
            left = conn.execute(
                sa.text(
                    "select pid, usename, application_name, backend_type from pg_stat_activity "
                    "where datname = :db"
                ),
                {"db": name},
            ).all()
        raise RuntimeError(
            f"test database {name} is still in use after {patience_s:g} s by sessions the test "
            f"did not open: "
            f"{[tuple(r) for r in left]}"
        ) from exc.last_attempt.exception()


class MlflowServer:
    """`mlflow server` exactly as `flywheel run` starts it (app/infra/mlflow_server.py)."""

    def __init__(self, root: Path, port: int, extra_env: dict[str, str] | None = None):
        from app.infra.mlflow_server import start_server

        self.root, self.port = root, port
        self.uri = f"http://127.0.0.1:{port}"
        self.log = open(root / "mlflow.log", "ab")
        self.proc = start_server(root, "127.0.0.1", port, extra_env, log=self.log)

    def wait_ready(self, timeout: float = 300.0) -> None:
        from app.infra.mlflow_server import wait_healthy

        try:
            wait_healthy(self.uri, timeout, proc=self.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; see {self.root / 'mlflow.log'}") from None

    def stop(self) -> None:
        from app.infra.mlflow_server import stop_server

        stop_server(self.proc, timeout=20)
        self.log.close()


@dataclass(frozen=True)
class SharedMlflow:
    """The run's MLflow server as a worker that did not start it sees it (tests/shared.py)."""

    root: Path
    port: int

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# the server caches its webhook list; tests register webhooks mid-session
MLFLOW_TEST_ENV = {"MLFLOW_WEBHOOK_CACHE_TTL": "1"}


@pytest.fixture(scope="session")
def mlflow_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[MlflowServer | SharedMlflow]:
    """A real MLflow tracking + registry server (SQLite backend, local artifact store): one for
    all xdist workers (tests/shared.py), or this session's own. Tests share it by model name."""
    if under_xdist():

        def start(home: Path) -> dict:
            server = MlflowServer(home, free_port(), MLFLOW_TEST_ENV)
            try:
                server.wait_ready()
            except Exception:
                server.stop()
                raise
            return {"pgid": server.proc.pid, "port": server.port}

        def alive(record: dict) -> bool:
            import httpx

            try:
                url = f"http://127.0.0.1:{record['port']}/health"
                return httpx.get(url, timeout=10).status_code == 200
            except httpx.HTTPError:
                return False

        record = shared_service(tmp_path_factory.getbasetemp(), "mlflow", start, alive)
        yield SharedMlflow(Path(record["home"]), record["port"])
        return  # the controller stops it (pytest_sessionfinish)
    root = tmp_path_factory.mktemp("mlflow")
    server = MlflowServer(root, free_port(), MLFLOW_TEST_ENV)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The xdist controller (or a plain run) stops the servers its workers shared."""
    if not under_xdist():
        stop_all(session.config._tmp_path_factory.getbasetemp())


class StackLimits:
    """`--dist load` with at most FLYWHEEL_TEST_MAX_STACKS whole stacks at once (tests/scheduling.py)."""

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        if config.getvalue("dist") == "load":
            return StackLimitedScheduling(config, log)
        return None


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller (or a plain run) records each test's duration for the next run's
    queue order, and xdist schedules with the stack limit (tests/scheduling.py)."""
    if not under_xdist():
        config.pluginmanager.register(DurationRecorder(), "flywheel-test-durations")
    config.pluginmanager.register(CpuMeter(), "flywheel-test-cpu")  # fires where tests run
    if config.pluginmanager.hasplugin("xdist"):  # absent under `-p no:xdist`
        config.pluginmanager.register(StackLimits(), "flywheel-stack-limits")


# a test that takes one of these needs a server of the run (the broker, MLflow, PostgreSQL)
STACK_FIXTURES = frozenset(
    {"kafka", "make_settings", "mlflow_server", "postgres_url", "fresh_postgres_url"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tests that need a server of the run `stack` (`make test-fast` leaves them out).
    Under xdist, the longest tests are queued first (tests/scheduling.py); a plain run keeps
    pytest's order."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            item.get_closest_marker("e2e")
            or STACK_FIXTURES & set(getattr(item, "fixturenames", ()))
            or "postgresql" in params.values()  # db_url / db_pair take PostgreSQL by parameter
        ):
            item.add_marker(pytest.mark.stack)
    if under_xdist():
        longest_first(items, load_durations())
