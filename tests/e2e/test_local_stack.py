"""The whole loop, as a user runs it: `flywheel run` on the embedded defaults, briefly, with a
short cadence. Real Kafka, MLflow server, API, streams worker, trainer, controller, two
replicas and the simulated editor population, each its own process.

Asserts through the status API that at least one version was trained on real feedback (its
lineage counts consumed rollouts), gated, canaried, and promoted or rolled back; that Ctrl-C
stops everything; and that a second start resumes from the data dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.e2e

TINY_POLICY = {
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "d_ff": 64,
    "n_experts": 2,
    "top_k": 1,
    "max_context": 128,
}


def _env(data_dir: Path) -> tuple[dict[str, str], dict[str, int]]:
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
    env = dict(
        os.environ,
        FLYWHEEL_DATA_DIR=str(data_dir),
        FLYWHEEL_KAFKA_BOOTSTRAP=f"127.0.0.1:{ports['kafka']}",
        FLYWHEEL_KAFKA_CONTROLLER_PORT=str(ports["controller_quorum"]),
        FLYWHEEL_KAFKA_HEAP="512m",
        FLYWHEEL_MLFLOW_URI=f"http://127.0.0.1:{ports['mlflow']}",
        FLYWHEEL_API_PORT=str(ports["api"]),
        FLYWHEEL_SHIP_INTERVAL="60s",  # longer than a canary, or each new version supersedes it
        FLYWHEEL_WAIT_WINDOW="4s",
        FLYWHEEL_TRAINER_POLICY=json.dumps(TINY_POLICY),
        FLYWHEEL_TRAINER_PRETRAIN_STEPS="30",
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
    return env, ports


def _start(env: dict[str, str], ports: dict[str, int], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "run",
            "--no-live",
            "--duration",
            "15m",
            "--replica-base-port",
            str(ports["replicas"]),
        ],
        env=env,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen, timeout: float = 120.0) -> int:
    proc.send_signal(signal.SIGINT)  # what Ctrl-C does
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def _wait_for(
    what: str, fn, timeout: float, proc: subprocess.Popen, log: Path, interval: float = 3.0
):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"flywheel run exited ({proc.returncode}) while waiting for {what}:\n"
            f"{log.read_text(errors='replace')[-4000:]}"
        )
        try:
            last = fn()
            if last:
                return last
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r}); "
        f"logs in {log.parent}:\n{log.read_text(errors='replace')[-3000:]}"
    )


@pytest.mark.timeout(1800)
def test_the_loop_turns_end_to_end_and_resumes(tmp_path: Path):
    data_dir = tmp_path / "data"
    env, ports = _env(data_dir)
    log = tmp_path / "run.log"
    api = f"http://127.0.0.1:{ports['api']}"
    proc = _start(env, ports, log)
    try:
        keys_file = data_dir / "local-keys.json"
        _wait_for("the local API keys", keys_file.exists, 300, proc, log)
        http = httpx.Client(
            base_url=api,
            headers={"Authorization": f"Bearer {json.loads(keys_file.read_text())['read']}"},
            timeout=10,
        )

        def history() -> list[dict]:
            r = http.get("/v1/deployments/history", params={"limit": 500})
            r.raise_for_status()
            return r.json()["events"]

        def decided_version():
            events = history()
            by_type: dict[str, set[str]] = {}
            for e in events:
                by_type.setdefault(e["type"], set()).add(str(e.get("version")))
            trained = {
                v for v in by_type.get("version_registered", set()) if v not in ("1", "None")
            }
            for v in sorted(trained, key=int):
                gated = v in by_type.get("gate_passed", set()) | by_type.get("gate_failed", set())
                canaried = v in by_type.get("canary_started", set())
                decided = v in by_type.get("promoted", set()) | by_type.get("rolled_back", set())
                if gated and canaried and decided:
                    return v
            return None

        version = _wait_for(
            "a trained version that was gated, canaried and promoted or rolled back",
            decided_version,
            900,
            proc,
            log,
            interval=5,
        )

        model = http.get(f"/v1/models/{version}")
        assert model.status_code == 200, model.text
        body = model.json()
        consumed = body.get("rollouts_consumed") or body.get("lineage", {}).get("rollouts_consumed")
        assert consumed and int(consumed) > 0, (
            f"version {version} must be trained on real feedback: {body}"
        )
        status = http.get("/v1/deployments").json()
        assert status["models"], status
        champion_before = status["models"][0]["champion"]
        assert champion_before is not None
    finally:
        rc = _stop(proc)
    assert rc == 0, log.read_text(errors="replace")[-3000:]
    assert not (data_dir / "kafka" / "kafka.pid").exists(), "Ctrl-C must stop the embedded broker"

    # a second start resumes: same registry, same champion, the trainer restores its state
    proc = _start(env, ports, log)
    try:
        http = httpx.Client(
            base_url=api,
            headers={"Authorization": f"Bearer {json.loads(keys_file.read_text())['read']}"},
            timeout=10,
        )
        status = _wait_for(
            "the status API after a restart",
            lambda: http.get("/v1/deployments").json().get("models"),
            300,
            proc,
            log,
        )
        assert status[0]["champion"] == champion_before
        trainer_log = data_dir / "logs" / "trainer.log"
        _wait_for(
            "the trainer to resume its saved state",
            lambda: "resum" in trainer_log.read_text(errors="replace").lower(),
            300,
            proc,
            log,
        )
    finally:
        rc = _stop(proc)
    assert rc == 0
