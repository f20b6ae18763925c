"""app/infra/kafka_net.py: kafka-python's blocking calls wait a bounded time on its network thread.

A real `NetworkSelector` with its real I/O thread; the fault is injected by swallowing the
wake-up that `call_soon_threadsafe` sends, so the I/O thread sleeps in `select` with the call
queued (the state a hung trainer's `poll` was found in). The stock `run` then waits forever (it
is given a few seconds in a thread here, and is still waiting); the bounded one wakes the thread
again and returns. The guard test fails when kafka-python changes the method the copy replaces."""

from __future__ import annotations

import hashlib
import inspect
import threading

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.net.selector import NetworkSelector

from app.infra import kafka_net

STOCK_RUN = (
    NetworkSelector.run
    if NetworkSelector.run is not kafka_net.bounded_run
    else NetworkSelector._flywheel_stock_run  # installed before this module was imported
)


def test_the_replaced_method_is_still_kafka_pythons_3_0_12_run():
    digest = hashlib.sha256(inspect.getsource(STOCK_RUN).encode()).hexdigest()
    assert digest == kafka_net.UPSTREAM_RUN_SHA256, (
        "kafka-python's NetworkSelector.run changed: compare it with app/infra/kafka_net.py "
        "bounded_run, port the change (or drop the copy if the release bounds the wait itself), "
        "then update UPSTREAM_RUN_SHA256"
    )


def _selector_losing_one_wakeup() -> NetworkSelector:
    net = NetworkSelector()
    net.start()
    real_wakeup = net.wakeup
    lost = threading.Event()

    def wakeup() -> None:
        if not lost.is_set():  # the first wake-up after the call is queued never arrives
            lost.set()
            return
        real_wakeup()

    net.wakeup = wakeup  # type: ignore[method-assign]
    return net


async def _answer() -> int:
    return 42


def _call(run, net) -> dict:
    out: dict = {}

    def go() -> None:
        try:
            out["value"] = run(net, _answer)
        except BaseException as exc:  # reported to the test
            out["error"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(5.0)
    out["returned"] = not t.is_alive()
    return out


def test_a_lost_wakeup_hangs_the_stock_run_and_not_the_bounded_one():
    net = _selector_losing_one_wakeup()
    try:
        stuck = _call(STOCK_RUN, net)
        assert not stuck["returned"], "the stock run returned: the fault was not reproduced"
    finally:
        net.wakeup = net.__class__.wakeup.__get__(net)  # let the stuck call finish
        net.wakeup()
    net = _selector_losing_one_wakeup()
    try:
        done = _call(kafka_net.bounded_run, net)
        assert done == {"value": 42, "returned": True}, done
    finally:
        net.stop()


def test_a_call_that_never_completes_raises_after_the_deadline(monkeypatch):
    monkeypatch.setattr(kafka_net, "DEADLINE_S", 1.5)
    net = NetworkSelector()
    net.start()
    never = threading.Event()

    async def forever() -> None:
        while not never.is_set():
            await net.sleep(0.05)

    try:
        with pytest.raises(KafkaTimeoutError, match="did not complete"):
            kafka_net.bounded_run(net, forever)
    finally:
        never.set()
        net.stop()


def test_install_replaces_run_once():
    kafka_net.install()
    kafka_net.install()
    assert NetworkSelector.run is kafka_net.bounded_run
