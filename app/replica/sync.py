"""The sync agent: follow `<ns>.deployments`, make the replica serve what the log says it should.

    agent = SyncAgent(settings, cfg, store, cache)   # store/cache: app/replica/weights.py
    agent.start()    # a daemon thread; agent.stop() ends it

On start the agent reads the deployment log from the beginning and folds it with the
controller's own pure fold (`app.contracts.deployment_state.fold`: champion, candidate, traffic split), so
every replica derives the same desired state from the same log. It then keeps following the
topic and, whenever what it serves differs from what is desired, reconciles:

- a version it already holds (the candidate being promoted, or the old champion coming back
  after a rollback) is reused as is; nothing is fetched;
- otherwise `fetch.VersionFetcher` reconstructs the version from MLflow artifacts: the delta
  chain from a version it holds, or the nearest anchor, every hash verified; a corrupt or
  mismatching delta falls back to the anchor. Events that carry artifact hints
  (`details.artifacts`, the trainer's `version_registered`: app/contracts/hints.py) are handed to
  the fetcher while folding, so the usual sync is one GET of the delta, without asking MLflow;
- the decoded weights are loaded into a policy no request uses (the engine's standby: a version
  no longer served, loaded in place; else a new shadow policy), whose serving weights are checked
  bit for bit against the tensors the codec verified (weights.load_verified), and only then
  published with one atomic `WeightStore.swap`; the verified version is written to the local
  cache right after. In-flight requests finish on the weights they started with.

A sync that fails (fetch error, hash mismatch on every path) leaves the old weights serving,
publishes `replica_sync_failed` and is retried after `retry_interval`. A successful one
publishes `replica_synced`. Every `heartbeat_interval` the agent publishes `replica_heartbeat`
with the versions it serves to `<ns>.replica-status` (compacted, keyed by replica id:
app/contracts/replica_status.py), so heartbeats do not accumulate on the deployment log.

Start order: the agent waits for the broker and the topic (app/infra/wait.py: backoff, one log
line), and serves nothing until the log names a champion (one `waiting for` line, /readyz 503).
It never serves MLflow's `champion` alias on its own: what a replica serves is always what the
log (and so the status API) says. The controller records the version the alias names when the
log names none (the trainer's base version, or a move made in the MLflow UI), docs/REPLICA.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from app.contracts.deadletter import DeadLetters
from app.contracts.deployment_state import DeploymentState, fold
from app.contracts.deployments import REPLICA_TYPES, DeploymentEvent, DeploymentLog
from app.contracts.hints import ArtifactHint
from app.contracts.replica_status import STATUS_TYPES, ReplicaStatusLog
from app.infra.wait import Waiter
from app.replica import metrics as m
from app.replica.config import ReplicaConfig
from app.replica.weights import (
    LoadedVersion,
    Serving,
    VerificationError,
    WeightCache,
    WeightStore,
)
from app.settings import Settings

log = logging.getLogger(__name__)


class SyncAgent:
    """Follows the deployment log in a thread and keeps the weight store on the desired versions."""

    def __init__(
        self,
        settings: Settings,
        cfg: ReplicaConfig,
        store: WeightStore,
        cache: WeightCache,
        fetcher: Any = None,
        engine: Any = None,
    ):
        from app.replica.engines.base import BuiltinEngine
        from app.replica.fetch import VersionFetcher

        self.settings, self.cfg, self.store, self.cache = settings, cfg, store, cache
        self.engine = engine or BuiltinEngine(cfg)  # app/replica/engines/
        self.fetcher = fetcher or VersionFetcher(
            settings, decode_threads=cfg.decode_threads, pushed_max_bytes=cfg.pushed_max_bytes
        )
        self.state = DeploymentState(model=settings.model_name)
        self.events = DeploymentLog(settings)
        self.status = ReplicaStatusLog(settings)  # heartbeats: `<ns>.replica-status`
        self.dead = DeadLetters(settings, consumer=f"replica:{cfg.id}")
        self.last_result: dict[str, Any] | None = None
        self.in_progress: dict[str, Any] | None = None  # the version being applied, for /v1/status
        self.caught_up = threading.Event()  # set once the log was read to its end at start
        self._stop = threading.Event()
        self._retry_at: dict[
            tuple[str, str], float
        ] = {}  # (slot, version) -> monotonic time of the next attempt
        self._no_champion = Waiter(f"a champion named in {settings.topic('deployments')}")
        self._next_heartbeat = 0.0
        self._seen: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"sync-{cfg.id}", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self.events.close()
        self.status.close()
        self.dead.close()
        if hasattr(self.fetcher, "close"):
            self.fetcher.close()

    def desired(self) -> dict[str, Any]:
        s = self.state
        return {
            "champion": s.champion,
            "candidate": s.candidate,
            "traffic_pct": s.traffic_pct if s.candidate else 0.0,
        }

    # --- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        from kafka import TopicPartition

        from app.infra.kafka import make_consumer
        from app.infra.wait import Stopped, kafka_ready

        topic = self.settings.topic("deployments")
        while not self._stop.is_set():
            consumer = None
            try:
                kafka_ready(
                    self.settings, [topic], self._stop
                )  # backoff, one log line, until it is there
                consumer = make_consumer(self.settings, group_id=None)
                parts = consumer.partitions_for_topic(topic)
                assert parts, (
                    f"topic {topic} does not exist; create it with `flywheel kafka start` (ensure_topics)"
                )
                tps = [TopicPartition(topic, p) for p in sorted(parts)]
                pushed = self._pushed_partitions(consumer)
                consumer.assign(tps + pushed)
                consumer.seek_to_beginning(*tps)
                end = consumer.end_offsets(tps)
                if pushed:  # only the newest few pushed deltas can still matter
                    first, last = consumer.beginning_offsets(pushed), consumer.end_offsets(pushed)
                    for tp in pushed:
                        consumer.seek(tp, max(first[tp], last[tp] - self.fetcher.pushed.max_items))
                while not self._stop.is_set():
                    self._fold(consumer.poll(timeout_ms=int(self.cfg.poll_interval * 1000)))
                    if not self.caught_up.is_set():
                        if any(consumer.position(tp) < end[tp] for tp in tps):
                            continue  # rebuild the whole desired state before acting on it
                        self.caught_up.set()
                        log.info(
                            "replica %s caught up with %s: desired %s",
                            self.cfg.id,
                            topic,
                            self.desired(),
                        )
                    self.engine.check()  # a vLLM server that exited: restarted, reloaded
                    self.reconcile()
                    self._heartbeat()
            except Stopped:
                return
            except Exception:  # keep the replica serving; the next pass re-reads the log
                log.exception(
                    "sync agent of %s failed; restarting it in %.0fs",
                    self.cfg.id,
                    self.cfg.retry_interval,
                )
                self._stop.wait(self.cfg.retry_interval)
            finally:
                if consumer is not None:
                    consumer.close()

    def _pushed_partitions(self, consumer: Any) -> list:
        """The partitions of `<ns>.deltas` to follow ([] when off, or the topic does not exist)."""
        from kafka import TopicPartition

        if not self.cfg.pushed_deltas or not hasattr(self.fetcher, "pushed"):
            return []
        topic = self.settings.topic("deltas")
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            log.warning("topic %s does not exist: every delta is downloaded from MLflow", topic)
            return []
        return [TopicPartition(topic, p) for p in sorted(parts)]

    def _fold(self, batch: dict) -> None:
        """Fold a poll's records. A record that is not a valid event or pushed delta, or that the fold
        cannot take, is dead-lettered and skipped (the state stays as before it); nothing here raises
        for a bad record, so the agent never re-reads the log in a loop because of one."""
        from app.contracts.deadletter import error
        from app.contracts.deployments import InvalidRecord, decode_event
        from app.contracts.pushed import PushedDelta

        deltas = self.settings.topic("deltas")
        # pushed deltas first: the trainer pushes a delta before announcing its version
        for tp, records in sorted(batch.items(), key=lambda kv: kv[0].topic != deltas):
            if tp.topic == deltas:
                for rec in records:
                    problem = PushedDelta.problem(rec)
                    if problem is not None:
                        self.dead.send(rec, "invalid_pushed_delta", error("(record)", problem))
                    elif self.fetcher.pushed.offer(
                        PushedDelta.from_record(rec, self.settings.model_name)
                    ):
                        m.PUSHED.labels(self.cfg.id, "received").inc()
                continue
            for rec in records:
                try:
                    event = decode_event(rec.value)
                except InvalidRecord as exc:
                    self.dead.send(rec, exc.reason, exc.errors)
                    continue
                if event.type in REPLICA_TYPES or event.event_id in self._seen:
                    continue  # replica reports do not change the desired state
                try:
                    self._apply(event)
                except Exception as exc:
                    log.exception(
                        "replica %s: deployments[%d]@%d cannot be folded",
                        self.cfg.id,
                        rec.partition,
                        rec.offset,
                    )
                    self.dead.send(
                        rec, "apply_failed", error("(apply)", f"{type(exc).__name__}: {exc}")
                    )
                self._seen.add(event.event_id)

    def _apply(self, event: DeploymentEvent) -> None:
        """Fold one event (pure: the state changes only if the fold returns) and hand its artifact hint on."""
        state = fold(self.state, event)
        hint = ArtifactHint.from_details(event.details) if event.version else None
        if hint is not None and hasattr(self.fetcher, "learn"):
            self.fetcher.learn(event.version, hint)  # no MLflow look-up when it syncs
        self.state = state

    # --- reconcile ----------------------------------------------------------------------------------
    def reconcile(self) -> Serving:
        """Bring the store to the desired versions (one atomic swap); returns what is served after."""
        want = self.desired()
        serving = self.store.snapshot()
        if want["champion"] is None:
            self._no_champion.pending(
                "the log names none yet (the controller records the trainer's first "
                "version, or a promotion)"
            )
            return serving
        if self._no_champion.active:
            self._no_champion.there()
        now = time.monotonic()
        new: dict[str, LoadedVersion | None] = {}
        outcomes: list[
            tuple[str, str, str | None, dict[str, Any]]
        ] = []  # (slot, version, from, info)
        built = False  # an in-place engine builds one version per reconcile (engines/base.py)
        for slot in ("champion", "candidate"):
            target, have = want[slot], getattr(serving, slot)
            if have is not None and not self.engine.usable(have):
                have = None  # its engine was given to the other slot's version
            if target is None or (have is not None and have.version == target):
                new[slot] = have if target is not None else None
                continue
            held = next(
                (lv for lv in serving.held() if lv.version == target and self.engine.usable(lv)),
                None,
            )
            if held is not None:
                new[slot] = held
                outcomes.append(
                    (
                        slot,
                        target,
                        have.version if have else None,
                        {"path": "held", "bytes": 0, "seconds": 0.0},
                    )
                )
                continue
            if now < self._retry_at.get((slot, target), 0.0) or (built and self.engine.in_place):
                new[slot] = have if slot == "champion" else None
                continue
            built = True
            lv, info = self._build(slot, target, serving)
            if lv is None:
                self._retry_at[(slot, target)] = now + self.cfg.retry_interval
                new[slot] = (
                    have if slot == "champion" else None
                )  # never drop the champion; no stale candidate
                continue
            self._retry_at.pop((slot, target), None)
            new[slot] = lv
            outcomes.append((slot, target, have.version if have else None, info))
        traffic = (
            want["traffic_pct"]
            if new["candidate"] is not None and new["candidate"].version == want["candidate"]
            else 0.0
        )
        changed = (
            new["champion"] is not serving.champion
            or new["candidate"] is not serving.candidate
            or traffic != serving.traffic_pct
        )
        if not changed:
            return serving
        for slot, version, frm, info in outcomes:
            self.last_result = {
                "ok": True,
                "slot": slot,
                "version": version,
                "from_version": frm,
                **info,
            }
        after = self.store.swap(
            champion=new["champion"], candidate=new["candidate"], traffic_pct=traffic
        )
        m.observe_serving(self.cfg.id, after.versions(), after.traffic_pct)
        log.info(
            "replica %s now serves %s (candidate %.4g%%)",
            self.cfg.id,
            after.versions(),
            after.traffic_pct,
        )
        for slot, version, frm, info in outcomes:
            m.SYNC_SECONDS.labels(self.cfg.id, info["path"]).observe(info["seconds"])
            self._publish(
                "replica_synced",
                version,
                frm,
                after,
                {"slot": slot, **info},
                f"serving v{version} as {slot} ({info['path']})",
            )
        # persist after the swap (off the critical path): a crash before this restarts on the
        # previous verified version, which is what the cache still names
        for lv in after.held():
            self.cache.put(lv)
        self.cache.set_serving(after)
        self.cache.prune(self.cfg.cache_keep, protect={lv.version for lv in after.held()})
        return after

    def _build(
        self, slot: str, target: str, serving: Serving
    ) -> tuple[LoadedVersion | None, dict[str, Any]]:
        """Reconstruct + verify `target` into a policy no request uses; None on failure (published)."""
        t0 = time.perf_counter()
        frm = getattr(serving, slot).version if getattr(serving, slot) else None
        self.in_progress = {"slot": slot, "version": target, "stage": "fetch"}
        try:
            if target in self.cache.versions() and not self.engine.in_place:
                try:
                    lv = self.cache.load(target)
                    return lv, {"path": "cache", "bytes": 0, "seconds": time.perf_counter() - t0}
                except VerificationError as exc:
                    log.error("%s", exc)
            fetched = self.fetcher.fetch(target, {lv.version: lv for lv in serving.held()})
            for kind, n in fetched.bytes_by_kind.items():
                m.SYNC_BYTES.labels(self.cfg.id, kind).inc(n)
            if fetched.fallbacks:
                m.FALLBACKS.labels(self.cfg.id).inc(fetched.fallbacks)
            if fetched.bytes_by_kind.get("pushed"):
                m.PUSHED.labels(self.cfg.id, "used").inc()
            if getattr(fetched, "pushed_rejected", 0):
                m.PUSHED.labels(self.cfg.id, "rejected").inc(fetched.pushed_rejected)
            if (
                self.cfg.debug_pause_in_apply > 0
            ):  # testing only: a window to kill the replica mid-apply
                log.warning(
                    "debug pause of %.1fs while applying v%s", self.cfg.debug_pause_in_apply, target
                )
                self.in_progress = {"slot": slot, "version": target, "stage": "debug_pause"}
                self._stop.wait(self.cfg.debug_pause_in_apply)
            t_load = time.perf_counter()
            lv = self.engine.load(
                slot,
                target,
                fetched.state,
                fetched.config,
                fetched.sha256,
                store=self.store,
                digests=fetched.digests or None,
            )
            stages = {**getattr(fetched, "timings", {}), "load": time.perf_counter() - t_load}
            info = {
                "path": fetched.path,
                "chain": fetched.chain,
                "bytes": sum(fetched.bytes_by_kind.values()),
                "fallbacks": fetched.fallbacks,
                "config_reused": getattr(fetched, "config_reused", False),
                "seconds": round(time.perf_counter() - t0, 6),
                "stages_ms": {k: round(v * 1000, 2) for k, v in stages.items()},
            }
            return lv, info
        except Exception as exc:  # any failure: keep serving the old weights, report, retry later
            reason = type(exc).__name__
            m.SYNC_FAILURES.labels(self.cfg.id, reason).inc()
            log.error(
                "replica %s could not sync %s to v%s: %s: %s",
                self.cfg.id,
                slot,
                target,
                reason,
                exc,
            )
            self.last_result = {
                "ok": False,
                "slot": slot,
                "version": target,
                "from_version": frm,
                "error": f"{reason}: {exc}",
            }
            self._publish(
                "replica_sync_failed",
                target,
                frm,
                serving,
                {"slot": slot, "error": f"{reason}: {exc}"[:2000]},
                f"could not sync {slot} to v{target}; still serving {serving.versions()}",
            )
            return None, {}
        finally:
            self.in_progress = None

    # --- events -------------------------------------------------------------------------------------
    def _publish(
        self,
        type_: str,
        version: str | None,
        frm: str | None,
        serving: Serving,
        details: dict[str, Any],
        reason: str,
    ) -> None:
        from kafka.errors import KafkaError

        v = serving.versions()
        event = DeploymentEvent(
            type=type_,
            model=self.settings.model_name,
            version=version,
            from_version=frm,
            source="replica",
            actor=self.cfg.id,
            reason=reason,
            details={
                "replica_id": self.cfg.id,
                "url": self.cfg.url(),
                "champion_version": v["champion"],
                "candidate_version": v["candidate"],
                "traffic_pct": serving.traffic_pct,
                **details,
            },
        )
        try:
            (self.status if type_ in STATUS_TYPES else self.events).publish(event)
        except KafkaError as exc:  # reporting must not stop serving or syncing
            log.warning("could not publish %s: %s", type_, exc)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.cfg.heartbeat_interval
        serving = self.store.snapshot()
        self._publish(
            "replica_heartbeat",
            serving.champion.version if serving.champion else None,
            None,
            serving,
            {},
            "heartbeat",
        )
