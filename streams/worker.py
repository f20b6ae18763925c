"""Run one streams worker: `flywheel streams` (or `python -m streams.worker`).

Validates the config (reward spec guard), serves Prometheus metrics, waits for the broker
(app/infra/wait.py: started first, it stays up and says so), creates missing topics, then
runs the Faust worker until SIGTERM/SIGINT. Start more processes with the
same settings to split the partitions (one Kafka consumer group). `kill -USR2 <pid>` writes every
asyncio task's stack, then every thread's, to the worker's stderr (a stuck start-up names its own
line; a stuck agent its await). Mode's Worker would open pdb on SIGUSR2 once it runs
(`_on_sigusr2`): `run_worker`'s Worker keeps the dump.
"""

from __future__ import annotations

import logging
import os

from app.settings import Settings, get_settings
from streams.config import StreamsConfig

log = logging.getLogger(__name__)


def dump_stacks(fd: int = 2) -> None:
    """Every asyncio task's stack of the running loop, then every thread's (faulthandler), to `fd`.

    The threads come last and the signalled (main) thread last among them, so a reader knows the
    dump is complete when the main thread's frames end (tests/integration/streams/conftest.py)."""
    import asyncio
    import faulthandler
    import io

    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no running loop (still starting)
        tasks = set()
    buf = io.StringIO()
    for task in sorted(tasks, key=lambda t: t.get_name()):
        buf.write(f"--- asyncio {task!r}\n")
        task.print_stack(limit=12, file=buf)
    os.write(fd, buf.getvalue().encode(errors="replace"))
    faulthandler.dump_traceback(file=fd, all_threads=True)


def run_worker(
    settings: Settings | None = None, cfg: StreamsConfig | None = None, loglevel: str | None = None
) -> None:
    import faulthandler
    import signal

    import faust.worker

    class Worker(faust.worker.Worker):  # the name is the logs' "[^Worker]"
        def _on_sigusr2(self) -> None:  # mode's: pdb.set_trace(), on a worker nobody attaches to
            dump_stacks()

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # until the worker takes the signal
    from prometheus_client import start_http_server

    from streams.app import build_app, ensure_internal_topics

    if os.environ.get(
        "FLYWHEEL_STREAMS_PROFILE"
    ):  # dev tool: cProfile of the event-loop thread, written at exit
        import atexit
        import cProfile

        prof, out = cProfile.Profile(), os.environ["FLYWHEEL_STREAMS_PROFILE"]
        prof.enable()
        atexit.register(lambda: (prof.disable(), prof.dump_stats(out)))
    from app.infra.wait import kafka_ready

    settings = settings or get_settings()
    cfg = cfg or StreamsConfig()
    if cfg.metrics_port:  # first: flywheel_waiting_for says what the worker waits for
        start_http_server(cfg.metrics_port, addr=cfg.metrics_host)
        log.info("prometheus metrics on http://%s:%d/metrics", cfg.metrics_host, cfg.metrics_port)
    kafka_ready(
        settings, []
    )  # until the broker answers (backoff; SIGTERM ends the process meanwhile)
    ensure_internal_topics(settings, cfg)
    app, _ = build_app(settings, cfg)
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # Faust makes its datadir inside it
    worker = Worker(app, loglevel=loglevel or cfg.log_level, quiet=True)
    # Faust's start-up spinner sets the root logger to DEBUG and never resets it, so every
    # aiokafka/faust debug call in the hot path built a LogRecord (~6% of the worker's time)
    worker.spinner = None
    worker.execute_from_commandline()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    run_worker()
