"""Waiting for what a role depends on: one helper, so every role waits and logs the same way.

    consumer = wait_for("the Kafka broker at 127.0.0.1:9092", connect, stop=stop)

`wait_for(what, attempt, stop=...)` calls `attempt()` until it returns without raising and
returns its value. Between tries it sleeps with exponential backoff (`initial_s` doubling,
jittered, capped at `max_delay_s`): it never spins and never gives up by itself. Only `stop`
(the role's stop signal, e.g. set on SIGTERM) ends a wait early, with `Stopped`. A role started
before its broker, database, MLflow server or registered model therefore stays up, says what it
waits for, and starts working as soon as it is there, whatever the start order.

Log lines (the same in every role, logger `app.infra.wait`):

    WARNING waiting for <what>: <why the last try failed>; retrying with backoff (at most every 10s)
    INFO    <what> is there (waited 12.3s, 7 tries)

plus a reminder line every `remind_s` (default 5 min) while the wait lasts. A check that finds
a condition unmet (a topic not created yet, a model not registered yet) raises `NotReady` with
the reason; any other exception counts as "not there yet" too (connection refused, timeouts).

Signals while waiting: the gauge `flywheel_waiting_for{dependency}` is 1 during a wait and 0
once the dependency is there (on the role's /metrics), and `waiting()` names what this process
waits for right now with the last reason (the API's /readyz, the replica's /readyz).

`Waiter` is the same log/gauge bookkeeping for a wait that is part of a loop the role runs
anyway (e.g. a replica whose deployment log names no champion yet): `.pending(why)` on each
failed look (logs once), `.there()` when it is satisfied.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import Gauge

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

WAITING = Gauge(
    "flywheel_waiting_for",
    "1 while this process waits for a dependency at start-up",
    ["dependency"],
)

INITIAL_S = 0.5  # first pause after a failed try
MAX_DELAY_S = 10.0  # the backoff's cap: a dependency that appears is noticed within this long
REMIND_S = 300.0  # while a wait lasts, repeat the waiting line this often

_lock = threading.Lock()
_waiting: dict[str, str] = {}  # what -> why the last try failed


class NotReady(Exception):
    """Raised by a check whose dependency answers but is not ready (the message says why)."""


class Stopped(Exception):
    """The role was asked to stop while it waited."""


def waiting() -> dict[str, str]:
    """What this process waits for now, with the reason of the last failed try."""
    with _lock:
        return dict(_waiting)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, NotReady) or text.startswith(type(exc).__name__):
        return text[:300]
    return f"{type(exc).__name__}: {text}"[:300]


class Waiter:
    """Log and gauge bookkeeping of one wait: one line when it starts, one when it ends."""

    def __init__(self, what: str, remind_s: float = REMIND_S, logger: logging.Logger | None = None):
        self.what, self.remind_s, self.log = what, remind_s, logger or log
        self.started: float | None = None
        self.tries = 0
        self._reminded = 0.0

    @property
    def active(self) -> bool:
        return self.started is not None

    def pending(self, why: str, max_delay_s: float | None = None) -> None:
        """One failed look: the first logs `waiting for ...`, later ones only every `remind_s`."""
        now = time.monotonic()
        self.tries += 1
        with _lock:
            _waiting[self.what] = why
        WAITING.labels(self.what).set(1)
        if self.started is None:
            self.started = self._reminded = now
            if max_delay_s:
                self.log.warning(
                    "waiting for %s: %s; retrying with backoff (at most every %gs)",
                    self.what,
                    why,
                    max_delay_s,
                )
            else:
                self.log.warning("waiting for %s: %s", self.what, why)
        elif now - self._reminded >= self.remind_s:
            self._reminded = now
            self.log.warning(
                "still waiting for %s after %.0fs (%d tries): %s",
                self.what,
                now - self.started,
                self.tries,
                why,
            )
        else:
            self.log.debug("waiting for %s: %s", self.what, why)

    def there(self) -> None:
        """The dependency is there: logs how long it took (only if there was a wait)."""
        with _lock:
            _waiting.pop(self.what, None)
        WAITING.labels(self.what).set(0)
        if self.started is not None:
            self.log.info(
                "%s is there (waited %.1fs, %d tries)",
                self.what,
                time.monotonic() - self.started,
                self.tries + 1,
            )
        self.started, self.tries = None, 0


def wait_for(
    what: str,
    attempt: Callable[[], T],
    *,
    stop: threading.Event | None = None,
    initial_s: float = INITIAL_S,
    max_delay_s: float = MAX_DELAY_S,
    remind_s: float = REMIND_S,
    logger: logging.Logger | None = None,
) -> T:
    """Call `attempt` until it succeeds and return its value; backoff between tries, capped.

    Waits as long as it takes: only `stop` ends it early (raises `Stopped`). `KeyboardInterrupt`
    and `SystemExit` pass through.
    """
    from tenacity import RetryError, Retrying, retry_if_exception_type, wait_exponential_jitter
    from tenacity.stop import stop_base

    assert 0 < initial_s <= max_delay_s, (
        f"need 0 < initial_s <= max_delay_s, got {initial_s}, {max_delay_s}"
    )
    stop = stop or threading.Event()
    waiter = Waiter(what, remind_s, logger)

    class _OnStop(stop_base):
        def __call__(self, retry_state) -> bool:
            return stop.is_set()

    def _before_sleep(retry_state) -> None:
        waiter.pending(_reason(retry_state.outcome.exception()), max_delay_s)

    retrying = Retrying(
        retry=retry_if_exception_type(Exception),
        stop=_OnStop(),
        wait=wait_exponential_jitter(initial=initial_s, max=max_delay_s, jitter=initial_s),
        sleep=stop.wait,
        before_sleep=_before_sleep,
    )
    try:
        value = retrying(attempt)
    except RetryError as exc:  # the stop signal arrived
        with _lock:
            _waiting.pop(what, None)
        WAITING.labels(what).set(0)
        raise Stopped(f"stopped while waiting for {what}") from exc.last_attempt.exception()
    waiter.there()
    return value


# --- the dependencies roles share ------------------------------------------------------------
CHECK_TIMEOUT_S = 5.0  # one try of a check below; a down dependency fails a try within this


_kafka_waits = 0  # kafka_ready calls in progress in this process


class _QuietWhileWaiting(logging.Filter):
    """kafka-python's connection layer logs several lines (up to ERROR) on every failed try to
    reach a broker: while a Kafka wait is in progress, its one `waiting for` line says the same,
    so those are dropped (one line per wait, not five per try)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _kafka_waits


_quiet = _QuietWhileWaiting()
KAFKA_NET_LOGGERS = (
    "kafka.net.manager",
    "kafka.net.connection",
    "kafka.conn",
    "kafka.client_async",
)


def kafka_ready(settings: Settings, topics: list[str], stop: threading.Event | None = None) -> None:
    """Wait until the broker answers and every topic in `topics` (full names) has partitions."""
    global _kafka_waits
    from app.infra.kafka import make_consumer

    ms = int(CHECK_TIMEOUT_S * 1000)

    def attempt() -> None:
        consumer = make_consumer(
            settings,
            group_id=None,
            bootstrap_timeout_ms=ms,
            request_timeout_ms=ms + 1000,
            client_id="flywheel-wait",
        )
        try:
            missing = [t for t in topics if not consumer.partitions_for_topic(t)]
        finally:
            consumer.close()
        if missing:
            raise NotReady(
                f"topic(s) {', '.join(missing)} do not exist yet (`flywheel kafka start` or "
                f"`flywheel kafka topics` creates them)"
            )

    what = f"Kafka at {settings.kafka_bootstrap}" + (
        f" with topic(s) {', '.join(topics)}" if topics else ""
    )
    for name in KAFKA_NET_LOGGERS:
        logging.getLogger(name).addFilter(_quiet)  # idempotent
    with _lock:
        _kafka_waits += 1
    try:
        wait_for(what, attempt, stop=stop)
    finally:
        with _lock:
            _kafka_waits -= 1


def mlflow_ready(uri: str, stop: threading.Event | None = None) -> None:
    """Wait until the MLflow server at `uri` answers `GET /health` (no-op for a non-HTTP URI)."""
    import httpx

    if not uri.startswith(("http://", "https://")):
        return

    def attempt() -> None:
        r = httpx.get(f"{uri.rstrip('/')}/health", timeout=CHECK_TIMEOUT_S)
        if r.status_code != 200:
            raise NotReady(f"GET /health answered {r.status_code}")

    wait_for(f"the MLflow server at {uri}", attempt, stop=stop)


def registered_model_ready(client, name: str, stop: threading.Event | None = None) -> None:
    """Wait until MLflow knows the registered model `name` (the trainer creates it)."""
    from mlflow.exceptions import MlflowException

    def attempt() -> None:
        try:
            client.get_registered_model(name)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                raise NotReady(
                    f"MLflow has no registered model {name} yet (`flywheel trainer` registers it)"
                ) from None
            raise

    wait_for(f"the registered model {name}", attempt, stop=stop)


def database_ready(url: str, stop: threading.Event | None = None) -> None:
    """Wait until the database at `url` answers `SELECT 1`."""
    import sqlalchemy as sa

    from app.db.session import get_engine

    def attempt() -> None:
        with get_engine(url).connect() as conn:
            conn.execute(sa.text("SELECT 1"))

    wait_for(f"the database at {_safe_url(url)}", attempt, stop=stop)


def _safe_url(url: str) -> str:
    """`url` without its password (for log lines)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a SQLAlchemy URL: say so rather than leak it
        return "<unparsable url>"
