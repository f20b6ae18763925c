"""`flywheel simulate` with agent users stops on SIGTERM as on Ctrl-C: the sessions in flight are
cancelled and their sandboxes (a throwaway directory each, app/sandbox/sandbox.py) are removed.

`flywheel run` stops its roles with SIGTERM (app/supervisor.py `stop_all`); a role killed by the
signal's default action leaves every open sandbox behind in the temp dir. The replica here is an
address nothing listens on, so each session holds its sandbox while it retries its first turn
(FLYWHEEL_SIMULATE_AGENT_RETRY_S): the signal always finds sessions in flight. Real process, real
signal, real directories; nothing is mocked.

Run: .venv/bin/pytest tests/integration/simulate/test_stop.py -q
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port
from tests.waiting import poll


def _sandboxes(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("flywheel-sandbox-*"))


def test_sigterm_stops_agent_sessions_and_removes_their_sandboxes(tmp_path: Path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every first turn is retried
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "FLYWHEEL_SIMULATE_AGENTS": "true",
        "FLYWHEEL_SIMULATE_USERS": "2",
        "FLYWHEEL_SIMULATE_AGENT_PARALLEL": "2",
        "FLYWHEEL_SIMULATE_AGENT_RETRY_S": "600",
    }
    cmd = [sys.executable, "-m", "app.cli", "simulate", "--api", dead, "--api-key", "k"]
    log = tmp_path / "simulate.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, "--replica", dead, "--no-evaluate"], env=env, stdout=out, stderr=out
        )
    try:

        def in_flight() -> bool:  # 2 users x 2 sessions each, all waiting on the replica
            assert proc.poll() is None, f"simulate exited early:\n{log.read_text()[-3000:]}"
            return len(_sandboxes(tmp)) >= 4

        poll(in_flight, 60, "4 sessions in flight, each with its sandbox")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != -signal.SIGTERM, "killed by the signal's default action: nothing was cleaned up"
    assert _sandboxes(tmp) == [], f"sandboxes left behind:\n{log.read_text()[-3000:]}"
