"""`flywheel controller`: the rollout control loop.

    Controller(settings, ControllerSettings(), client).run(stop_event)

One process per model. Started before its dependencies, it waits (app/infra/wait.py: backoff,
one log line each) for the broker and its topics, then, once it has replayed the log, for the
MLflow server and the registered model (the trainer creates it). It
1. replays `flywheel.deployments` from the beginning into `DeploymentState` (no side effects
   until it has caught up with the end of the log, so a restart never repeats a decision);
2. follows that topic and `flywheel.version-metrics` (latest record per bucket_id wins);
3. runs the offline gate on every `version_registered` version that has no gate result yet;
4. every `tick_interval` feeds the canary state machine (canary.transition) with the current
   step's window (buckets that started at or after the step start) for candidate and champion;
5. publishes what the state machine decides (events are folded into the state at once and
   skipped when they come back from the topic), then makes MLflow's aliases match the state
   (aliases.sync_aliases, under the same lock as the alias reconciler); while the log names no
   champion it first records the one MLflow's `champion` alias names (`record_serving_champion`),
   so what replicas serve is always what the log says; a canary step the replayed log shows
   running starts again first (`restart`: its window and deadline), since no controller judged it
   while this one was not running;
6. runs the polling alias reconciler in a thread and registers the MLflow webhook, so alias
   moves made in the MLflow UI come back as `alias_changed` events, which step 4 answers;
7. exposes Prometheus metrics (gauges of champion/candidate/traffic/phase, decision counters).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.contracts.aliases import read_snapshot, sync_aliases
from app.contracts.deployments import Decision
from app.controller import canary
from app.controller.config import ControllerSettings
from app.controller.reconciler import Reconciler
from app.controller.state import DeploymentState, apply_event
from app.infra.wait import Waiter
from app.registry.reconcile import alias_lock, reconcile_once
from app.settings import Settings

log = logging.getLogger(__name__)

DECISIONS = Counter(
    "flywheel_controller_decisions_total", "Deployment events published by the controller", ["type"]
)
GATE_RUNS = Counter("flywheel_controller_gate_total", "Offline gate verdicts", ["verdict"])
TRAFFIC = Gauge("flywheel_controller_candidate_traffic_pct", "Candidate's share of sessions (%)")
VERSIONS = Gauge("flywheel_controller_version", "Serving versions by role", ["role"])
PHASE = Gauge("flywheel_controller_phase", "1 for the current canary phase", ["phase"])
DELTA = Gauge(
    "flywheel_controller_last_delta", "Last analysed reward difference candidate - champion"
)
GUARDRAIL_DELTA = Gauge(
    "flywheel_controller_last_guardrail_delta",
    "Last analysed user-outcome difference candidate - champion",
    ["guardrail"],
)
CAUGHT_UP = Gauge("flywheel_controller_caught_up", "1 once the deployments log has been replayed")

GateFn = Callable[[str, str | None], Any]  # (version, champion) -> GateResult


class MetricsRecord(BaseModel):
    """The fields of a `<ns>.version-metrics` record (app.contracts.rollouts.VersionMetrics) the controller reads."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model_version: str = Field(min_length=1)
    bucket_start: float
    bucket_id: str | None = None
    n: int = Field(0, ge=0)
    sums: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _sums_add_up(self) -> MetricsRecord:
        if self.sums.get("n", 0.0) < 0 or self.sums.get("reward_sumsq", 0.0) < 0:
            raise ValueError("sums.n and sums.reward_sumsq cannot be negative")
        n, tol = self.sums.get("n", float(self.n)), 1e-6 * (1.0 + self.sums.get("n", float(self.n)))
        for name in (
            "accepts",
            "persistence_sum",
            "followup_n",
            "tool_error_rollouts",
            "rating_n",
        ):  # the canary's guardrail bounds rely on these
            if not -tol <= self.sums.get(name, 0.0) <= n + tol:
                raise ValueError(f"sums.{name} {self.sums[name]} must lie in [0, sums.n = {n}]")
        if abs(self.sums.get("followup_sum", 0.0)) > self.sums.get("followup_n", 0.0) + tol:
            raise ValueError(
                f"|sums.followup_sum| {abs(self.sums['followup_sum'])} exceeds sums.followup_n "
                f"{self.sums.get('followup_n', 0.0)} (a sentiment lies in [-1, 1])"
            )
        if abs(self.sums.get("rating_sum", 0.0)) > self.sums.get("rating_n", 0.0) + tol:
            raise ValueError(
                f"|sums.rating_sum| {abs(self.sums['rating_sum'])} exceeds sums.rating_n "
                f"{self.sums.get('rating_n', 0.0)} (a rating is -1 or +1)"
            )
        sessions = self.sums.get("sessions_n", 0.0)
        tol = 1e-6 * (1.0 + abs(sessions))
        if sessions < 0:
            raise ValueError(f"sums.sessions_n {sessions} cannot be negative")
        for name in ("session_success", "session_give_up"):  # the session guardrails rely on these
            if not -tol <= self.sums.get(name, 0.0) <= sessions + tol:
                raise ValueError(
                    f"sums.{name} {self.sums[name]} must lie in [0, sums.sessions_n = {sessions}]"
                )
        return self


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def decode_metrics(raw: bytes | None) -> dict[str, Any]:
    """A version-metrics record value as a dict the controller can sum (`window`), or InvalidRecord
    (invalid_json | invalid_metrics): checked once on arrival, not on every tick."""
    from app.contracts.deployments import InvalidRecord

    try:
        value = json.loads(raw or b"", parse_constant=_refuse_constant)
    except ValueError as exc:
        raise InvalidRecord(
            "invalid_json", [{"field": "(record)", "message": f"not valid JSON: {exc}"}]
        ) from None
    try:
        MetricsRecord.model_validate(value)
    except ValidationError as exc:
        raise InvalidRecord(
            "invalid_metrics",
            [
                {"field": ".".join(map(str, e["loc"])) or "(record)", "message": e["msg"]}
                for e in exc.errors(include_url=False)
            ],
        ) from None
    return value


class Controller:
    def __init__(
        self,
        settings: Settings,
        cs: ControllerSettings,
        client=None,
        gate: GateFn | None = None,
        clock: Callable[[], float] = time.time,
        background_gate: bool = False,
    ):
        from app.contracts.deployments import DeploymentLog

        self.settings, self.cs, self.client, self.gate, self.clock = (
            settings,
            cs,
            client,
            gate,
            clock,
        )
        self.model = settings.model_name
        self.cfg = cs.canary()
        self.state = DeploymentState(model=self.model)
        self.seen: set[str] = set()
        self.buckets: dict[str, dict[str, Any]] = {}  # bucket_id -> latest version-metrics record
        self.dlog = DeploymentLog(settings)
        self.caught_up = False
        self._synced: tuple[str | None, str | None] | None = None
        self._gate_failures: dict[str, int] = {}
        self._awaiting: set[str] = (
            set()
        )  # alias_changed events published for record_serving_champion
        self._mlflow_wait = Waiter(
            f"MLflow at {settings.mlflow_uri} to sync the aliases of {self.model}"
        )
        self.last_analysis: canary.Analysis | None = None
        # background_gate (the `flywheel controller` role): the gate (minutes on a CPU) runs in a
        # worker thread so canary analysis keeps its cadence meanwhile; tests drive it inline
        self.background_gate = background_gate
        self._gate_job: tuple[str, Any] | None = None  # (version, future) in flight
        self.dead: Any = None  # app.contracts.deadletter.DeadLetters, created with the first record

    # --- events ---------------------------------------------------------------------------------
    def publish(self, events: list[dict[str, Any]]) -> None:
        from app.contracts.deployments import DeploymentEvent

        for ev in events:
            self.dlog.publish(DeploymentEvent.model_validate(ev))
            self.seen.add(ev["event_id"])
            DECISIONS.labels(ev["type"]).inc()
            log.info(
                "%s v%s (from %s, traffic %s): %s",
                ev["type"],
                ev["version"],
                ev["from_version"],
                ev["traffic_pct"],
                ev["reason"],
            )

    def on_deployment(self, ev: dict[str, Any]) -> None:
        """Fold one deployment event (a decoded, valid DeploymentEvent as a dict) and publish what the
        state machine decides."""
        self.publish(self.fold(ev))

    def fold(self, ev: dict[str, Any]) -> list[dict[str, Any]]:
        """The state after `ev` and the decisions to publish (none before catching up). The fold and
        the state machine run before anything changes: if they raise, the state is as before."""
        eid = ev.get("event_id")
        if eid in self.seen or ev.get("model") != self.model:
            return []
        out: list[dict[str, Any]] = []
        if not self.caught_up:
            self.state = apply_event(self.state, ev)
        else:
            self.state, out = canary.transition(self.state, canary.Event(ev), self.cfg)
        self.seen.add(eid)
        if (
            ev.get("type") == "alias_changed"
        ):  # MLflow's aliases moved outside Flywheel: `_synced` is stale,
            self._synced = None  # so re-check them on the next tick even if the state returns to it
        return out

    def on_metrics(self, rec: dict[str, Any]) -> None:
        """Keep one version-metrics record (latest per bucket_id); `consume` checked it (MetricsRecord)."""
        bid = rec.get("bucket_id") or f"{rec.get('model_version')}/{rec.get('bucket_start')}"
        self.buckets[bid] = rec

    def consume(self, rec: Any) -> None:
        """One record of the deployments or version-metrics topic. A record that does not decode, or
        that the fold or the state machine cannot take, is dead-lettered (docs/DEPLOYMENTS.md, "Bad
        records") and the loop goes on. Publishing the decisions is outside that: a failure there
        (Kafka, or an invalid decision: a bug) propagates as before, the input record is not blamed."""
        from app.contracts.deadletter import DeadLetters, error
        from app.contracts.deployments import InvalidRecord, decode_event

        if self.dead is None:
            self.dead = DeadLetters(self.settings, consumer="controller")
        try:
            if rec.topic == self.settings.topic("deployments"):
                decisions = self.fold(decode_event(rec.value).model_dump(mode="json"))
            else:
                self.on_metrics(decode_metrics(rec.value))
                return
        except InvalidRecord as exc:
            self.dead.send(rec, exc.reason, exc.errors)
            return
        except Exception as exc:
            log.exception("%s[%d]@%d could not be folded", rec.topic, rec.partition, rec.offset)
            self.dead.send(rec, "apply_failed", error("(apply)", f"{type(exc).__name__}: {exc}"))
            return
        self.publish(decisions)

    def window(self, version: str | None, since: datetime | None) -> canary.ArmStats:
        """Sufficient statistics of `version`'s rewards, user outcomes and ended agent sessions over
        buckets that started at or after `since` (a sum a record lacks counts 0)."""
        if version is None or since is None:
            return canary.ArmStats()
        t0 = since.timestamp()
        total = canary.ArmStats()
        for rec in self.buckets.values():
            if str(rec.get("model_version")) == version and float(rec.get("bucket_start", 0)) >= t0:
                s = rec.get("sums") or {}
                total = total + canary.ArmStats.from_sums({"n": rec.get("n", 0), **s})
        return total

    # --- periodic work ----------------------------------------------------------------------------
    def restart(self) -> None:
        """Once the log is replayed, before the first tick: a canary step the log shows running
        starts again (canary.restart_step), so the minutes this controller was not running are
        not held against it."""
        self.state, out = canary.transition(self.state, canary.Restart(self._now()), self.cfg)
        self.publish(out)

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), tz=UTC)

    def tick(self) -> None:
        now = self._now()
        self.run_gates()
        s = self.state
        if s.phase == "canary" and s.candidate is not None:
            inp: canary.Input = canary.Observe(
                now,
                self.window(s.candidate, s.step_started_at),
                self.window(s.champion, s.step_started_at),
            )
        else:
            inp = canary.Tick(now)
        self.state, out = canary.transition(self.state, inp, self.cfg)
        if isinstance(
            inp, canary.Observe
        ):  # for /metrics and logs only (not part of the folded state)
            self.last_analysis = canary.analyze(inp.candidate, inp.champion, self.cfg)
        self.publish(out)
        self._sync_mlflow_or_wait()
        self._export()

    def _sync_mlflow_or_wait(self) -> None:
        """sync_mlflow, but an MLflow server that went away is waited for (one log line, the next
        tick tries again) instead of ending the controller; the decisions are in the log already."""
        from mlflow.exceptions import MlflowException
        from requests import RequestException

        try:
            self.sync_mlflow()
        except (MlflowException, RequestException, OSError) as exc:
            self._mlflow_wait.pending(f"{type(exc).__name__}: {str(exc)[:300]}")
            return
        if self._mlflow_wait.active:
            self._mlflow_wait.there()

    def run_gates(self) -> None:
        """Gate the newest registered version without a verdict, once there is a champion (older ones
        it supersedes are not gated: the trainer's line moved on, and gating each would let a backlog
        of versions hold the controller). In a background thread when `background_gate` (the role),
        so canary analysis keeps its cadence during a gate of minutes; its verdict is applied on the
        first tick after it finished."""
        if self._gate_job is not None:
            v, fut = self._gate_job
            if fut.done():
                self._gate_job = None
                self._apply_gate(v, fut)
            return
        gated = [v for v in self.state.registered if v in self.state.gate]
        newest_gated = max(gated, key=canary.vkey) if gated else None
        pending = [
            v
            for v in self.state.registered
            if v not in self.state.gate
            and self._gate_failures.get(v, 0) < 3
            and (newest_gated is None or canary.vkey(v) > canary.vkey(newest_gated))
        ]
        if not pending:
            return
        # no champion yet: in order (the base first); then the newest, skipping what it supersedes
        v = (
            max(pending, key=canary.vkey)
            if self.state.champion is not None
            else min(pending, key=canary.vkey)
        )
        if not self.cs.gate_enabled or self.gate is None:
            why = (
                "gate disabled (FLYWHEEL_CONTROLLER_GATE_ENABLED=false)"
                if not self.cs.gate_enabled
                else "no gate runner"
            )
            self._record_gate(
                Decision(
                    type="gate_passed",
                    version=v,
                    reason=f"not gated: {why}",
                    details={"passed": True, "checks": [], "skipped": why},
                )
            )
            return
        fut: Future = Future()
        run = functools.partial(self._run_gate, self.gate, v, self.state.champion, fut)
        if self.background_gate:
            # a daemon thread: a stopping controller does not wait minutes for a gate; nothing was
            # recorded, so the version is gated again after a restart
            threading.Thread(target=run, name=f"gate-v{v}", daemon=True).start()
            self._gate_job = (v, fut)
        else:
            run()
            self._apply_gate(v, fut)

    @staticmethod
    def _run_gate(gate: GateFn, v: str, champion: str | None, fut: Future) -> None:
        try:
            fut.set_result(gate(v, champion))
        except BaseException as exc:
            fut.set_exception(exc)

    def _apply_gate(self, v: str, fut: Future) -> None:
        try:
            result = fut.result()
        except Exception as exc:  # artifacts missing, MLflow away: retry, then fail closed
            self._gate_failures[v] = self._gate_failures.get(v, 0) + 1
            log.exception("gate of v%s could not run (attempt %d)", v, self._gate_failures[v])
            if self._gate_failures[v] < 3:
                return
            self._record_gate(
                Decision(
                    type="gate_failed",
                    version=v,
                    reason=f"gate could not run: {exc!r}"[:4000],
                    details={"passed": False, "error": repr(exc)[:2000]},
                )
            )
            return
        if self.client is not None:
            for k, val in result.tags().items():
                self.client.set_model_version_tag(self.model, v, k, val)
        self._record_gate(result.decision(v, self.state.champion))

    def _record_gate(self, decision: Decision) -> None:
        GATE_RUNS.labels(decision.type).inc()
        ev = decision.to_event(self.model)
        self.seen.add(ev["event_id"])
        self.state, out = canary.transition(self.state, canary.Event(ev), self.cfg)
        self.publish([ev, *out])

    def sync_mlflow(self) -> None:
        """Make MLflow's aliases match the state (first publishing any move made outside Flywheel)."""
        if self.client is None:
            return
        if self.state.champion is None and self.record_serving_champion():
            return  # the log names the serving champion now; sync on the next tick
        want = (self.state.champion, self.state.candidate)
        if want == self._synced:
            return
        with alias_lock:
            moved = reconcile_once(self.client, self.model, self.publish_foreign, via="poll")
            if moved:
                return  # fold the outside move first; sync next tick
            sync_aliases(self.client, self.model, {"champion": want[0], "candidate": want[1]})
        self._synced = want

    def record_serving_champion(self) -> bool:
        """While the log names no champion, record the one MLflow's `champion` alias names, which is
        what replicas are asked to serve: the trainer sets that alias on its base version (as
        Flywheel, acknowledged), and an operator may set it in the MLflow UI before any controller
        ran. An outside move is published by the reconciler as `alias_changed` from `mlflow-ui`; a
        Flywheel-made one becomes `alias_changed` from `controller`. Either way the deployment log,
        the status API and the replicas name the same champion. Returns True if it published."""
        if self._awaiting - self.seen:
            return True  # an outside move was published: it names the champion once it comes back
        with alias_lock:
            moved = reconcile_once(self.client, self.model, self.publish_foreign, via="poll")
            if moved:
                self._awaiting = {ev["event_id"] for ev in moved}
                return True
            alias = read_snapshot(self.client, self.model).aliases["champion"]
        if alias is None:
            return False
        ev = Decision(
            type="alias_changed",
            version=alias,
            reason=(
                f"recorded the serving champion: MLflow's champion alias names version {alias} (set by Flywheel, "
                f"e.g. the trainer on its base version) and the deployment log named none"
            ),
            details={"alias": "champion", "recorded": True},
        ).to_event(self.model)
        self.seen.add(ev["event_id"])
        self.state, out = canary.transition(self.state, canary.Event(ev), self.cfg)
        self.publish([ev, *out])
        self._synced = None
        return True

    def publish_foreign(self, ev: dict[str, Any]) -> None:
        """An alias_changed event found by the reconciler: publish, and let the loop fold it when it comes back."""
        from app.contracts.deployments import DeploymentEvent

        self.dlog.publish(DeploymentEvent.model_validate(ev))

    def _export(self) -> None:
        s = self.state
        TRAFFIC.set(s.traffic_pct)
        VERSIONS.labels("champion").set(int(s.champion) if s.champion else -1)
        VERSIONS.labels("candidate").set(int(s.candidate) if s.candidate else -1)
        for p in ("idle", "canary", "paused"):
            PHASE.labels(p).set(1.0 if s.phase == p else 0.0)
        if self.last_analysis is not None and self.last_analysis.delta is not None:
            DELTA.set(self.last_analysis.delta)
            for name, g in self.last_analysis.guardrails.items():
                GUARDRAIL_DELTA.labels(name).set(g["delta"])

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event, on_ready: Callable[[], None] | None = None) -> None:
        from kafka import TopicPartition

        from app.infra.kafka import make_consumer
        from app.infra.wait import Stopped, kafka_ready

        dep_topic, met_topic = (
            self.settings.topic("deployments"),
            self.settings.topic("version-metrics"),
        )
        try:
            kafka_ready(self.settings, [dep_topic, met_topic], stop)
        except Stopped:
            self.dlog.close()
            return
        consumer = make_consumer(self.settings, group_id=None)
        reconciler = None
        try:
            dep = [
                TopicPartition(dep_topic, p)
                for p in sorted(consumer.partitions_for_topic(dep_topic) or [])
            ]
            met = [
                TopicPartition(met_topic, p)
                for p in sorted(consumer.partitions_for_topic(met_topic) or [])
            ]
            assert dep and met, (
                f"topics {dep_topic} / {met_topic} missing; run `flywheel kafka start` first"
            )
            consumer.assign(dep + met)
            consumer.seek_to_beginning(*dep)
            lookback_ms = int((self.clock() - self.cs.step_deadline - 3600) * 1000)
            starts = consumer.offsets_for_times({tp: max(lookback_ms, 0) for tp in met})
            ends = consumer.end_offsets(dep + met)
            for tp in met:
                consumer.seek(tp, starts[tp].offset if starts.get(tp) else ends[tp])
            dep_end = {tp: ends[tp] for tp in dep}
            log.info(
                "controller for %s: replaying %s (%d events)",
                self.model,
                dep_topic,
                sum(dep_end.values()),
            )
            next_tick = 0.0
            while not stop.is_set():
                batch = consumer.poll(timeout_ms=200)
                for records in batch.values():
                    for rec in records:
                        self.consume(rec)
                if not self.caught_up and all(consumer.position(tp) >= dep_end[tp] for tp in dep):
                    self.caught_up = True
                    CAUGHT_UP.set(1)
                    log.info(
                        "caught up: champion %s, candidate %s, phase %s",
                        self.state.champion,
                        self.state.candidate,
                        self.state.phase,
                    )
                    if not self._wait_for_registry(stop):
                        break
                    self.restart()
                    reconciler = self._start_alias_watch()
                    if on_ready is not None:
                        on_ready()
                if self.caught_up and time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.cs.tick_interval
                    self.tick()
        finally:
            if reconciler is not None:
                reconciler.stop()
            consumer.close()
            self.dlog.close()
            if self.dead is not None:
                self.dead.close()

    def _wait_for_registry(self, stop: threading.Event) -> bool:
        """Before the first MLflow call: wait for the server and the registered model (the trainer
        creates it). Records on the topics stay there meanwhile. False if `stop` came first."""
        from app.infra.wait import Stopped, mlflow_ready, registered_model_ready

        if self.client is None:
            return True
        try:
            mlflow_ready(self.settings.mlflow_uri, stop)
            registered_model_ready(self.client, self.model, stop)
        except Stopped:
            return False
        return True

    def _start_alias_watch(self) -> Reconciler | None:
        if self.client is None:
            return None
        if self.cs.webhooks_enabled:
            from app.registry.webhooks import ensure_webhook

            url = (
                self.cs.webhook_url
                or f"http://{self.settings.api_host}:{self.settings.api_port}/v1/hooks/mlflow"
            )
            try:
                ensure_webhook(self.client, self.model, url, self.settings.effective_webhook_secret)
            except Exception:  # the poller still carries every move out
                log.exception(
                    "could not register the MLflow webhook at %s; relying on polling", url
                )
        return Reconciler(
            self.client, self.model, self.publish_foreign, self.cs.poll_interval
        ).start()
