"""app/infra/procs.py and its users: stopping a child stops what it started, also after the child
itself died (real processes: a leader that starts a worker in its process group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.infra.procs import group_alive, stop_groups

# a leader that starts one worker (its own process group's member) and prints the worker's pid;
# the worker ignores SIGTERM when asked to, as a stuck server does
LEADER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(worker.pid, flush=True)
time.sleep(600)
"""
WORKER = "import signal, sys, time\n{ignore}\ntime.sleep(600)\n"


def _start(ignore_term: bool = False) -> tuple[subprocess.Popen, int]:
    worker = WORKER.format(
        ignore="signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else ""
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, worker],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert leader.stdout is not None
    worker_pid = int(leader.stdout.readline())
    return leader, worker_pid


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie waiting for init to reap it has stopped


def _cleanup(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_worker_outliving_its_dead_leader_is_stopped() -> None:
    leader, worker = _start()
    try:
        os.kill(leader.pid, signal.SIGKILL)  # the server crashed; its worker lives on
        leader.wait(10)
        time.sleep(0.2)
        assert _running(worker), "the worker should outlive its leader (what the helper is for)"
        killed = stop_groups([leader], timeout_s=10)
        assert killed == [], "the worker takes SIGTERM; nothing needed SIGKILL"
        deadline = time.monotonic() + 5
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker), "the crashed leader's worker is still running"
    finally:
        _cleanup(worker)


def test_a_member_ignoring_sigterm_is_killed_after_the_timeout() -> None:
    leader, worker = _start(ignore_term=True)
    try:
        t0 = time.monotonic()
        killed = stop_groups([leader], timeout_s=1.0)
        assert killed == [leader]
        assert time.monotonic() - t0 < 10, "bounded by the timeout, not a hang"
        assert leader.returncode is not None, "the leader is reaped"
        deadline = time.monotonic() + 5
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker)
    finally:
        _cleanup(worker)


def test_a_group_that_is_gone_is_nothing_to_stop() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait(30)
    time.sleep(0.1)
    assert not group_alive(p.pid)
    assert stop_groups([p], timeout_s=1) == []


@pytest.mark.parametrize("stopper", ["vllm", "mlflow", "supervisor"])
def test_each_stopper_stops_the_workers_of_a_crashed_child(stopper: str, tmp_path: Path) -> None:
    """The vLLM server (app/replica/engines/vllm.py), `mlflow server` (app/infra/mlflow_server.py)
    and `flywheel run`'s supervisor (app/supervisor.py) all stop a child's whole group: a leader
    that died before the stop leaves no worker behind."""
    leader, worker = _start()
    try:
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait(10)
        if stopper == "vllm":
            from app.replica.engines.vllm import VLLMServer

            server = VLLMServer.__new__(VLLMServer)  # the process is ours, not a vLLM's
            server.proc, server._log = leader, open(tmp_path / "vllm.log", "ab")
            server.stop(timeout_s=10)
        elif stopper == "mlflow":
            from app.infra.mlflow_server import stop_server

            stop_server(leader, timeout=10)
        else:
            from app.supervisor import RoleProcess, RoleSpec, Supervisor

            sup = Supervisor(tmp_path)
            rp = RoleProcess(RoleSpec("crashed", ["x"], restart=False), proc=leader, state="ready")
            sup.roles.append(rp)
            sup.poll()  # notices the crash
            assert rp.state == "crashed"
        deadline = time.monotonic() + 5
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker), f"{stopper} left the crashed child's worker running"
    finally:
        _cleanup(worker)


# a server that leaves a mark when it is stopped, and a role that, when stopped, takes a moment to
# finish (the trainer's last metrics to MLflow) and records whether the server was still up then
SERVER = """
import pathlib, signal, sys, time
def stop(*_):
    pathlib.Path(sys.argv[1]).touch()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(600)
"""
ROLE = """
import os, signal, sys, time
def stop(*_):
    time.sleep(0.5)
    open(sys.argv[2], "w").write("down" if os.path.exists(sys.argv[1]) else "up")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(600)
"""


def test_the_supervisor_stops_the_roles_before_the_servers_they_use(tmp_path: Path) -> None:
    """`flywheel run`'s stop (app/supervisor.py stop_all): the roles first, then the `infra`
    servers (MLflow), so what a role does on its way out still reaches them. Stopped together,
    the server went first and the trainer's last MLflow call retried until it was killed."""
    from app.supervisor import RoleSpec, Supervisor

    sup = Supervisor(tmp_path / "logs")
    stopped, seen = tmp_path / "server-stopped", tmp_path / "seen"
    server = sup.start(RoleSpec("mlflow", [sys.executable, "-c", SERVER, str(stopped)], infra=True))
    role = sup.start(RoleSpec("trainer", [sys.executable, "-c", ROLE, str(stopped), str(seen)]))
    try:
        for name in ("mlflow", "trainer"):  # both have their SIGTERM handlers
            log = sup.log_path(name)
            deadline = time.monotonic() + 30
            while "ready" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "ready" in log.read_text(), log.read_text()
        sup.stop_all(timeout=10)
        assert stopped.exists(), "the server was not stopped with SIGTERM"
        assert seen.read_text() == "up", "the server was stopped before the role using it"
        assert role.proc.returncode == 0 and not group_alive(server.proc.pid)
        assert {rp.state for rp in sup.roles} == {"stopped"}
    finally:
        for rp in sup.roles:
            _cleanup(rp.proc.pid)
