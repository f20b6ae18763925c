"""Stopping a child and everything it started: the child's process group.

Servers Flywheel starts (`mlflow server`, vLLM, the roles of `flywheel run`) are started with
`start_new_session=True`, so each leads a process group holding its workers. Waiting for the
leader alone is not enough: a leader that crashed or was killed leaves its workers running (a
vLLM API server killed by the OOM killer leaves its EngineCore and worker, ~3 GB, orphaned), and
signalling the group only while the leader lives never reaches them. `stop_groups` signals every
group, waits until no member of any group is left (or `timeout_s`), then SIGKILLs the rest.

A process group id is the leader's pid; Linux does not hand out a pid that is still in use as a
process group id, so signalling the group of a leader that already exited reaches only its own
stragglers, never an unrelated process.

A child in its own session outlives its parent: nothing signals it when the parent dies. A
parent that may die without its cleanup (SIGKILL, the OOM killer, a crash) starts such children
with `preexec_fn=die_with_parent()`: Linux sends the child SIGTERM when the parent dies
(`prctl(PR_SET_PDEATHSIG)`), and the child stops as it does on any SIGTERM, its own children
included. The signal follows the thread that started the child, so the parent starts them from
a thread that lives as long as it does (the main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when this process dies, and
    gets it at once if this process died before the child was set up. None (nothing to do)
    where the kernel has no parent-death signal (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    parent = os.getpid()

    def _in_child() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), sig)

    return _in_child


def group_alive(pgid: int) -> bool:
    """Whether any process is left in process group `pgid` (a zombie not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_pgids(
    pgids: Sequence[int],
    timeout_s: float = 20.0,
    first: int = signal.SIGTERM,
    reap: Callable[[], object] = lambda: None,
) -> list[int]:
    """Send `first` to each process group, wait up to `timeout_s` until no member of any is left
    (`reap()` before each check, so a caller's exited leaders do not linger as zombies), then
    SIGKILL the groups with members left. Returns those groups."""
    for pgid in pgids:
        signal_group(pgid, first)
    deadline = time.monotonic() + timeout_s
    while True:
        reap()
        left = [g for g in pgids if group_alive(g)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for pgid in left:
        signal_group(pgid, signal.SIGKILL)
    return left


def stop_groups(
    procs: Sequence[subprocess.Popen],
    timeout_s: float = 20.0,
    first: int = signal.SIGTERM,
) -> list[subprocess.Popen]:
    """Send `first` to each process's group (each was started with `start_new_session=True`),
    wait up to `timeout_s` for every member of every group to exit, SIGKILL the groups with
    members left, and reap the leaders. Returns the processes whose group had to be killed."""
    killed = set(
        stop_pgids([p.pid for p in procs], timeout_s, first, lambda: [p.poll() for p in procs])
    )
    left = [p for p in procs if p.pid in killed]
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)
    # SIGKILL cannot be ignored: the members go within moments (bounded, never a hang: a member
    # stuck in the kernel or a zombie that init has not reaped yet is not waited for past this)
    settle = time.monotonic() + 5.0
    while any(group_alive(p.pid) for p in left) and time.monotonic() < settle:
        time.sleep(0.05)
    return left
