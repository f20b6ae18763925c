"""app/infra/wait.py: the start-up wait every role uses (no broker needed: the checks are plain
functions that fail a few times, then succeed)."""

from __future__ import annotations

import logging
import threading

import pytest

from app.infra.wait import NotReady, Stopped, Waiter, wait_for, waiting


def flaky(fails: int, value: str = "there"):
    """A check that raises NotReady `fails` times, then returns `value`; counts its calls."""
    calls = []

    def attempt() -> str:
        calls.append(1)
        if len(calls) <= fails:
            raise NotReady(f"not yet ({len(calls)})")
        return value

    return attempt, calls


def test_wait_for_returns_the_value_once_the_dependency_is_there_and_logs_two_lines(caplog) -> None:
    attempt, calls = flaky(3)
    with caplog.at_level(logging.DEBUG, logger="app.infra.wait"):
        assert wait_for("the thing", attempt, initial_s=0.01, max_delay_s=0.02) == "there"
    assert len(calls) == 4
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.levelname for r in lines] == ["WARNING", "INFO"], [r.getMessage() for r in lines]
    assert (
        lines[0]
        .getMessage()
        .startswith("waiting for the thing: not yet (1); retrying with backoff")
    )
    assert (
        lines[1].getMessage().startswith("the thing is there (waited ")
        and "4 tries" in lines[1].getMessage()
    )
    assert "the thing" not in waiting()


def test_a_dependency_there_at_once_logs_nothing(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="app.infra.wait"):
        assert wait_for("the present thing", lambda: 7) == 7
    assert not caplog.records


def test_any_exception_counts_as_not_there_yet_and_names_its_type(caplog) -> None:
    calls = []

    def attempt() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        return 1

    with caplog.at_level(logging.WARNING, logger="app.infra.wait"):
        wait_for("the broker", attempt, initial_s=0.01, max_delay_s=0.01)
    assert (
        "ConnectionRefusedError: [Errno 111] Connection refused" in caplog.records[0].getMessage()
    )


def test_the_stop_signal_ends_a_wait_and_clears_what_it_waited_for() -> None:
    stop = threading.Event()
    seen_waiting = []

    def attempt() -> None:
        seen_waiting.append(dict(waiting()))
        if len(seen_waiting) == 3:
            stop.set()
        raise NotReady("never there")

    with pytest.raises(Stopped, match="the absent thing"):
        wait_for("the absent thing", attempt, stop=stop, initial_s=0.01, max_delay_s=0.01)
    assert seen_waiting[1] == {
        "the absent thing": "never there"
    }  # published while waiting (readyz)
    assert "the absent thing" not in waiting()


def test_backoff_doubles_up_to_the_cap() -> None:
    """The sleeps tenacity asks for grow and stay under the cap (never a spin, never unbounded)."""
    sleeps: list[float] = []

    class Recorder(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            sleeps.append(timeout)
            return False

    attempt, _ = flaky(8)
    wait_for("the slow thing", attempt, stop=Recorder(), initial_s=0.5, max_delay_s=4.0)
    assert len(sleeps) == 8 and all(0.5 <= s <= 4.0 for s in sleeps), sleeps
    assert sleeps[-1] == 4.0 and sleeps[0] < 2.0, sleeps


def test_a_loop_waiter_logs_once_then_once_more_when_there(caplog) -> None:
    w = Waiter("a champion")
    with caplog.at_level(logging.INFO, logger="app.infra.wait"):
        for _ in range(5):
            w.pending("none yet")
        assert waiting()["a champion"] == "none yet"
        w.there()
    msgs = [r.getMessage() for r in caplog.records]
    assert (
        msgs[0] == "waiting for a champion: none yet"
        and msgs[1].startswith("a champion is there")
        and len(msgs) == 2
    )
    assert "a champion" not in waiting()
