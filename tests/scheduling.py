"""How the suite's tests are handed to the xdist workers: longest first, few whole stacks at once.

`make test` runs the suite on several workers with `--dist load --maxschedchunk 1`: each worker
takes the next test of one shared queue when it finishes one (xdist keeps one more queued on each
worker, which a worker needs to start a test). The run then ends about when its longest test
does, provided the longest tests start first; started last, one 3-minute test can leave every
other worker idle for minutes. So the queue is sorted by how long each test took in
the last run on this machine (`DURATIONS`, under ~/.cache, written by every run that ran tests):
the tests that took `SLOW_S` or more first, longest first; then the others, integration before
unit, in collection order. A test the file does not know yet (a new test, a first run on this
machine) counts as slow if it is an end-to-end test.

An end-to-end test runs a whole `flywheel run` stack (a dozen processes that all want CPU), and
the vLLM engine's tests start `vllm serve` processes. Two or three of those side by side on a
2-core machine starve each other and everything else, so `StackLimitedScheduling` (xdist's load
scheduling, plus one rule) lets at most `MAX_STACKS` workers hold such tests (`STACK_TESTS`) at a
time; the others take the rest of the queue meanwhile.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest
from xdist.scheduler import LoadScheduling

DURATIONS = Path(
    os.environ.get(
        "FLYWHEEL_TEST_DURATIONS", Path.home() / ".cache" / "flywheel" / "test-durations.json"
    )
)
MAX_STACKS = int(os.environ.get("FLYWHEEL_TEST_MAX_STACKS", "1"))
SLOW_S = 5.0  # tests at least this long are queued first, longest first
# where a test the durations file does not know goes: end-to-end tests count as slow, the rest
# follow the slow tests, integration before unit
TIER_RANK = {"e2e": 0, "integration": 1, "unit": 2}


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}


# tests that start a whole `flywheel run` stack or several vLLM servers (each a few processes
# that want a core): the end-to-end tests and the vLLM engine's integration tests
STACK_TESTS = ("tests/e2e/", "tests/integration/replica/test_vllm_engine.py")


def is_stack(nodeid: str) -> bool:
    """Whether a test is one of `STACK_TESTS`."""
    return nodeid.startswith(STACK_TESTS)


def _tier(nodeid: str) -> int:
    parts = nodeid.split("/")
    return TIER_RANK.get(parts[1] if len(parts) > 2 and parts[0] == "tests" else "", 1)


def queue_key(nodeid: str, known: dict[str, float]) -> tuple[int, float, int]:
    """(0, -seconds, 0) for a slow test, (1, 0, tier) for the others."""
    seconds = known.get(nodeid)
    if seconds is None and _tier(nodeid) == 0:
        seconds = 600.0  # an end-to-end test nobody has timed yet
    if seconds is not None and seconds >= SLOW_S:
        return (0, -seconds, 0)
    return (1, 0.0, _tier(nodeid))


def longest_first(items: list[pytest.Item], known: dict[str, float]) -> None:
    """Sort `items` in place: slow tests first, longest first, then the others by tier in
    collection order (so a module's quick tests stay together and its module-scoped fixtures
    are set up once per worker). Stable, so every worker computes the same order."""
    items.sort(key=lambda item: queue_key(item.nodeid, known))


def cpu_seconds() -> float:
    """User + system CPU of this process and of its children that have exited and been reaped
    (a test's subprocesses: a CLI run, a role, a whole `flywheel run` stack with its roles)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuMeter:
    """In the process that runs the tests (an xdist worker, or a plain run): the CPU seconds each
    test used, setup to teardown, attached to its teardown report (`user_properties` "cpu_s", which
    xdist carries to the controller). On 2 cores the suite is CPU-bound, so this, not the wall
    time of a test that waited on others, is what a change to the suite must cut. Servers shared
    by the run (tests/shared.py) are not counted: no test reaps them."""

    def __init__(self) -> None:
        self.start: dict[str, float] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.start[item.nodeid] = cpu_seconds()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        report = yield
        if call.when == "teardown" and item.nodeid in self.start:
            report.user_properties.append(("cpu_s", cpu_seconds() - self.start.pop(item.nodeid)))
        return report


class DurationRecorder:
    """Sums each test's setup, call and teardown time (and the CPU `CpuMeter` measured) as the
    reports arrive (in the xdist controller, or the only process of a plain run), prints the
    run's wall time and its slowest tests at the end, and merges the durations into the
    durations file."""

    def __init__(self, path: Path = DURATIONS, show: int = 25) -> None:
        self.path, self.show = path, show
        self.seen: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seen[report.nodeid] = self.seen.get(report.nodeid, 0.0) + report.duration
        for name, value in report.user_properties:
            if name == "cpu_s":
                self.cpu[report.nodeid] = float(value)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seen:
            return
        tr = terminalreporter
        wall = time.monotonic() - self.started
        tr.write_sep("=", f"{self.show} slowest tests (setup + call + teardown; CPU they used)")
        for nodeid, seconds in sorted(self.seen.items(), key=lambda kv: -kv[1])[: self.show]:
            cpu = self.cpu.get(nodeid)
            tr.write_line(f"{seconds:8.1f}s {'' if cpu is None else f'{cpu:7.1f}s cpu'}  {nodeid}")
        if self.cpu:
            tr.write_sep("=", f"{self.show} tests that used the most CPU")
            for nodeid, cpu in sorted(self.cpu.items(), key=lambda kv: -kv[1])[: self.show]:
                tr.write_line(f"{cpu:8.1f}s cpu  {self.seen.get(nodeid, 0.0):7.1f}s  {nodeid}")
        total = sum(self.seen.values())
        tr.write_sep(
            "=",
            f"{len(self.seen)} tests: {wall:.0f} s wall ({wall / 60:.1f} min), "
            f"{total:.0f} s of test time, {sum(self.cpu.values()):.0f} s of test CPU",
        )

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.seen or exitstatus == pytest.ExitCode.INTERRUPTED:
            return  # an interrupted test's time says nothing of how long it takes
        merged = {**load_durations(self.path), **{k: round(v, 2) for k, v in self.seen.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=0, sort_keys=True))
        tmp.replace(self.path)
        if self.cpu:  # beside the durations: what each test cost in CPU, for whoever cuts it
            cpu_path = self.path.with_name(self.path.stem + "-cpu.json")
            cpu_path.write_text(
                json.dumps({k: round(v, 2) for k, v in self.cpu.items()}, indent=0, sort_keys=True)
            )


class StackLimitedScheduling(LoadScheduling):
    """xdist's load scheduling, except that at most `max_stacks` workers hold `STACK_TESTS`
    (queued or running) at once. A worker that already holds one may queue another behind it:
    they run one after the other. When only end-to-end tests are left and every slot is taken,
    a worker that asks gets nothing until a slot frees (a stack test finishing rechecks every
    worker)."""

    def __init__(self, config: pytest.Config, log=None, max_stacks: int = MAX_STACKS) -> None:
        super().__init__(config, log)
        self.max_stacks = max(1, max_stacks)

    def _stack(self, index: int) -> bool:
        return is_stack(self.collection[index])

    def _holds_stack(self, node) -> bool:
        return any(self._stack(i) for i in self.node2pending[node])

    def _send_tests(self, node, num: int) -> None:
        others = sum(self._holds_stack(n) for n in self.node2pending if n is not node)
        chosen: list[int] = []
        for index in self.pending:
            if len(chosen) == num:
                break
            if self._stack(index) and others >= self.max_stacks:
                continue
            chosen.append(index)
        if chosen:
            taken = set(chosen)
            self.pending[:] = [i for i in self.pending if i not in taken]
            self.node2pending[node].extend(chosen)
            node.send_runtest_some(chosen)

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        if self._stack(item_index):  # a slot may have freed: workers left waiting ask again
            for other in list(self.node2pending):
                if other is not node:
                    self.check_schedule(other)
