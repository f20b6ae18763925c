"""`flywheel run` stops on a stop signal even when the KeyboardInterrupt its handler raises is
swallowed: Python ignores an exception raised inside a fork hook or a `__del__` (seen in a
fresh-clone run: a Ctrl-C while the supervisor started a role was lost in logging's at-fork hook,
and the run never stopped). The handler also sets `app.run.STOP`, which start-up and the status
loop check."""

from __future__ import annotations

import io
import signal
import threading
import time

import pytest
from rich.console import Console

from app import run
from app.status_view import StatusView

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture()
def handlers():
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    run.STOP.clear()
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    run.STOP.clear()


def test_a_swallowed_stop_signal_still_stops_start_up(handlers):
    run._stop_on_signals()
    try:  # where Python would swallow it
        signal.raise_signal(signal.SIGTERM)
    except KeyboardInterrupt:
        pass
    assert run.STOP.is_set()
    launch = run._Launch(Console(file=io.StringIO()), None, None, None)  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt, match="stop requested"):
        launch.ok("trainer")  # the next part that starts says so and stops


class _Quiet(StatusView):
    """The status loop without the API: nothing fetched, no new lines."""

    def fetch(self):  # type: ignore[override]
        return {}

    def new_lines(self, state):  # type: ignore[override]
        return []


class _Roles:
    def poll(self) -> list[str]:
        return []


def test_the_status_loop_returns_when_stop_is_set_not_an_interval_later():
    view = _Quiet("http://127.0.0.1:9", "key", _Roles(), interval_s=3600.0)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    view.run(live=False, until=None, stop=stop)
    assert time.monotonic() - started < 60.0  # woken by the stop, not the hour-long interval
