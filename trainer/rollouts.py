"""Rollout intake: consume `flywheel.rollouts`, validate, dedupe by (request_id, reward_spec), skip stale, batch.

The record schema is docs/DESIGN.md §Rollout record, as app/contracts/rollouts.py `Rollout` defines it
(the producer's contract, validated first); trainer/rollout_record.py `Rollout` adds the structural invariants
training needs, and trainer/validate.py checks it against the model being trained (tokenizer,
vocabulary, context, routes, log-probs, reward, temperature). A record that fails any of them
is refused: counted (`flywheel_trainer_rollouts_refused_total{reason}`), logged (rate-limited),
dead-lettered to `<ns>.dlq` with its reason and original bytes (trainer/dlq.py), and skipped
as `invalid`; it never reaches a step.

Exactly-once bookkeeping (see docs/TRAINER.md):
- `positions[p]` is the next offset of partition p that the trainer has NOT yet processed
  (trained on or skipped). It moves only when an entry leaves the buffer through `take()`,
  so it always matches the weights that were trained on everything before it. The loop
  saves it with the weights and seeks to it on restart (the rebalance listener).
- `seen` holds the (request_id, reward_spec) keys already processed (`dedupe_key`); a record
  whose key is seen, or already waiting in the buffer, is a `duplicate`. The same generation
  labelled under two specs (the live worker's and a `flywheel streams relabel` run's) is two
  rollouts, each trained on once. It is saved with the state, so dedupe survives restarts.
  Keys of records still in the buffer are not in `seen` (they are re-read after a crash and
  must not look like duplicates then). State files that hold plain request_ids (written before
  the key had the spec) still load: such an id was a live rollout, so it matches live
  rollouts of that request_id and never a relabelled one.
- Staleness is decided at `take()` time against the last shipped version: a live rollout whose
  `model_version` is more than `max_staleness` versions older, and older than the serving
  champion, is skipped as `stale`. The champion's own rollouts (and a canary's, newer than
  it) are never stale: they are what serves, however many versions the trainer shipped since
  (a canary can hold the champion in place for longer than `max_staleness` ship intervals). A
  relabelled rollout (`relabel_run` set) is old by construction and is exempt: the objective's
  importance weights and sequence mask (trainer/objective.py) bound what it can move, as they
  do for every rollout. One whose version is not a number is still skipped as `stale`.
  A multi-turn record (`turns`) is judged turn by turn, each by its own `model_version` under
  the same rule: a stale turn's tokens get loss mask 0 (they stay as context, counted in
  `Batch.stale_turn_tokens`), the record trains on its fresh turns, and its staleness is that
  of its oldest fresh turn; with no fresh turn left it is skipped as `stale`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from trainer.dlq import DeadLetters, RateLimitedLog, Source
from trainer.metrics import REFUSED
from trainer.rollout_record import Rollout, version_number
from trainer.validate import ModelSpec, Refusal, check_rollout

log = logging.getLogger(__name__)

# `invalid`: refused at intake (trainer/validate.py); `failed`: the optimizer step raised on it
SKIP_REASONS = ("duplicate", "stale", "invalid", "failed")


def parse_rollout(
    value: bytes | None, spec: ModelSpec | None = None
) -> tuple[Rollout | None, Refusal | None]:
    """(rollout, None) or (None, the refusal: a reason and a message a user can act on).

    First the producer's schema (app/contracts/rollouts.py `Rollout`, the contract of the topic), then
    the structural invariants the trainer relies on (lengths, route bytes), then, given the
    model's `spec`, trainer/validate.py's checks. Never raises on any bytes.
    """
    from app.contracts.rollouts import Rollout as StreamsRollout

    if not value:
        return None, Refusal("invalid_json", "empty value (a tombstone or no bytes)")
    try:
        contract = StreamsRollout.model_validate_json(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"].startswith("json_") or not first["loc"]:
            return None, Refusal("invalid_json", f"not a JSON object: {first['msg']}")
        return None, _schema_refusal(first)
    except Exception as exc:
        return None, Refusal("invalid_json", f"undecodable: {exc!r}"[:500])
    try:
        r = Rollout.model_validate(contract.model_dump())
    except ValidationError as exc:
        return None, _schema_refusal(exc.errors()[0])
    return r, (check_rollout(r, spec) if spec is not None else None)


def _schema_refusal(err: dict[str, Any]) -> Refusal:
    loc = ".".join(str(p) for p in err["loc"]) or "(record)"
    return Refusal("invalid_rollout", f"{loc}: {err['msg']}", loc)


DedupeKey = tuple[str, str]  # (request_id, reward_spec)


def dedupe_key(r: Rollout) -> DedupeKey:
    """What makes a rollout new data: its generation and the spec it was labelled with."""
    return (r.request_id, r.reward_spec)


class DedupeSet:
    """Insertion-ordered set of (request_id, reward_spec) keys with a capacity (oldest evicted first).

    `items` as saved by `to_list`: [request_id, reward_spec] pairs; a plain request_id (a state
    file from before the key had the spec) stays a legacy entry that matches live rollouts only."""

    def __init__(self, capacity: int, items: list[Any] | None = None):
        self.capacity = capacity
        # keys added since the last `drain_added()`; None: not recorded (one-process trainer)
        self.added: list[DedupeKey] | None = None
        self._d: OrderedDict[DedupeKey | str, None] = OrderedDict()
        for item in (items or [])[-capacity:]:
            self._d[item if isinstance(item, str) else (str(item[0]), str(item[1]))] = None

    def __contains__(self, key: DedupeKey | str) -> bool:
        return key in self._d

    def seen(self, r: Rollout) -> bool:
        return dedupe_key(r) in self._d or (r.relabel_run is None and r.request_id in self._d)

    def __len__(self) -> int:
        return len(self._d)

    def add(self, key: DedupeKey) -> None:
        self._d[key] = None
        if self.added is not None:
            self.added.append(key)
        if len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def to_list(self) -> list[Any]:
        return [k if isinstance(k, str) else list(k) for k in self._d]

    def drain_added(self) -> list[list[str]]:
        """The keys added since the last call, as [request_id, reward_spec] pairs (a distributed
        trainer's ranks send only these to rank 0 when the state is saved)."""
        out, self.added = [list(k) for k in self.added or []], []
        return out

    def merge(self, items: list[Any]) -> None:
        """Add keys saved by `to_list`/`drain_added` (another rank's), in order."""
        for item in items:
            self._d[item if isinstance(item, str) else (str(item[0]), str(item[1]))] = None
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)


@dataclass
class Entry:
    partition: int
    offset: int
    arrived: float
    rollout: Rollout | None
    reason: str = ""  # skip reason at intake ("duplicate", "invalid")
    source: Source | None = None  # the original record, kept for a dead letter should the step fail


@dataclass
class Batch:
    """What one `take()` processed: fresh rollouts to train on, and the skipped ones counted."""

    rollouts: list[Rollout] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    # partition -> offsets of the skipped ones (every reason; the loop adds `failed`'s)
    skipped_offsets: dict[int, list[int]] = field(default_factory=dict)
    first_offsets: dict[int, int] = field(
        default_factory=dict
    )  # partition -> first offset processed
    staleness: list[int] = field(default_factory=list)  # versions behind, per fresh rollout
    sources: dict[DedupeKey, Source] = field(default_factory=dict)  # dedupe_key -> original record
    stale_turn_tokens: int = 0  # sampled tokens of stale turns of multi-turn records, untrained
    constrained_turn_tokens: int = 0  # sampled tokens of constrained turns, untrained

    def skip(self, reason: str, partition: int, offset: int) -> None:
        """Count the record at (partition, offset) as read and not trained on, for `reason`."""
        self.skipped[reason] += 1
        self.skipped_offsets.setdefault(partition, []).append(offset)

    def only(self, keep: list[int]) -> Batch:
        """The same batch restricted to the rollouts at indices `keep` (skips and offsets unchanged)."""
        return Batch(
            rollouts=[self.rollouts[i] for i in keep],
            skipped=self.skipped,
            skipped_offsets=self.skipped_offsets,
            first_offsets=self.first_offsets,
            staleness=[self.staleness[i] for i in keep],
            sources=self.sources,
            stale_turn_tokens=self.stale_turn_tokens,
            constrained_turn_tokens=self.constrained_turn_tokens,
        )


class RolloutIntake:
    """Buffered, deduped, exactly-once-friendly reader of the rollouts topic."""

    def __init__(
        self,
        consumer: Any,
        topic: str,
        *,
        positions: dict[int, int],
        seen: DedupeSet,
        max_staleness: int,
        spec: ModelSpec | None = None,
        dead_letters: DeadLetters | None = None,
        log_interval_s: float = 10.0,
        assign: list[int] | None = None,
    ):
        """`assign`: read exactly these partitions (a rank of a distributed trainer,
        trainer/distributed.py) instead of subscribing as a member of the consumer group."""
        from kafka import ConsumerRebalanceListener

        self.consumer, self.topic = consumer, topic
        self.positions = dict(positions)
        self.seen = seen
        self.max_staleness = max_staleness
        self.spec, self.dead_letters = spec, dead_letters
        self.refusal_log = RateLimitedLog(log_interval_s)
        self.buffer: deque[Entry] = deque()
        self._buffered_ids: dict[DedupeKey, int] = {}
        intake = self
        # when this member started waiting for the group (subscribe, or a rebalance revoking its
        # partitions); the join after a crash waits for the dead predecessor's session
        # (app/infra/kafka.py, GROUP_SESSION_TIMEOUT_MS): logged with the assignment
        waiting_since = [time.monotonic()]

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked):
                waiting_since[0] = time.monotonic()
                intake._drop_partitions({tp.partition for tp in revoked})

            def on_partitions_assigned(self, assigned):
                for tp in assigned:
                    if tp.partition in intake.positions:
                        intake.consumer.seek(tp, intake.positions[tp.partition])
                log.info(
                    "assigned %s after %.1f s waiting for the group (resuming at %s)",
                    sorted(tp.partition for tp in assigned),
                    time.monotonic() - waiting_since[0],
                    {
                        tp.partition: intake.positions.get(tp.partition, "committed")
                        for tp in assigned
                    },
                )

        if assign is None:
            consumer.subscribe([topic], listener=_Listener())
            return
        from kafka.structs import TopicPartition

        tps = [TopicPartition(topic, p) for p in assign]
        consumer.assign(tps)
        for tp in tps:
            if tp.partition in self.positions:
                consumer.seek(tp, self.positions[tp.partition])
        log.info(
            "reading partitions %s (resuming at %s)",
            list(assign),
            {p: self.positions.get(p, "committed") for p in assign},
        )

    # --- reading ---------------------------------------------------------------------------------
    def poll(self, timeout_ms: int, max_records: int = 1000) -> int:
        """Fetch records into the buffer; returns how many records arrived."""
        got = self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        n, now = 0, time.monotonic()
        for tp, records in got.items():
            for rec in records:
                n += 1
                src = Source(self.topic, tp.partition, rec.offset, rec.key, rec.value)
                rollout, refusal = parse_rollout(rec.value, self.spec)
                if refusal is not None:
                    self.refuse(src, refusal)
                    self.buffer.append(Entry(tp.partition, rec.offset, now, None, "invalid"))
                elif self.seen.seen(rollout) or dedupe_key(rollout) in self._buffered_ids:
                    self.buffer.append(Entry(tp.partition, rec.offset, now, None, "duplicate"))
                else:
                    key = dedupe_key(rollout)
                    self._buffered_ids[key] = self._buffered_ids.get(key, 0) + 1
                    self.buffer.append(Entry(tp.partition, rec.offset, now, rollout, source=src))
        return n

    def refuse(self, src: Source, refusal: Refusal, exception: str | None = None) -> None:
        """Count, log (rate-limited) and dead-letter one refused record."""
        REFUSED.labels(refusal.reason).inc()
        self.refusal_log.warning(
            refusal.reason,
            "refused rollout at %s:%d:%d: %s",
            src.topic,
            src.partition,
            src.offset,
            refusal,
        )
        if self.dead_letters is not None:
            error: dict[str, Any] = {"field": refusal.field, "message": refusal.message}
            if exception is not None:
                error["exception"] = exception
            self.dead_letters.send(src, refusal.reason, [error])

    def ready(self, batch_size: int, max_wait_s: float) -> bool:
        """True when a step should run: a full batch, a batch that waited long enough, or skips to drain."""
        if not self.buffer:
            return False
        n_valid = sum(1 for e in self.buffer if e.rollout is not None)
        return (
            n_valid >= batch_size
            or self.buffer[0].rollout is None
            or (n_valid > 0 and time.monotonic() - self.buffer[0].arrived >= max_wait_s)
        )

    def readiness(self, max_wait_s: float) -> tuple[int, bool, bool]:
        """(fresh rollouts buffered, skip entries at the head to drain, the head waited
        `max_wait_s`): what `ready` decides on, for a distributed trainer to decide globally."""
        if not self.buffer:
            return 0, False, False
        n_valid = sum(1 for e in self.buffer if e.rollout is not None)
        head = self.buffer[0]
        return n_valid, head.rollout is None, time.monotonic() - head.arrived >= max_wait_s

    def take(self, n: int, current_version: int | None, champion: int | None = None) -> Batch:
        """Pop entries in arrival order until `n` fresh rollouts (then any skip entries right behind).
        `current_version`: the last shipped version; `champion`: the serving champion, None if unknown."""
        batch = Batch()
        while self.buffer and (len(batch.rollouts) < n or self.buffer[0].rollout is None):
            e = self.buffer.popleft()
            batch.first_offsets.setdefault(e.partition, e.offset)
            self.positions[e.partition] = e.offset + 1
            if e.rollout is None:
                batch.skip(e.reason, e.partition, e.offset)
                continue
            key = dedupe_key(e.rollout)
            self._buffered_ids[key] -= 1
            if not self._buffered_ids[key]:
                del self._buffered_ids[key]
            self.seen.add(key)
            judged = self._fresh_part(e.rollout, current_version, champion)
            if judged is None:
                batch.skip("stale", e.partition, e.offset)
                continue
            rollout, behind, stale_tokens, constrained_tokens = judged
            batch.rollouts.append(rollout)
            batch.staleness.append(behind)
            batch.stale_turn_tokens += stale_tokens
            batch.constrained_turn_tokens += constrained_tokens
            if e.source is not None:
                batch.sources[key] = e.source
        return batch

    def _fresh_part(
        self, r: Rollout, current: int | None, champion: int | None
    ) -> tuple[Rollout, int, int, int] | None:
        """(what of `r` trains, its staleness, the sampled tokens of stale turns and of
        constrained turns left untrained), or None when nothing of it is fresh (module
        docstring). Constrained turns (trainer/validate.py) stay as context, untrained."""
        if r.turns is None:
            behind = self._staleness(r, current, champion)
            return None if behind is None else (r, behind, 0, 0)
        lags = [self._staleness(r, current, champion, t.model_version) for t in r.turns]
        free = [k for k, t in enumerate(r.turns) if not t.constrained]
        fresh = [lags[k] for k in free if lags[k] is not None]
        if not fresh:
            return None
        stale = [k for k in free if lags[k] is None]
        held = [k for k, t in enumerate(r.turns) if t.constrained]
        if not stale and not held:
            return r, max(fresh), 0, 0
        n = sum(r.train_mask())  # type: ignore[arg-type]
        without_stale = r.without_turns(stale)
        trimmed = without_stale.without_turns(held)
        n_fresh = sum(without_stale.train_mask())  # type: ignore[arg-type]
        return trimmed, max(fresh), n - n_fresh, n_fresh - sum(trimmed.train_mask())  # type: ignore[arg-type]

    def _staleness(
        self, r: Rollout, current: int | None, champion: int | None, version: str | None = None
    ) -> int | None:
        """Versions `r` (or its turn sampled by `version`) lags the last shipped version; None
        when it is stale (module docstring)."""
        version = r.model_version if version is None else version
        v = version_number(version)
        if v is None:
            log.warning(
                "rollout %s has non-numeric model_version %r; counted as stale",
                r.request_id,
                version,
            )
            return None
        behind = max(0, (current or v) - v)
        exempt = r.relabel_run is not None or (champion is not None and v >= champion)
        return behind if behind <= self.max_staleness or exempt else None

    # --- housekeeping ----------------------------------------------------------------------------
    def _drop_partitions(self, parts: set[int]) -> None:
        kept = deque()
        for e in self.buffer:
            if e.partition in parts:
                if e.rollout is not None:
                    key = dedupe_key(e.rollout)
                    self._buffered_ids[key] -= 1
                    if not self._buffered_ids[key]:
                        del self._buffered_ids[key]
            else:
                kept.append(e)
        self.buffer = kept

    def hold(self, on: bool) -> None:
        """Stop (`on`) or restart fetching: paused partitions keep their records in Kafka while
        `poll` goes on (an intake that subscribed stays in its group). Paused again on every call
        while held, since a rebalance of a subscribed intake assigns partitions unpaused."""
        parts = self.consumer.assignment()
        if on and parts:
            self.consumer.pause(*parts)
        elif not on and self.consumer.paused():
            self.consumer.resume(*self.consumer.paused())

    def buffered(self) -> int:
        return len(self.buffer)
