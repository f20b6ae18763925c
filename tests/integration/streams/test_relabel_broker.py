"""`flywheel streams relabel` on the real broker, beside a running live worker.

A live worker (spec v1) labels two phases of interactions; the relabel command then replays
the second phase (`--since` between them) under a spec v2 with other weights. Checked: every
generation with feedback gets exactly one v2 rollout whose reward is `compute_reward(v2, its
feedback)` (the live v1 rollout is `compute_reward(v1, the same feedback)`), keyed
'<request_id>|v2' beside the live '<request_id>'; nothing before --since; the printed counts;
the live worker's group offsets, its changelogs and the late topic untouched and no consumer
group created; a dry run writes nothing; and the trainer's intake (trainer/rollouts.py) trains
on the v1 and the v2 record of a request once each, refuses a repeated v2, and exempts
relabelled rollouts from max_staleness.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, datetime

import pytest

from app.contracts.rollouts import Rollout
from streams.reward import RewardWeights, compute_reward, resolve_spec
from tests.conftest import REPO
from tests.integration.streams.conftest import produce, read_topic, streams_env
from tests.unit.streams.factories import generation, random_feedback

pytestmark = pytest.mark.integration

V2_WEIGHTS = {
    "accept": 1.0,
    "reject": -1.0,
    "tool_error": -2.0,
    "tool_error_floor": -4.0,
    "followup": 0.0,
}
V1, V2 = resolve_spec("v1"), resolve_spec("v2", RewardWeights(**V2_WEIGHTS))


def phase(
    rng: random.Random, tag: str, n: int
) -> tuple[list[tuple[bytes | None, bytes]], dict[str, list[dict] | None], int]:
    """Records of n requests, per request with a generation its distinct feedback (None: no generation),
    and the number of distinct feedback events without a generation.

    Every 10th request has no feedback, every 10th+1 no generation (its feedback is orphaned);
    15% of the events are sent twice."""
    records, joined, orphans = [], {}, 0
    for i in range(n):
        rid = f"{tag}-{i}"
        evs = [] if i % 10 == 1 else [generation(rid, version="1", n_tokens=rng.randint(1, 6))]
        feedback = (
            []
            if i % 10 == 0
            else [random_feedback(rng, rid, f"{rid}-f{j}") for j in range(rng.randint(1, 4))]
        )
        joined[rid] = feedback if evs else None
        orphans += 0 if evs else len(feedback)
        evs += feedback
        evs += [dict(e) for e in evs if rng.random() < 0.15]
        rng.shuffle(evs)
        records += [(rid.encode(), json.dumps(e).encode()) for e in evs]
    return records, joined, orphans


def group_state(settings) -> dict:
    """The live worker's committed interactions offsets, the consumer groups, and the end offsets of what the
    worker writes only when it consumes interactions (its ticks, progress marks and metric buckets move with
    the clock, so they are not compared)."""
    from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

    ns = settings.topic_namespace
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap.split(","))
    cons = KafkaConsumer(bootstrap_servers=settings.kafka_bootstrap.split(","))
    try:
        group = f"{ns}-streams"
        offsets = {
            (tp.topic, tp.partition): m.offset
            for tp, m in admin.list_group_offsets({group: None})[group].items()
            if tp.topic == settings.topic("interactions")
        }
        listed = admin.list_groups()
        groups = sorted(
            name
            for name in (g["group_id"] if isinstance(g, dict) else g[0] for g in listed)
            if name.startswith(ns)
        )
        topics = [settings.topic("late")] + [
            f"{ns}-streams-{t}-changelog" for t in ("labels", "generations")
        ]
        tps = [
            TopicPartition(t, p) for t in topics for p in sorted(cons.partitions_for_topic(t) or [])
        ]
        ends = {(tp.topic, tp.partition): o for tp, o in cons.end_offsets(tps).items()}
    finally:
        admin.close()
        cons.close()
    return {"offsets": offsets, "groups": groups, "ends": ends}


def run_relabel(settings, *extra: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "streams",
        "relabel",
        "--reward-spec",
        "v2",
        "--reward-weights",
        json.dumps(V2_WEIGHTS),
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=streams_env(settings), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def intake_all(settings, expect: int, current_version: int):
    """A trainer intake (own group) that polls the whole rollouts topic, then takes everything once."""
    from app.infra.kafka import make_consumer
    from trainer.rollouts import DedupeSet, RolloutIntake

    consumer = make_consumer(settings, group_id=f"test-intake-{uuid.uuid4().hex[:8]}")
    intake = RolloutIntake(
        consumer, settings.topic("rollouts"), positions={}, seen=DedupeSet(10_000), max_staleness=4
    )
    deadline = time.monotonic() + 90
    while intake.buffered() < expect:
        assert time.monotonic() < deadline, (
            f"intake buffered {intake.buffered()} of {expect} records"
        )
        intake.poll(500)
    return intake, consumer, intake.take(10**6, current_version)


def test_relabel_gives_the_new_rewards_exactly_once_beside_the_live_worker(
    make_settings, start_worker
):
    settings = make_settings(wait_window=2.5)
    rng = random.Random(15)
    old_records, old_joined, _ = phase(rng, "old", 30)
    new_records, new_joined, n_orphans = phase(rng, "new", 200)
    new_records += [
        (b"k", b"{not json"),
        (b"k2", json.dumps({"type": "accept", "event_id": "x"}).encode()),
        (b"wrong-key", json.dumps(random_feedback(rng, "new-7", "kx")).encode()),
    ]
    worker = start_worker(settings)
    produce(settings, old_records)
    time.sleep(1.5)
    since = datetime.now(UTC)
    time.sleep(1.5)
    produce(settings, new_records)
    generations = sum(1 for j in (old_joined | new_joined).values() if j is not None)
    live = read_topic(settings, settings.topic("rollouts"), generations, timeout=120.0, settle=3.0)
    assert len(live) == generations, (len(live), generations, worker.tail())
    before = group_state(settings)
    assert sum(before["offsets"].values()) > 0, (
        f"the live worker has committed no interactions offsets: {before}"
    )

    dry = run_relabel(settings, "--since", since.isoformat(), "--dry-run")
    assert (
        dry["written"] == 0
        and len(read_topic(settings, settings.topic("rollouts"), 10**9, 5.0)) == generations
    )

    counts = run_relabel(settings, "--since", since.isoformat().replace("+00:00", "Z"))
    print("relabel counts:", json.dumps(counts, sort_keys=True))
    want = {rid: fb for rid, fb in new_joined.items() if fb}
    assert counts["read"] == len(new_records) and counts["labelled"] == counts["written"] == len(
        want
    ), counts
    assert counts["skipped"]["no_feedback"] == sum(1 for j in new_joined.values() if j == [])
    assert counts["skipped"]["orphan_feedback"] == n_orphans > 0
    assert counts["skipped"]["before_since"] == counts["skipped"]["window_open"] == 0, counts
    assert counts["dead_lettered"] == {"invalid_json": 1, "invalid_event": 1, "key_mismatch": 1}
    assert counts["duplicates"] > 0 and counts["reward_spec"] == "v2"
    assert {k: v for k, v in dry.items() if k not in ("written", "dry_run", "relabel_run")} == {
        k: v for k, v in counts.items() if k not in ("written", "dry_run", "relabel_run")
    }

    recs = read_topic(
        settings, settings.topic("rollouts"), generations + len(want), timeout=60.0, settle=3.0
    )
    keys = Counter(r.key.decode() for r in recs)
    assert all(n == 1 for n in keys.values()), [k for k, n in keys.items() if n > 1][:5]
    v2 = {r.key.decode(): json.loads(r.value) for r in recs if r.key.decode().endswith("|v2")}
    v1 = {r.key.decode(): json.loads(r.value) for r in recs if not r.key.decode().endswith("|v2")}
    assert sorted(v2) == sorted(f"{rid}|v2" for rid in want), (
        "relabelled set differs (--since not respected?)"
    )
    for rid, feedback in want.items():
        new, old = Rollout.model_validate(v2[f"{rid}|v2"]), Rollout.model_validate(v1[rid])
        assert new.reward == compute_reward(V2, feedback).reward, (rid, new.reward)
        assert old.reward == compute_reward(V1, feedback).reward, (rid, old.reward)
        assert (new.reward_spec, old.reward_spec, new.relabel_run, old.relabel_run) == (
            "v2",
            "v1",
            counts["relabel_run"],
            None,
        )
        assert (new.completion_tokens, new.logprobs, new.model_version) == (
            old.completion_tokens,
            old.logprobs,
            "1",
        )
    assert (
        sum(
            1
            for rid in want
            if compute_reward(V2, want[rid]).reward != compute_reward(V1, want[rid]).reward
        )
        > len(want) // 2
    )
    dlq = [json.loads(r.value) for r in read_topic(settings, settings.topic("dlq"), 10**9, 5.0)]
    assert Counter(d["reason"] for d in dlq if d["consumer"] == "relabel") == Counter(
        counts["dead_lettered"]
    )

    after = group_state(settings)
    assert after == before, (
        "relabel touched the live worker's offsets, state or outputs, or joined a group"
    )
    assert worker.proc.poll() is None, worker.tail()

    intake, consumer, batch = intake_all(settings, len(recs), current_version=1)
    trained = Counter((r.request_id, r.reward_spec) for r in batch.rollouts)
    assert all(n == 1 for n in trained.values()) and batch.skipped["duplicate"] == 0
    assert {rid for rid, spec in trained if spec == "v2"} == set(want)
    assert all((rid, "v1") in trained for rid in want)
    again = next(r for r in recs if r.key.decode().endswith("|v2"))
    produce_rollout = [(again.key, again.value)]
    from app.infra.kafka import make_producer

    prod = make_producer(settings, key_serializer=None)
    for key, value in produce_rollout:
        prod.send(settings.topic("rollouts"), key=key, value=value)
    prod.flush(30)
    prod.close()
    deadline = time.monotonic() + 60
    while intake.buffered() < 1:
        assert time.monotonic() < deadline, "the repeated v2 record never arrived"
        intake.poll(500)
    repeat = intake.take(10, 1)
    assert repeat.rollouts == [] and repeat.skipped["duplicate"] == 1
    consumer.close()

    _, stale_consumer, late_batch = intake_all(
        settings, len(recs) + 1, current_version=10
    )  # 9 versions behind
    kept = Counter(r.reward_spec for r in late_batch.rollouts)
    assert kept == {"v2": len(want)} and late_batch.skipped["stale"] == generations, (
        kept,
        late_batch.skipped,
    )
    stale_consumer.close()


def test_a_session_spread_over_partitions_is_relabelled_whole_in_record_time_order(make_settings):
    """A session's events are keyed by request, so they sit on several partitions. Here the
    session's outcome is on partition 0 and its two turns (the first weakens the test file) on the
    last, earlier in record time, and no later record closes the turns' windows: the relabel must
    apply them before the outcome ends the session, as the live worker does. The old relabel (a
    partition at a time, then one jump to the watermark) sent both turns to late
    (`turn_session_ended`) and labelled nothing; on a `flywheel run --agents` log it relabelled 17
    of 34 sessions that wrote the test file without that turn, paid the harness's success. The
    merge's own order is unit-tested in tests/unit/streams/test_relabel.py."""
    from datetime import timedelta

    from app.infra.kafka import make_producer
    from streams.config import StreamsConfig
    from streams.relabel import RelabelOptions, relabel
    from tests.unit.streams.factories import feedback, hacked_turns

    settings = make_settings(wait_window=30.0)
    turns = hacked_turns()
    rating = feedback("h0", "r", "rating", t=2, session_id="hack", value=1)
    outcome = {**feedback("h1", "o", "accept", t=3, session_id="hack"), "type": "session_outcome"}
    last = settings.interactions_partitions - 1
    placed = [
        (last, turns[0]),
        (last, turns[1]),
        (last, rating),
        (0, {**outcome, "outcome": "success"}),
    ]
    t0 = datetime.now(UTC) - timedelta(minutes=10)  # every window long closed
    prod = make_producer(settings, key_serializer=None)
    for i, (partition, ev) in enumerate(placed):
        prod.send(
            settings.topic("interactions"),
            key=ev["request_id"].encode(),
            value=json.dumps(ev).encode(),
            partition=partition,
            timestamp_ms=int(t0.timestamp() * 1000) + 1000 * i,
        )
    prod.flush(timeout=30)
    prod.close()

    counts = relabel(
        settings,
        StreamsConfig(),
        RelabelOptions(resolve_spec("sessions-v2"), since=t0 - timedelta(seconds=1)),
    )
    assert counts.labelled == 1 and counts.skipped.get("turn_session_ended", 0) == 0, (
        counts.as_dict()
    )
    [rec] = read_topic(settings, settings.topic("rollouts"), 1, timeout=60.0)
    got = json.loads(rec.value)
    assert [t["request_id"] for t in got["turns"]] == ["h0", "h1"], got
    assert got["protected_writes"] == 1 and got["outcome_reward"] == -1.0
    assert got["reward"] == pytest.approx(0.5 - 1.0) and got["reward_spec"] == "sessions-v2"
