"""Servers one test session starts once, for all of its pytest-xdist workers.

`make test` runs the suite on several xdist workers (processes). A session-scoped fixture runs
once per worker, so a broker started there would be started once per worker. `shared_service`
starts a server once for the whole run instead: the first worker that needs it starts it in its
own process group under a file lock and writes what the others need (address, process group) to
`<run root>/shared/<name>.json`; the others read that file. The server outlives the worker that
started it (its own session), and the controller stops every such server at the end of the run
(`stop_all`, from `pytest_sessionfinish` in tests/conftest.py). Without xdist (`pytest -p
no:xdist`, `-n 0`) the caller's fixture starts and stops it as a plain session fixture does.

`shared_artifact` does the same for a directory that is expensive to build and only read once
built (a tiny model with its tokenizer, the results of a torchrun): built once per run by the
first worker that needs it, reused by every other worker and module.

Tests isolate themselves on a shared server by name, never by a server of their own: a topic
namespace per test on the broker, a model name per test in MLflow, a database per test on
PostgreSQL.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from app.infra.procs import stop_pgids

SHARED = "shared"


def under_xdist() -> bool:
    """Whether this process is an xdist worker."""
    return "PYTEST_XDIST_WORKER" in os.environ


def run_root(basetemp: Path) -> Path:
    """The directory every process of this run shares: under xdist a worker's basetemp is
    `<controller's basetemp>/popen-gwN`, so its parent; without xdist the basetemp itself."""
    return basetemp.parent if under_xdist() else basetemp


def shared_service(
    basetemp: Path, name: str, start: Callable[[Path], dict], alive: Callable[[dict], bool]
) -> dict:
    """The record of server `name` for this run, started by `start(home)` if no worker has yet.

    `start` starts the server in its own session (process group), waits until it serves and
    returns a JSON-able record holding at least `pgid`; `alive(record)` says whether a recorded
    server still serves (a server that died is a failure of the run, reported loudly)."""
    shared = run_root(basetemp) / SHARED
    shared.mkdir(parents=True, exist_ok=True)
    info = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if info.exists():
            record = json.loads(info.read_text())
            if record.get("error"):
                raise RuntimeError(f"shared {name} failed to start in another worker: {record}")
            if not alive(record):
                raise RuntimeError(
                    f"the shared {name} of this run ({record}) no longer serves; see {record.get('home')}"
                )
            return record
        home = shared / name
        home.mkdir(exist_ok=True)
        try:
            record = {**start(home), "home": str(home)}
        except Exception as exc:
            info.write_text(json.dumps({"error": repr(exc), "home": str(home)}))
            raise
        info.write_text(json.dumps(record))
        return record


def shared_artifact(basetemp: Path, name: str, build: Callable[[Path], None]) -> Path:
    """`<run root>/shared/artifacts/<name>`, built by `build(directory)` if no worker has yet.

    Its users only read it. A build that raised leaves no artifact: the next user builds it
    again (and fails the same way, loudly)."""
    root = run_root(basetemp) / SHARED / "artifacts"
    root.mkdir(parents=True, exist_ok=True)
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


def stop_all(root: Path, timeout_s: float = 30.0) -> list[str]:
    """Stop every server recorded under `root/shared`: SIGTERM to each process group, SIGKILL to
    the groups left after `timeout_s`. Returns the names of the servers that were stopped."""
    shared = root / SHARED
    records = []
    for info in sorted(shared.glob("*.json")) if shared.is_dir() else []:
        record = json.loads(info.read_text())
        if "pgid" in record:
            records.append((info.stem, int(record["pgid"])))
        info.unlink()
    stop_pgids([pgid for _, pgid in records], timeout_s)
    return [name for name, _ in records]
