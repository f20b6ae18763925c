"""Where a report's data comes from, and reading it into `ReportData`.

Two places hold everything the page shows:

- **MLflow**: the registered versions and their tags (lineage, `flywheel.gate.*`,
  `heldout_acceptance[_ci_low|_ci_high]`, the agent evaluator's `heldout_task_success`, ...), the
  `flywheel-trainer` runs' per-step metrics (`reward_mean`, `kl`, `loss`; step = optimizer step)
  and the `flywheel-heldout` runs' metrics (step = version): `heldout_acceptance` of the run
  `heldout-acceptance`, and the held-out agent figures of the run `heldout-task-success`
  (app/simulate/agent_eval.py), both found by their tag `model`. For a data dir, MLflow's own SQLite store
  `<data_dir>/mlflow/mlflow.db` (where `flywheel run` keeps it, app/infra/mlflow_server.py) is read
  directly with `MlflowClient(tracking_uri="sqlite:///...")`: nothing needs to run. For a running
  stack, `--mlflow-uri` names the server.
- **The deployments log** `<ns>.deployments` (app/contracts/deployments.py), read from one of:
  `db` — its SQL projection `deployment_events` (app/projector/projector.py) in the app database
  (FLYWHEEL_DATABASE_URL, default `<data_dir>/flywheel.db`); `api` — `GET /v1/deployments/history`
  of a running API with a read key; `kafka` — the topic itself, from the beginning to its end.

- **The sessions projection** of `<ns>.rollouts` (`session_segments`, `session_turns`,
  app/projector/sessions.py) in the same app database: the sessions each version served, for
  turns per session and outcome shares. Read with the `db` source (its tables missing there is
  `SourceMissing`); with `api` or `kafka`, read from FLYWHEEL_DATABASE_URL when that database
  has them, else left out (the page's session columns are blank, the footer says why).

A source that is not there raises `SourceMissing` naming it and saying how to get it; the CLI
turns that into exit 2. A source that is there but empty (no versions, no runs, no events yet)
is not an error: the page says so per section.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from app.report.model import (
    AGENT_METRICS,
    HELDOUT,
    HELDOUT_CI,
    TRAINER_METRICS,
    ReportData,
    SessionInfo,
    VersionInfo,
)
from app.settings import Settings

log = logging.getLogger(__name__)

TRAINER_EXPERIMENT = "flywheel-trainer"  # trainer/config.py TrainerConfig.experiment
HELDOUT_EXPERIMENT = "flywheel-heldout"  # app/simulate/evaluate.py EXPERIMENT (agent_eval.py's too)
HISTORY_PAGE = 500  # app/api/routes/status.py MAX_HISTORY
EventSource = Literal["db", "api", "kafka"]


class SourceMissing(RuntimeError):
    """A source the report needs is not there (message: which, where, and how to get it)."""


@dataclass(frozen=True)
class ReportSources:
    model: str  # registered model name
    mlflow_uri: str  # http(s)://host:port of a server, or sqlite:///<data_dir>/mlflow/mlflow.db
    events: EventSource
    settings: Settings  # db_url (events=db), kafka_bootstrap and topic namespace (events=kafka)
    api_url: str | None = None  # events=api
    api_key: str | None = None  # events=api: a key with the read scope

    @classmethod
    def resolve(
        cls,
        settings: Settings,
        *,
        mlflow_uri: str | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        from_kafka: bool = False,
    ) -> ReportSources:
        """The sources for `settings.data_dir` unless a running stack's addresses are given."""
        if api_url and from_kafka:
            raise SourceMissing(
                "choose one source of deployment events: --api or --from-kafka, not both"
            )
        uri = mlflow_uri or data_dir_mlflow_uri(settings.data_dir)
        if api_url:
            key = api_key or local_read_key(settings.data_dir)
            if not key:
                raise SourceMissing(
                    f"--api {api_url} needs a key with the read scope: pass --api-key (or "
                    f"FLYWHEEL_REPORT_API_KEY); `flywheel keys create --scope read` makes one"
                )
            return cls(settings.model_name, uri, "api", settings, api_url.rstrip("/"), key)
        return cls(settings.model_name, uri, "kafka" if from_kafka else "db", settings)

    def describe(self) -> dict[str, str]:
        events = {
            "db": f"projection deployment_events in {_safe_url(self.settings.db_url)}",
            "api": f"{self.api_url}/v1/deployments/history",
            "kafka": f"topic {self.settings.topic('deployments')} on {self.settings.kafka_bootstrap}",
        }[self.events]
        return {
            "model": self.model,
            "MLflow": _safe_url(self.mlflow_uri),
            "deployment events": events,
        }


def data_dir_mlflow_uri(data_dir: Path) -> str:
    store = (data_dir / "mlflow" / "mlflow.db").resolve()
    if not store.is_file():
        raise SourceMissing(
            f"no MLflow store at {store}: `flywheel run` with FLYWHEEL_DATA_DIR={data_dir} creates it; "
            "for a running stack pass --mlflow-uri http://HOST:PORT"
        )
    return f"sqlite:///{store}"


def local_read_key(data_dir: Path) -> str | None:
    """The read key `flywheel run` keeps in `<data_dir>/local-keys.json`, if there is one."""
    import json

    path = data_dir / "local-keys.json"
    try:
        return json.loads(path.read_text()).get("read")
    except (OSError, ValueError):
        return None


def _safe_url(url: str) -> str:
    """A URL without its password (database URLs carry one)."""
    import sqlalchemy as sa

    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True) if "://" in url else url
    except sa.exc.ArgumentError:
        return url


def _utc(value: Any) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    assert isinstance(value, datetime), f"expected a timestamp, got {value!r}"
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def load_report_data(src: ReportSources) -> ReportData:
    """Read MLflow and the deployments log; SourceMissing when one of them cannot be reached."""
    from mlflow.exceptions import MlflowException

    client = _mlflow_client(src.mlflow_uri)
    data = ReportData(model=src.model, generated_at=datetime.now(UTC), sources=src.describe())
    try:
        data.versions = _versions(client, src.model)
        data.trainer = _run_metrics(
            client, TRAINER_EXPERIMENT, f"tags.model_name = '{src.model}'", TRAINER_METRICS
        )
        data.heldout = _heldout_metrics(client, src.model)
    except (
        MlflowException
    ) as exc:  # e.g. a store written by another MLflow version, a server answering 5xx
        raise SourceMissing(f"cannot read MLflow at {_safe_url(src.mlflow_uri)}: {exc}") from None
    loader = {"db": _events_from_db, "api": _events_from_api, "kafka": _events_from_kafka}[
        src.events
    ]
    data.events = loader(src)  # in log order (projection seq / topic offset)
    data.sessions, data.sources["sessions"] = _sessions_from_db(src)
    log.info(
        "report of %s: %d versions, %d trainer steps, %d deployment events",
        src.model,
        len(data.versions),
        len(data.trainer.get("reward_mean", [])),
        len(data.events),
    )
    return data


# --- MLflow -------------------------------------------------------------------------------------
def _mlflow_client(uri: str) -> Any:
    import httpx
    from mlflow import MlflowClient

    if uri.startswith(("http://", "https://")):
        try:
            httpx.get(f"{uri.rstrip('/')}/health", timeout=10).raise_for_status()
        except httpx.HTTPError as exc:
            raise SourceMissing(
                f"MLflow server at {uri} is not reachable ({exc}); is the stack running "
                "(`flywheel run`), or is --mlflow-uri wrong?"
            ) from None
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _versions(client: Any, model: str) -> list[VersionInfo]:
    found = client.search_model_versions(f"name='{model}'")
    out = [
        VersionInfo(
            str(mv.version),
            dict(mv.tags or {}),
            datetime.fromtimestamp(mv.creation_timestamp / 1000, UTC)
            if mv.creation_timestamp
            else None,
        )
        for mv in found
    ]
    return sorted(out, key=lambda vi: int(vi.version))


def _run_metrics(
    client: Any, experiment: str, run_filter: str, keys: tuple[str, ...]
) -> dict[str, list[tuple[int, float]]]:
    """Every point of `keys` over the experiment's runs that match `run_filter`, sorted by step."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    out: dict[str, list[tuple[int, float]]] = {}
    for run in client.search_runs([exp.experiment_id], filter_string=run_filter, max_results=1000):
        for key in keys:
            if key in run.data.metrics:
                points = client.get_metric_history(run.info.run_id, key)
                out.setdefault(key, []).extend((int(m.step), float(m.value)) for m in points)
    return {k: sorted(v) for k, v in out.items()}


def _heldout_metrics(client: Any, model: str) -> dict[str, list[tuple[int, float]]]:
    """The `flywheel-heldout` runs tagged with the model: `heldout-acceptance` (acceptance and its
    interval) and `heldout-task-success` (the agent figures); step = version."""
    return _run_metrics(
        client,
        HELDOUT_EXPERIMENT,
        f"tags.model = '{model}'",
        (HELDOUT, *HELDOUT_CI, *AGENT_METRICS),
    )


# --- sessions -----------------------------------------------------------------------------------
def _sessions_from_db(src: ReportSources) -> tuple[list[SessionInfo] | None, str]:
    """The sessions of the projection (live segments; relabelled copies aside) and what was read.

    With `events=db` the tables must be there (SourceMissing otherwise); with another source the
    app database is optional: (None, why) when it or its tables are not there."""
    import sqlalchemy as sa

    from app.db.models import SessionSegment as Seg
    from app.db.models import SessionTurn as Turn

    url, required = src.settings.db_url, src.events == "db"
    where = f"projection session_segments, session_turns in {_safe_url(url)}"
    engine_url = sa.engine.make_url(url)
    if (
        engine_url.get_backend_name() == "sqlite"
        and engine_url.database not in (None, "", ":memory:")
        and not Path(engine_url.database).is_file()
    ):
        assert not required, "the deployment events' loader checks the file first"
        return None, f"not read: no app database at {engine_url.database}"
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(Seg.__tablename__):
                if required:
                    raise SourceMissing(
                        f"the app database {_safe_url(url)} has no {Seg.__tablename__} table: "
                        "run `flywheel db upgrade` and `flywheel projections rebuild`"
                    )
                return None, f"not read: {_safe_url(url)} has no {Seg.__tablename__} table"
            live = Seg.relabel_run.is_(None)
            counts = conn.execute(
                sa.select(Turn.session_id, Turn.model_version, sa.func.count())
                .join(Seg, Seg.record_key == Turn.record_key)
                .where(live)
                .group_by(Turn.session_id, Turn.model_version)
            ).all()
            outcomes = conn.execute(
                sa.select(Seg.session_id, Seg.outcome)
                .where(live, Seg.outcome.is_not(None))
                .order_by(Seg.generated_at, Seg.request_id)
            ).all()
    except sa.exc.OperationalError as exc:
        if required:
            raise SourceMissing(
                f"cannot read the app database {_safe_url(url)}: {exc.orig}"
            ) from None
        return None, f"not read: {_safe_url(url)}: {exc.orig}"
    finally:
        engine.dispose()
    turns: dict[str, int] = {}
    versions: dict[str, set[str]] = {}
    for sid, version, n in counts:
        turns[sid] = turns.get(sid, 0) + n
        versions.setdefault(sid, set()).add(version)
    outcome = dict(outcomes)  # in segment order: the last one a session reached wins
    sessions = [
        SessionInfo(sid, turns[sid], outcome.get(sid), frozenset(versions[sid])) for sid in turns
    ]
    return sessions, where


# --- deployment events --------------------------------------------------------------------------
_FIELDS = (
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
)


def _events_from_db(src: ReportSources) -> list[dict[str, Any]]:
    import sqlalchemy as sa

    url = src.settings.db_url
    engine_url = sa.engine.make_url(url)
    if (
        engine_url.get_backend_name() == "sqlite"
        and engine_url.database not in (None, "", ":memory:")
        and not Path(engine_url.database).is_file()
    ):
        raise SourceMissing(
            f"no app database at {engine_url.database}: `flywheel run` with "
            f"FLYWHEEL_DATA_DIR={src.settings.data_dir} creates it (or set FLYWHEEL_DATABASE_URL); "
            "for a running stack pass --api URL or --from-kafka"
        )
    from app.db.models import DeploymentEvent as EventRow

    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(EventRow.__tablename__):
                raise SourceMissing(
                    f"the app database {_safe_url(url)} has no {EventRow.__tablename__} table: "
                    "run `flywheel db upgrade` and `flywheel projections rebuild`"
                )
            rows = (
                conn.execute(
                    sa.select(EventRow.__table__)
                    .where(EventRow.model == src.model)
                    .order_by(EventRow.seq)
                )
                .mappings()
                .all()
            )
    except sa.exc.OperationalError as exc:
        raise SourceMissing(f"cannot read the app database {_safe_url(url)}: {exc.orig}") from None
    finally:
        engine.dispose()
    return [
        {**{k: r[k] for k in _FIELDS}, "details": r["details"] or {}, "ts": _utc(r["ts"])}
        for r in rows
    ]


def _events_from_api(src: ReportSources) -> list[dict[str, Any]]:
    import httpx

    url = f"{src.api_url}/v1/deployments/history"
    events: list[dict[str, Any]] = []
    cursor: int | None = None
    with httpx.Client(headers={"Authorization": f"Bearer {src.api_key}"}, timeout=30) as http:
        while True:
            params: dict[str, Any] = {"model": src.model, "limit": HISTORY_PAGE}
            if cursor is not None:
                params["cursor"] = cursor
            try:
                resp = http.get(url, params=params)
            except httpx.HTTPError as exc:
                raise SourceMissing(
                    f"the API at {src.api_url} is not reachable ({exc}); is the stack running?"
                ) from None
            if resp.status_code in (401, 403):
                raise SourceMissing(
                    f"{url} refused the key ({resp.status_code}: {resp.text[:200]}); "
                    "pass a key with the read scope (--api-key)"
                )
            if resp.status_code != 200:
                raise SourceMissing(f"{url} answered {resp.status_code}: {resp.text[:200]}")
            page = resp.json()
            events.extend(
                {
                    **{k: e.get(k) for k in _FIELDS},
                    "details": e.get("details") or {},
                    "ts": _utc(e["ts"]),
                }
                for e in page["events"]
            )
            cursor = page.get("next_cursor")
            if cursor is None:
                return events[::-1]  # the API pages newest first


def _events_from_kafka(src: ReportSources) -> list[dict[str, Any]]:
    from kafka.errors import KafkaError

    from app.contracts.deployments import DeploymentLog

    topic = src.settings.topic("deployments")
    try:
        logged = list(DeploymentLog(src.settings).read(until_end=True, stall_timeout_s=30))
    except (KafkaError, TimeoutError, AssertionError) as exc:
        raise SourceMissing(
            f"cannot read {topic} from Kafka at {src.settings.kafka_bootstrap}: {exc}"
        ) from None
    events = [
        le.event.model_dump(mode="python") for le in logged if le.event.model == src.model
    ]  # one partition per model
    for e in events:
        e["ts"] = _utc(e["ts"])
    return events
