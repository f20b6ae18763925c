"""A small process supervisor for `flywheel run`: one subprocess per role, logs to files,
restart with backoff when a role crashes, clean stop in reverse start order.

Each role runs as `python -m app.cli <role> ...` so it is exactly what an operator would run
by hand; its stdout/stderr go to `<data_dir>/logs/<name>.log`. Roles run in their own sessions
(so a terminal's Ctrl-C reaches only the supervisor, which stops them in order), and each gets
SIGTERM from the kernel if the supervisor dies without stopping it (SIGKILL, the OOM killer:
app/infra/procs.py `die_with_parent`), so no role outlives its supervisor.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.infra.procs import die_with_parent, stop_groups

log = logging.getLogger(__name__)


@dataclass
class RoleSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # shown in the status view
    ready: Callable[[], bool] | None = None  # polled after start
    ready_timeout: float = 300.0  # generous: a busy machine can take minutes to import mlflow
    restart: bool = True
    # a server the other roles use (MLflow): stopped after them, so that what they do on the way
    # out (the trainer's last metrics, a ship in flight) still reaches it
    infra: bool = False


@dataclass
class RoleProcess:
    spec: RoleSpec
    proc: subprocess.Popen | None = None
    restarts: int = 0
    state: str = "stopped"  # starting | ready | crashed | stopped
    next_restart: float = 0.0
    started_at: float = 0.0


class Supervisor:
    def __init__(self, log_dir: Path, base_env: dict[str, str] | None = None):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.base_env = dict(os.environ, **(base_env or {}))
        self.roles: list[RoleProcess] = []

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, spec: RoleSpec, wait: bool = True) -> RoleProcess:
        rp = RoleProcess(spec)
        self.roles.append(rp)
        self._spawn(rp)
        if wait and spec.ready is not None:
            self.wait_ready(rp)
        return rp

    def _spawn(self, rp: RoleProcess) -> None:
        out = open(self.log_path(rp.spec.name), "ab")
        env = dict(self.base_env, **rp.spec.env, PYTHONUNBUFFERED="1")
        rp.proc = subprocess.Popen(
            rp.spec.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        out.close()
        rp.state, rp.started_at = "starting", time.monotonic()
        log.info(
            "started %s (pid %s), log %s", rp.spec.name, rp.proc.pid, self.log_path(rp.spec.name)
        )

    def wait_ready(self, rp: RoleProcess) -> None:
        deadline = time.monotonic() + rp.spec.ready_timeout
        while time.monotonic() < deadline:
            if rp.proc is not None and rp.proc.poll() is not None:
                tail = self.log_path(rp.spec.name).read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{rp.spec.name} exited with {rp.proc.returncode} while starting:\n{tail}"
                )
            if rp.spec.ready is None or rp.spec.ready():
                rp.state = "ready"
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"{rp.spec.name} not ready after {rp.spec.ready_timeout:.0f}s; see {self.log_path(rp.spec.name)}"
        )

    def poll(self) -> list[str]:
        """Check every role once: mark crashes, restart with exponential backoff. Returns messages."""
        msgs = []
        now = time.monotonic()
        for rp in self.roles:
            if rp.proc is None or rp.state == "stopped":
                continue
            code = rp.proc.poll()
            if code is None:
                if rp.state == "starting" and (rp.spec.ready is None or rp.spec.ready()):
                    rp.state = "ready"
                continue
            if rp.state != "crashed":
                # what the role started (a vLLM server, a worker) outlives it in its process group
                stop_groups([rp.proc], timeout_s=10.0)
                rp.state = "crashed"
                rp.next_restart = now + min(60.0, 2.0 ** min(rp.restarts, 5))
                msgs.append(f"{rp.spec.name} exited with {code}; see {self.log_path(rp.spec.name)}")
            elif rp.spec.restart and now >= rp.next_restart:
                rp.restarts += 1
                self._spawn(rp)
                msgs.append(f"restarted {rp.spec.name} (restart #{rp.restarts})")
        return msgs

    def stop_all(self, timeout: float = 20.0) -> None:
        """SIGTERM every role's process group (a role's own children too), SIGKILL the groups
        with processes left after `timeout`: first the roles, together, then the `infra` servers
        they use (each tier within `timeout`)."""
        for infra in (False, True):
            running = [
                (rp, rp.proc)
                for rp in reversed(self.roles)
                if rp.proc is not None and rp.spec.infra == infra
            ]
            killed = stop_groups([proc for _, proc in running], timeout)
            for rp, proc in running:
                if proc in killed:
                    log.warning("%s did not stop in %.0fs; killed", rp.spec.name, timeout)
                rp.state = "stopped"
