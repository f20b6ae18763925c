"""What several benchmarks share: an embedded Kafka broker and MLflow server for one run.

with local_services(kafka=None, mlflow_uri=None, console=console) as (bootstrap, uri, work):
    ...   # the given services, or ones started here (and stopped on exit) under `work`
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # the checkout; role subprocesses run in it


@contextlib.contextmanager
def local_services(
    kafka: str | None = None,
    mlflow_uri: str | None = None,
    console: Any = None,
    prefix: str = "flywheel-bench-",
) -> Iterator[tuple[str, str, Path]]:
    """(Kafka bootstrap, MLflow URI, work dir): the given services, or embedded ones started here."""
    from app.infra.broker import LocalKafka
    from app.infra.mlflow_server import start_server, stop_server, wait_healthy
    from tests.conftest import free_port

    work = Path(tempfile.mkdtemp(prefix=prefix))
    broker = mlflow = None
    say = console.print if console is not None else (lambda *_: None)
    try:
        if kafka is None:
            broker = LocalKafka(
                home=work / "kafka", port=free_port(), controller_port=free_port(), heap="512m"
            )
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


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB (VmRSS from /proc, Linux); NaN once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return float("nan")


def percentile(xs: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `xs` by nearest rank; NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def start_role(
    argv: list[str], env: dict[str, str], log_path: Path, ready_url: str, timeout_s: float = 180.0
) -> subprocess.Popen:
    """Start a role (e.g. `[python, -m, app.cli, api, ...]`) in its own session, logging to
    `log_path`, and wait until `ready_url` answers 200; raises (with the log's path) if it exits
    or is not ready within `timeout_s`. Stop it with `stop_role`."""
    import time

    import httpx

    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=open(log_path, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{' '.join(argv[2:4])} exited with {proc.returncode}; see {log_path}"
            )
        try:
            if httpx.get(ready_url, timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_role(proc)
            raise TimeoutError(f"{ready_url} not ready after {timeout_s:.0f}s; see {log_path}")
        time.sleep(0.3)


def stop_role(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGINT the role's process group (graceful), SIGKILL what is left after `timeout_s`."""
    import signal

    from app.infra.procs import stop_groups

    stop_groups([proc], timeout_s, first=signal.SIGINT)
