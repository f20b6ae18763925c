"""No role outlives its supervisor, however the supervisor ends (real processes).

The supervisor below is `flywheel run`'s (app/supervisor.py, with app/run.py's signal handling
and stop): it starts two roles, each in its own session as `flywheel run` starts them, prints
their pids and waits for Ctrl-C.

- Ctrl-C with the output gone (`flywheel run | tee run.log`: the terminal's SIGINT ends `tee`
  too, so the first "stopping..." line meets a closed pipe): the roles are stopped all the same.
- SIGKILL (or the OOM killer): the supervisor runs no cleanup at all; the kernel sends each role
  SIGTERM (`die_with_parent`), and the roles stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.infra.procs import die_with_parent

SUPERVISOR = """
import signal, sys
from pathlib import Path
from rich.console import Console
from app.run import _stop, _stop_on_signals
from app.supervisor import RoleSpec, Supervisor

_stop_on_signals()
logs = Path(sys.argv[1])
sup = Supervisor(logs)
console = Console()
try:
    for i in range(2):
        sup.start(RoleSpec(f"role-{i}", [sys.executable, "-c", "import time; time.sleep(600)"]), wait=False)
    console.print(" ".join(str(r.proc.pid) for r in sup.roles))
    signal.pause()  # until Ctrl-C
except KeyboardInterrupt:
    pass
finally:
    _stop(console, sup, None, logs)
(logs / "stopped").write_text("ok")
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The pids still running after `timeout_s` (a bound on the wait, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _running(p)]


def _start_supervisor(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    roles = [int(p) for p in proc.stdout.readline().split()]
    assert len(roles) == 2 and all(_running(p) for p in roles), roles
    return proc, roles


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_ctrl_c_with_the_output_pipe_closed_still_stops_every_role(tmp_path: Path) -> None:
    sup, roles = _start_supervisor(tmp_path)
    try:
        sup.stdout.close()  # `tee` ended by the same Ctrl-C: every later write is EPIPE
        os.killpg(sup.pid, signal.SIGINT)
        assert sup.wait(60) == 0
        assert (tmp_path / "stopped").exists(), "the cleanup did not run to its end"
        assert _wait_gone(roles) == [], "roles outlived a supervisor whose output was closed"
    finally:
        _kill([sup.pid, *roles])


def test_sigkill_of_the_supervisor_stops_every_role(tmp_path: Path) -> None:
    sup, roles = _start_supervisor(tmp_path)
    try:
        sup.kill()
        sup.wait(10)
        assert _wait_gone(roles) == [], "roles outlived a SIGKILLed supervisor"
    finally:
        _kill(roles)


def test_a_child_whose_parent_died_before_it_was_set_up_is_signalled_at_once(
    tmp_path: Path,
) -> None:
    """The race `die_with_parent` closes: the parent dies between fork and prctl. Here the
    child's preexec runs in a process whose recorded parent is not its parent (as if that one
    had died): it must get the signal itself instead of living on."""
    script = (
        "import os, time\n"
        "from app.infra.procs import die_with_parent\n"
        "fn = die_with_parent()  # records this process as the parent\n"
        "if os.fork() == 0:\n"
        "    grandchild = os.fork()\n"
        "    if grandchild == 0:\n"
        "        fn()  # its parent is not the recorded one: as if that one had died\n"
        "        time.sleep(600)\n"
        "        os._exit(0)\n"
        "    _, status = os.waitpid(grandchild, 0)\n"
        "    os._exit(os.WTERMSIG(status) if os.WIFSIGNALED(status) else 255)\n"
        "_, status = os.waitpid(-1, 0)\n"
        "print(os.WEXITSTATUS(status), flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [str(int(signal.SIGTERM))], out
    assert die_with_parent() is not None  # Linux: the parent-death signal is available
