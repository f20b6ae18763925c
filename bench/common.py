"""What several benchmarks share: an embedded Kafka broker and MLflow server for one run.

    with local_services(kafka=None, mlflow_uri=None, console=console) as (bootstrap, uri, work):
        ...   # the given services, or ones started here (and stopped on exit) under `work`
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@contextlib.contextmanager
def local_services(kafka: str | None = None, mlflow_uri: str | None = None, console: Any = None,
                   prefix: str = "flywheel-bench-") -> Iterator[tuple[str, str, Path]]:
    """(Kafka bootstrap, MLflow URI, work dir): the given services, or embedded ones started here."""
    from app.infra.kafka import LocalKafka
    from app.infra.mlflow_server import start_server, stop_server, wait_healthy
    from tests.conftest import free_port

    work = Path(tempfile.mkdtemp(prefix=prefix))
    broker = mlflow = None
    say = console.print if console is not None else (lambda *_: None)
    try:
        if kafka is None:
            broker = LocalKafka(home=work / "kafka", port=free_port(), controller_port=free_port(), heap="512m")
            say("starting Kafka…")
            broker.start(timeout=180)
            kafka = broker.bootstrap
        if mlflow_uri is None:
            port = free_port()
            mlflow_uri = f"http://127.0.0.1:{port}"
            mlflow = start_server(work / "mlflow", "127.0.0.1", port)
            say("starting MLflow…")
            wait_healthy(mlflow_uri, proc=mlflow)
        yield kafka, mlflow_uri, work
    finally:
        if mlflow is not None:
            stop_server(mlflow)
        if broker is not None:
            broker.stop()
