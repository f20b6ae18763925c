"""The typed join state (streams/labels.py: Label, BucketMarker, MergedBucket) against its stored form.

The `labels`, `buckets` and `metric-buckets` tables keep JSON objects with short keys, and their
changelogs hold what earlier workers wrote: each stored form below is, byte for byte, what the
dict-based join wrote for such a label, and must read back into the named fields and be written
out again unchanged.
"""

from __future__ import annotations

import orjson
import pytest

from streams.labels import Aggregator, BucketMarker, Label, LabelClose, MergedBucket
from streams.reward import resolve_spec
from tests.unit.streams.factories import feedback as fb
from tests.unit.streams.factories import generation as gen

ACCEPT_A = (
    b'{"event_id":"a","type":"accept","request_id":"r1","session_id":"s-r1",'
    b'"ts":"2026-11-21T10:00:01Z"}'
)
SUMS = (
    b'{"n":1.0,"accepts":1.0,"rejects":0.0,"persistence_n":0.0,"persistence_sum":0.0,'
    b'"rating_n":0.0,"rating_sum":0.0,"followup_n":0.0,"followup_sum":0.0,"reward_sum":0.75,'
    b'"reward_sumsq":0.5625,"tool_error_rollouts":0.0,"tool_error_count":0.0,'
    b'"empty_completions":1.0,"completion_tokens_sum":1.0}'
)
STORED = {
    "pending": b'{"p":1,"st":"pending","dl":110.0,"seen":["a"],"fb":[{"id":"a","ev":'
    + ACCEPT_A
    + b'}],"gen":null}',
    "open": b'{"p":1,"st":"open","dl":112.0,"seen":["a","g"],"fb":[{"id":"a","ev":'
    + ACCEPT_A
    + b'}],"gen":"g"}',
    "closed": b'{"p":1,"st":"closed","dl":172.0,"seen":["a","g"],"gen":"g","b":60.0,"v":"v7",'
    b'"m":' + SUMS + b',"closed":112.0}',
    "idle": b'{"p":1,"st":"idle","dl":170.0,"seen":["a"],"gen":null}',
}


@pytest.mark.parametrize("status", list(STORED))
def test_every_stored_label_reads_into_named_fields_and_writes_back_byte_for_byte(status):
    label = Label.from_stored(orjson.loads(STORED[status]))
    assert (label.partition, label.status, label.seen[0]) == (1, status, "a")
    assert label.waiting == (status in ("pending", "open"))
    assert label.generation_id == ("g" if status in ("open", "closed") else None)
    assert [f.event for f in label.feedback] == ([orjson.loads(ACCEPT_A)] if label.waiting else [])
    assert (label.close is not None) == (status == "closed")
    assert orjson.dumps(label.to_stored()) == STORED[status]


def test_a_closed_label_names_what_the_version_metrics_need():
    label = Label.from_stored(orjson.loads(STORED["closed"]))
    assert label.deadline == 172.0 and label.close == LabelClose(
        bucket_start=60.0, model_version="v7", sums=orjson.loads(SUMS), closed_at=112.0
    )


def test_the_join_goes_on_from_labels_an_earlier_worker_stored():
    """A restart on tables the dict-based join wrote: the open label closes into the same
    rollout and stored closed label, the pending one is orphaned into the same idle label."""
    labels = {
        "r1": orjson.loads(STORED["open"]),
        "pend": orjson.loads(STORED["pending"].replace(b'"r1"', b'"pend"')),
    }
    generations = {"r1": gen("r1", "g", n_tokens=1)}
    agg = Aggregator(resolve_spec("v1"), 10.0, 60.0, 60.0, labels, generations, {}, clock=lambda: 0)
    assert agg.label("r1") is not None and agg.label("r1").status == "open"
    out = agg.advance(1, 125.0)
    assert [(e.topic, e.key, e.value["reward"]) for e in out if e.topic == "rollouts"] == [
        ("rollouts", "r1", 0.75)
    ]
    assert [(e.topic, e.value["reason"]) for e in out if e.topic == "late"] == [("late", "orphan")]
    assert orjson.dumps(labels["r1"]) == STORED["closed"] and "r1" not in generations
    assert orjson.dumps(labels["pend"]) == STORED["idle"]
    assert agg.on_event(1, fb("r1", "a", "accept"), 126.0) == [] and agg.duplicates == 1


def test_bucket_markers_and_merged_buckets_keep_their_stored_form():
    assert BucketMarker.from_stored({"p": 1, "dl": 180.0}) == BucketMarker(1, 180.0)
    assert orjson.dumps(BucketMarker(1, 180.0).to_stored()) == b'{"p":1,"dl":180.0}'
    # the buckets table also holds the worker's input progress: not a marker
    assert BucketMarker.from_stored({"offset": 7}) is None
    stored = {"parts": {"1": {"n": 1.0}}}
    merged = MergedBucket.from_stored(stored).with_partial(0, {"n": 2.0})
    assert merged.to_stored() == {"parts": {"1": {"n": 1.0}, "0": {"n": 2.0}}}
    assert stored == {"parts": {"1": {"n": 1.0}}}  # the stored value is not changed in place
    assert MergedBucket.from_stored(None).with_partial(3, {"n": 1.0}).sums_by_partition == {
        "3": {"n": 1.0}
    }
