"""The Faust agent with `test_context()`: records in, rollouts/late/DLQ out, no broker.

The output topics are swapped for in-memory sinks (a list per topic) so the test reads what
the agent sends; the agent code, the Faust stream, the aggregator and the tables are the
real ones. The broker-backed path is covered by tests/integration/streams.
"""

from __future__ import annotations

import asyncio
import base64
import json

from app.settings import Settings
from streams.app import build_app
from streams.config import StreamsConfig
from tests.unit.streams.factories import feedback, generation


class ListSink:
    """Stands in for an output topic: keeps (key, value) of every send."""

    def __init__(self):
        self.sent: list[tuple[bytes | None, bytes]] = []

    async def send(self, key=None, value=None, **kwargs):
        self.sent.append((key, value))


def _setup():
    app, rt = build_app(Settings(kafka_bootstrap="127.0.0.1:1", wait_window=5.0, topic_namespace="unit"),
                        StreamsConfig(metrics_port=0))
    outs = {name: ListSink() for name in rt.topics}
    rt.topics.update(outs)
    return app, rt, outs


def test_agent_joins_labels_and_dead_letters_via_test_context():
    async def scenario():
        app, rt, outs = _setup()
        agent = app.flywheel_agents["aggregate"]
        async with agent.test_context() as ctx:
            put = ctx.put
            await put(key=b"r1", value=json.dumps(feedback("r1", "a", "accept")).encode(), timestamp=100.0)
            await put(key=b"r1", value=json.dumps(generation("r1")).encode(), timestamp=101.0)
            await put(key=b"r1", value=json.dumps(feedback("r1", "a", "accept")).encode(), timestamp=102.0)  # duplicate
            await put(key=b"r2", value=json.dumps(generation("r2")).encode(), timestamp=103.0)
            await put(key=b"x", value=b"{broken", timestamp=104.0)
            await put(key=b"zz", value=json.dumps(feedback("r9", "b", "reject")).encode(), timestamp=104.5)
            await put(key=b"r1", value=json.dumps(feedback("r1", "c", "reject")).encode(), timestamp=106.5)  # closes r1
            await put(key=b"r3", value=json.dumps(feedback("r3", "d", "rating")).encode(), timestamp=109.0)  # closes r2
            await put(key=b"r3", value=json.dumps(feedback("r3", "e", "rating")).encode(), timestamp=115.0)  # orphans d
        rollouts = [json.loads(v) for _, v in outs["rollouts"].sent]
        late = [json.loads(v) for _, v in outs["late"].sent]
        dlq = [json.loads(v) for _, v in outs["dlq"].sent]
        assert [(r["request_id"], r["reward"], r["components"] is None) for r in rollouts] == [("r1", 0.75, False), ("r2", 0.0, True)]
        assert sorted((x["reason"], x["event"]["event_id"]) for x in late) == [("after_close", "c"), ("orphan", "d")]
        assert [d["reason"] for d in dlq] == ["invalid_json", "key_mismatch"]
        assert base64.b64decode(dlq[0]["value_b64"]) == b"{broken"
        assert rt.aggregator.duplicates == 1
        assert [k for k, _ in outs["rollouts"].sent] == [b"r1", b"r2"] and all(k is None for k, _ in outs["dlq"].sent)

    asyncio.run(scenario())
