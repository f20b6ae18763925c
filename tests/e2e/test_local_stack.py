"""The whole loop, as a user runs it: `flywheel run` on the embedded defaults, briefly, with a
short cadence. Real Kafka, MLflow server, API, streams worker, trainer, controller, two
replicas and the simulated editor population, each its own process.

Asserts through the status API that at least one version was trained on real feedback (its
lineage counts consumed rollouts), gated, canaried, and promoted or rolled back; that Ctrl-C
stops everything; and that a second start resumes from the data dir.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import stack_env, start_run, stop_run, wait_for

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
    return stack_env(
        data_dir,
        FLYWHEEL_TRAINER_POLICY=json.dumps(TINY_POLICY),
        FLYWHEEL_TRAINER_PRETRAIN_STEPS="30",
    )


@pytest.mark.timeout(1800)
def test_the_loop_turns_end_to_end_and_resumes(tmp_path: Path):
    """The module docstring's loop. Needs about two minutes: a whole `flywheel run` stack
    (broker, MLflow, a dozen role processes) comes up, one ship interval (60 s) passes before the
    first trained version, which is gated and canaried; then the stack restarts once."""
    data_dir = tmp_path / "data"
    env, ports = _env(data_dir)
    log = tmp_path / "run.log"
    api = f"http://127.0.0.1:{ports['api']}"
    proc = start_run(env, ports, log)
    try:
        keys_file = data_dir / "local-keys.json"
        wait_for("the local API keys", keys_file.exists, 300, proc, log)
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

        version = wait_for(
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
        rc = stop_run(proc, log=log)
    assert rc == 0, log.read_text(errors="replace")[-3000:]
    assert not (data_dir / "kafka" / "kafka.pid").exists(), "Ctrl-C must stop the embedded broker"

    # a second start resumes: same registry, same champion, the trainer restores its state
    proc = start_run(env, ports, log)
    try:
        http = httpx.Client(
            base_url=api,
            headers={"Authorization": f"Bearer {json.loads(keys_file.read_text())['read']}"},
            timeout=10,
        )
        status = wait_for(
            "the status API after a restart",
            lambda: http.get("/v1/deployments").json().get("models"),
            300,
            proc,
            log,
        )
        assert status[0]["champion"] == champion_before
        trainer_log = data_dir / "logs" / "trainer.log"
        wait_for(
            "the trainer to resume its saved state",
            lambda: "resum" in trainer_log.read_text(errors="replace").lower(),
            300,
            proc,
            log,
        )
    finally:
        rc = stop_run(proc, log=log)
    assert rc == 0
