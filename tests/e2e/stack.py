"""What the end-to-end tests share: a `flywheel run` whole stack on free ports, started,
waited on and stopped as a user would (Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import free_port


def stack_env(data_dir: Path, **settings: str) -> tuple[dict[str, str], dict[str, int]]:
    """(environment, ports) of a `flywheel run` in `data_dir` on free ports, with the settings a
    short test needs and `settings` (FLYWHEEL_* names) on top; the caller's own FLYWHEEL_*
    variables are left out, so the test runs on exactly these."""
    ports = {
        name: free_port()
        for name in (
            "kafka",
            "controller_quorum",
            "mlflow",
            "api",
            "trainer_metrics",
            "controller_metrics",
            "streams_metrics",
        )
    }
    ports["replicas"] = free_port()  # replica i on ports["replicas"] + i
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_DATA_DIR=str(data_dir),
        FLYWHEEL_KAFKA_BOOTSTRAP=f"127.0.0.1:{ports['kafka']}",
        FLYWHEEL_KAFKA_CONTROLLER_PORT=str(ports["controller_quorum"]),
        FLYWHEEL_KAFKA_HEAP="512m",
        FLYWHEEL_MLFLOW_URI=f"http://127.0.0.1:{ports['mlflow']}",
        FLYWHEEL_API_PORT=str(ports["api"]),
        FLYWHEEL_SHIP_INTERVAL="60s",  # longer than a canary, or each new version supersedes it
        FLYWHEEL_WAIT_WINDOW="4s",
        FLYWHEEL_TRAINER_MIN_ROLLOUTS="4",
        FLYWHEEL_TRAINER_BATCH_SIZE="4",
        FLYWHEEL_TRAINER_METRICS_PORT=str(ports["trainer_metrics"]),
        FLYWHEEL_CONTROLLER_METRICS_PORT=str(ports["controller_metrics"]),
        FLYWHEEL_CONTROLLER_STEPS="50,100",  # few sessions here: a 5% step would see none
        FLYWHEEL_CONTROLLER_MIN_STEP="3s",
        # a tiny model's rewards are noisy: a wide non-inferiority margin lets the anytime-valid
        # bound decide (promote or roll back) within one ship interval
        FLYWHEEL_CONTROLLER_MARGIN="0.5",
        FLYWHEEL_CONTROLLER_MIN_SAMPLES="4",
        FLYWHEEL_CONTROLLER_STEP_DEADLINE="90s",
        FLYWHEEL_CONTROLLER_POLL_INTERVAL="2s",
        FLYWHEEL_STREAMS_METRICS_BUCKET="2s",
        FLYWHEEL_STREAMS_METRICS_PORT=str(ports["streams_metrics"]),
        FLYWHEEL_SIMULATE_USERS="12",
        FLYWHEEL_SIMULATE_RPS="4",
        FLYWHEEL_SIMULATE_MAX_TOKENS="16",
        PYTHONUNBUFFERED="1",
    )
    env.update(settings)
    return env, ports


def start_run(
    env: dict[str, str], ports: dict[str, int], log: Path, *args: str
) -> subprocess.Popen:
    """`flywheel run --no-live` (plus `args`) in its own process group, output to `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", "run", *args, "--no-live", "--duration", "15m"]
        + ["--replica-base-port", str(ports["replicas"])],
        env=env,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


# `flywheel run`'s own bound on stopping (app/run.py `_stop`): the roles, then the infra servers,
# each tier SIGTERM, 20 s, SIGKILL, up to 15 s to reap (app/supervisor.py `stop_all`), then the
# embedded broker's controlled shutdown, 30 s before SIGKILL (app/infra/broker.py `LocalKafka.stop`)
RUN_STOP_BOUND_S = 2 * (20 + 15) + 30


def stop_run(
    proc: subprocess.Popen, timeout: float = RUN_STOP_BOUND_S + 60, log: Path | None = None
) -> int:
    """Ctrl-C `flywheel run` and wait for its exit code; past `timeout`, kill its process group
    and fail with the tail of `log` (the run logs how long each role took to stop)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)  # what Ctrl-C does
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        tail = log.read_text(errors="replace")[-4000:] if log is not None else "(no log given)"
        raise AssertionError(f"flywheel run did not stop within {timeout:.0f}s of Ctrl-C:\n{tail}")
    _phase(f"stopped in {time.monotonic() - start:.0f}s")
    return rc


def _phase(what: str) -> None:
    """A line on stderr (shown with the test's output on failure, and with `-s`): where an
    end-to-end test spent its minutes."""
    print(f"[e2e {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def wait_for(
    what: str, fn, timeout: float, proc: subprocess.Popen, log: Path, interval: float = 3.0
):
    """`fn()` once it is truthy (HTTP and lookup errors count as not yet), failing with the log
    when `flywheel run` exits or `timeout` passes."""
    start = time.monotonic()
    deadline = start + timeout
    last = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"flywheel run exited ({proc.returncode}) while waiting for {what}:\n"
            f"{log.read_text(errors='replace')[-4000:]}"
        )
        try:
            last = fn()
            if last:
                _phase(f"{time.monotonic() - start:.0f}s waiting for {what}")
                return last
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r}); "
        f"logs in {log.parent}:\n{log.read_text(errors='replace')[-3000:]}"
    )
