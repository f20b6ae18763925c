"""The live status view of `flywheel run`: roles, the base policy's pretraining, versions, traffic
split, held-out acceptance per version, recent decisions.

Every source is read over HTTP, as an operator would; one that does not answer (not started yet,
restarting) is left out of that refresh:

- the status API with the local read key: `GET /v1/deployments` (champion, candidate, the traffic
  split `traffic.champion_pct` / `candidate_pct`, phase, replicas, next ship) and
  `GET /v1/deployments/history` (the decisions);
- the trainer's Prometheus `/metrics` (FLYWHEEL_TRAINER_METRICS_PORT): the pretraining of the base
  policy on an empty registry, `flywheel_trainer_pretrain_step` / `_steps` / `_loss`
  (trainer/metrics.py). Read only until pretraining is seen finished or a champion exists (a
  registry with a champion is never pretrained for);
- MLflow's model registry (`GET /api/2.0/mlflow/model-versions/search`): held-out acceptance per
  version, the tags `heldout_acceptance` and `heldout_acceptance_ci_low` / `_ci_high` that the
  simulator's evaluator sets on each version it scored (app/simulate/evaluate.py), or with agent
  users the held-out task success, `heldout_task_success` and its `_ci_low` / `_ci_high`
  (app/simulate/agent_eval.py);
- the supervisor's view of the role processes.

Without a terminal (`flywheel run --no-live`, piped output) the same facts are log lines, each
printed once: pretraining progress at every tenth of its steps, the traffic split whenever it
changes, one line per newly scored version and one per new deployment decision (the history's
events other than the replicas' own; on a resumed run the first read says only the last 8).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

PRETRAIN_METRICS = (
    "flywheel_trainer_pretrain_step",
    "flywheel_trainer_pretrain_steps",
    "flywheel_trainer_pretrain_loss",
)
HELDOUT_TAG = "heldout_acceptance"  # app/simulate/evaluate.py METRIC
HELDOUT_CI_TAGS = ("heldout_acceptance_ci_low", "heldout_acceptance_ci_high")
TASK_TAG = "heldout_task_success"  # app/simulate/agent_eval.py METRIC (agent users)
TASK_CI_TAGS = ("heldout_task_success_ci_low", "heldout_task_success_ci_high")
HISTORY_LIMIT = 50  # events read per refresh (the table shows the last HISTORY_SHOWN)
HISTORY_SHOWN = 8
HELDOUT_SHOWN = 12
# history events about a replica's own state, not a decision (left out of the log lines)
REPLICA_EVENTS = frozenset({"replica_synced", "replica_sync_failed", "replica_heartbeat"})


def trainer_metrics_url(env: Mapping[str, str], host: str = "127.0.0.1") -> str | None:
    """The `/metrics` URL of the trainer `flywheel run` starts with `env` (its
    FLYWHEEL_TRAINER_METRICS_PORT, else the trainer's default); None when the port is 0 (off)
    or not a port."""
    from trainer.config import TrainerConfig

    raw = env.get("FLYWHEEL_TRAINER_METRICS_PORT")
    try:
        port = int(raw) if raw else int(TrainerConfig.model_fields["metrics_port"].default)
    except ValueError:
        return None
    return f"http://{host}:{port}/metrics" if 0 < port < 65536 else None


@dataclass(frozen=True)
class Pretraining:
    """The trainer's pretraining of the base policy, as its gauges last said."""

    step: int
    steps: int
    loss: float | None

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    @property
    def pct(self) -> int:
        return int(100 * self.step / self.steps)

    def bar(self, width: int = 40) -> str:
        done = width * self.step // self.steps
        return "█" * done + "░" * (width - done)

    def describe(self) -> str:
        loss = "" if self.loss is None or self.step == 0 else f", loss {self.loss:.3f}"
        if self.done:
            return f"pretraining the base policy: done, {self.steps} steps{loss}"
        return f"pretraining the base policy: step {self.step}/{self.steps} ({self.pct}%){loss}"


@dataclass(frozen=True)
class HeldOut:
    """A version's held-out acceptance as the simulator scored it (with its 95% interval)."""

    version: int
    acceptance: float  # or the held-out task success, for agent users (`figure`)
    ci_low: float | None = None
    ci_high: float | None = None
    figure: str = "acceptance"  # "acceptance" | "task success"

    def interval(self) -> str:
        if self.ci_low is None or self.ci_high is None:
            return ""
        return f"[{self.ci_low:.3f}, {self.ci_high:.3f}]"

    def describe(self) -> str:
        ci = self.interval()
        return f"held-out {self.figure} v{self.version}: {self.acceptance:.3f}" + (
            f" {ci}" if ci else ""
        )


@dataclass
class Snapshot:
    """One refresh of every source (None / empty where a source did not answer)."""

    status: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    pretraining: Pretraining | None = None
    heldout: list[HeldOut] = field(default_factory=list)

    @property
    def models(self) -> list[dict[str, Any]]:
        return list((self.status or {}).get("models") or [])

    def has_champion(self) -> bool:
        return any(m.get("champion") for m in self.models)


def parse_pretraining(text: str) -> Pretraining | None:
    """The pretraining gauges out of a Prometheus text exposition; None when this process has
    not pretrained (`_steps` absent or 0) or the text does not parse."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in PRETRAIN_METRICS:
                    values[sample.name] = sample.value
    except Exception:  # not a Prometheus exposition (another server on the port): no progress
        return None
    steps = int(values.get("flywheel_trainer_pretrain_steps", 0))
    if steps <= 0:
        return None
    step = min(steps, max(0, int(values.get("flywheel_trainer_pretrain_step", 0))))
    loss = values.get("flywheel_trainer_pretrain_loss")
    return Pretraining(step, steps, loss)


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def parse_heldout(payload: Any) -> list[HeldOut]:
    """Held-out results out of an MLflow `model-versions/search` answer, by version."""
    out = []
    for mv in (payload or {}).get("model_versions") or []:
        tags = {t.get("key"): t.get("value") for t in mv.get("tags") or [] if isinstance(t, dict)}
        try:
            version = int(mv.get("version"))
        except (TypeError, ValueError):
            continue
        for tag, ci_tags, figure in (
            (HELDOUT_TAG, HELDOUT_CI_TAGS, "acceptance"),
            (TASK_TAG, TASK_CI_TAGS, "task success"),
        ):
            value = _float(tags.get(tag))
            if value is not None:
                low, high = (_float(tags.get(t)) for t in ci_tags)
                out.append(HeldOut(version, value, low, high, figure))
                break
    return sorted(out, key=lambda h: h.version)


def _v(version: Any) -> str:
    return "-" if version in (None, "") else f"v{version}"


def _pct(value: Any) -> str:
    number = _float(value)
    return "-" if number is None else f"{number:g}%"


def traffic_split(model: Mapping[str, Any]) -> str:
    """`champion% / candidate%` of a `GET /v1/deployments` model entry."""
    traffic = model.get("traffic") or {}
    return f"{_pct(traffic.get('champion_pct'))} / {_pct(traffic.get('candidate_pct'))}"


class StatusView:
    def __init__(
        self,
        api_url: str,
        read_key: str,
        supervisor: Any,
        interval_s: float = 2.0,
        *,
        mlflow_uri: str | None = None,
        model_name: str | None = None,
        trainer_metrics_url: str | None = None,
    ):
        self.api_url, self.sup, self.interval_s = api_url, supervisor, interval_s
        self.mlflow_uri, self.model_name = mlflow_uri, model_name
        self.trainer_metrics_url = trainer_metrics_url
        self.http = httpx.Client(
            base_url=api_url, headers={"Authorization": f"Bearer {read_key}"}, timeout=3
        )
        self.plain = httpx.Client(timeout=2)  # MLflow and the trainer's /metrics: no API key
        self.messages: list[str] = []
        self._pretraining: Pretraining | None = None  # last seen; kept once it finished
        self._pretraining_over = False  # finished, or a champion exists: the trainer is not read
        # what the log lines already said (run(live=False))
        self._said_pretraining: tuple[int, int] | None = None  # (tenth, step) of the last line
        self._said_traffic: dict[str, tuple[Any, ...]] = {}
        self._said_heldout: set[int] = set()
        self._said_seq: int | None = None

    # --- sources ----------------------------------------------------------------------------
    def _get(self, path: str, **params: Any) -> Any:
        try:
            r = self.http.get(path, params=params)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def _get_plain(self, url: str, **params: Any) -> httpx.Response | None:
        try:
            r = self.plain.get(url, params=params)
            return r if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def _read_pretraining(self, champion: bool) -> Pretraining | None:
        if self._pretraining_over or self.trainer_metrics_url is None:
            return self._pretraining
        r = self._get_plain(self.trainer_metrics_url)
        seen = parse_pretraining(r.text) if r is not None else None
        if seen is not None:
            self._pretraining = seen
        # read once more when the champion appears: the last read may have missed the end
        self._pretraining_over = champion or (seen is not None and seen.done)
        return self._pretraining

    def _read_heldout(self) -> list[HeldOut]:
        if not self.mlflow_uri or not self.model_name:
            return []
        r = self._get_plain(
            f"{self.mlflow_uri.rstrip('/')}/api/2.0/mlflow/model-versions/search",
            filter=f"name='{self.model_name}'",
        )
        try:
            return parse_heldout(r.json()) if r is not None else []
        except ValueError:
            return []

    def fetch(self) -> Snapshot:
        """Read every source once."""
        status = self._get("/v1/deployments")
        history = self._get("/v1/deployments/history", limit=HISTORY_LIMIT)
        snap = Snapshot(status=status, history=list((history or {}).get("events") or []))
        snap.pretraining = self._read_pretraining(snap.has_champion())
        snap.heldout = self._read_heldout()
        return snap

    # --- the live view ----------------------------------------------------------------------
    def render(self, snap: Snapshot | None = None) -> Group:
        snap = self.fetch() if snap is None else snap
        roles = Table(title="roles", expand=True)
        for col in ("role", "pid", "state", "restarts", "url"):
            roles.add_column(col)
        for rp in self.sup.roles:
            roles.add_row(
                rp.spec.name,
                str(rp.proc.pid if rp.proc else "-"),
                rp.state,
                str(rp.restarts),
                rp.spec.url or "",
            )
        parts: list[Any] = [roles]
        pre = snap.pretraining
        if pre is not None and not snap.has_champion():
            table = Table(title="base policy pretraining (trainer)", expand=True)
            for col in ("step", "progress", "loss"):
                table.add_column(col)
            table.add_row(
                f"{pre.step}/{pre.steps}" + (" done" if pre.done else ""),
                f"{pre.bar()} {pre.pct}%",
                "-" if pre.loss is None or pre.step == 0 else f"{pre.loss:.3f}",
            )
            parts.append(table)
        if snap.status is not None:
            dep = Table(title="deployments", expand=True)
            for col in (
                "model",
                "champion",
                "candidate",
                "traffic champion / candidate",
                "phase",
                "replicas",
                "next ship",
            ):
                dep.add_column(col)
            for m in snap.models:
                reps = ", ".join(
                    f"{r.get('replica_id')}:{r.get('champion_version')}/{r.get('candidate_version')}"
                    for r in m.get("replicas", [])
                )
                dep.add_row(
                    str(m.get("model")),
                    str(m.get("champion")),
                    str(m.get("candidate")),
                    traffic_split(m),
                    str(m.get("phase")),
                    reps,
                    str(m.get("next_checkpoint_eta")),
                )
            parts.append(dep)
        if snap.heldout:
            roles_of = {}
            for m in snap.models:
                if m.get("model") == self.model_name or len(snap.models) == 1:
                    roles_of[str(m.get("champion"))] = "champion"
                    roles_of[str(m.get("candidate"))] = "candidate"
            figure = snap.heldout[-1].figure
            held = Table(title=f"held-out {figure} per version (simulated users)", expand=True)
            for col in ("version", figure, "95% interval", "serving as"):
                held.add_column(col)
            for h in snap.heldout[-HELDOUT_SHOWN:]:
                held.add_row(
                    f"v{h.version}",
                    f"{h.acceptance:.3f}",
                    h.interval(),
                    roles_of.get(str(h.version), ""),
                )
            parts.append(held)
        if snap.history:
            hist = Table(title="last decisions", expand=True)
            for col in ("ts", "type", "version", "from", "source", "reason"):
                hist.add_column(col)
            for e in snap.history[:HISTORY_SHOWN]:
                hist.add_row(
                    str(e.get("ts", ""))[:19],
                    e.get("type", ""),
                    str(e.get("version")),
                    str(e.get("from_version")),
                    e.get("source", ""),
                    (e.get("reason") or "")[:60],
                )
            parts.append(hist)
        if self.messages:
            parts.append("\n".join(self.messages[-5:]))
        return Group(*parts)

    # --- log lines (--no-live) --------------------------------------------------------------
    def new_lines(self, snap: Snapshot) -> list[str]:
        """The facts of `snap` not said yet, one line each."""
        lines: list[str] = []
        pre = snap.pretraining
        if pre is not None:
            tenth = 10 if pre.done else pre.step * 10 // pre.steps
            said = self._said_pretraining
            # every tenth once; a restarted pretraining (fewer steps than said) starts over
            if said is None or tenth > said[0] or pre.step < said[1]:
                lines.append(pre.describe())
                self._said_pretraining = (tenth, pre.step)
        for m in snap.models:
            if not m.get("champion"):
                continue
            traffic = m.get("traffic") or {}
            key = (
                m.get("champion"),
                m.get("candidate"),
                traffic.get("champion_pct"),
                traffic.get("candidate_pct"),
                m.get("phase"),
            )
            name = str(m.get("model"))
            if self._said_traffic.get(name) != key:
                self._said_traffic[name] = key
                split = f"champion {_v(m.get('champion'))} {_pct(traffic.get('champion_pct'))}"
                if m.get("candidate"):
                    split += f" / candidate {_v(m.get('candidate'))} {_pct(traffic.get('candidate_pct'))}"
                lines.append(f"traffic {name}: {split} ({m.get('phase')})")
        for h in snap.heldout:
            if h.version not in self._said_heldout:
                self._said_heldout.add(h.version)
                lines.append(h.describe())
        fresh = [
            e
            for e in snap.history
            if isinstance(e.get("seq"), int)
            and (self._said_seq is None or e["seq"] > self._said_seq)
        ]
        decisions = [
            e for e in sorted(fresh, key=lambda e: e["seq"]) if e.get("type") not in REPLICA_EVENTS
        ]
        if self._said_seq is None:  # a resumed run: the last few decisions as context, not all
            decisions = decisions[-HISTORY_SHOWN:]
        for e in decisions:
            frm = f" from {_v(e.get('from_version'))}" if e.get("from_version") else ""
            pct = f" at {_pct(e.get('traffic_pct'))}" if e.get("traffic_pct") is not None else ""
            reason = f": {e.get('reason')}" if e.get("reason") else ""
            lines.append(
                f"decision {e.get('type')} {_v(e.get('version'))}{frm}{pct} "
                f"({e.get('source', '')}){reason}"
            )
        if fresh:
            self._said_seq = max(e["seq"] for e in fresh)
        return lines

    def run(
        self, live: bool = True, until: float | None = None, stop: threading.Event | None = None
    ) -> None:
        """Refresh every `interval_s` until `until` (time.monotonic()) or `stop` is set; the live
        view, or log lines with `live=False` or when stdout is no terminal (a Live view writes to
        a pipe or a file only its last frame, when it stops)."""
        stop = stop or threading.Event()

        def going() -> bool:
            return not stop.is_set() and (until is None or time.monotonic() < until)

        if not live or not Console().is_terminal:
            while going():
                for line in self.sup.poll() + self.new_lines(self.fetch()):
                    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)
                self._sleep(until, stop)
            return
        with Live(self.render(), refresh_per_second=1, screen=False) as view:
            while going():
                self.messages.extend(self.sup.poll())
                view.update(self.render())
                self._sleep(until, stop)

    def _sleep(self, until: float | None, stop: threading.Event) -> None:
        left = self.interval_s if until is None else min(self.interval_s, until - time.monotonic())
        if left > 0:
            stop.wait(left)
