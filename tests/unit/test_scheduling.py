"""The suite's own scheduling (tests/scheduling.py): longest first, at most N stacks at once.

The scheduler is driven as xdist's controller drives it (`add_node`, `add_node_collection`,
`schedule`, `mark_test_complete`), with stand-ins for the worker processes: a worker here only
records what it was sent (a real one needs a whole pytest process per worker)."""

from __future__ import annotations

import json

import pytest

from tests.scheduling import (
    CpuMeter,
    DurationRecorder,
    StackLimitedScheduling,
    load_durations,
    queue_key,
)


class Worker:
    """What the scheduler sees of an xdist worker: it is sent test indices and shut down."""

    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


class Config:
    """The options xdist's load scheduling reads (`-n N --dist load --maxschedchunk 1`)."""

    def __init__(self, workers: int) -> None:
        self.options = {"tx": [f"{workers}*popen"], "maxschedchunk": 1, "dist": "load"}

    def getvalue(self, name: str):
        return self.options[name]

    getoption = getvalue


COLLECTION = [
    "tests/e2e/test_a.py::test_stack_1",
    "tests/e2e/test_b.py::test_stack_2",
    "tests/e2e/test_b.py::test_stack_3",
] + [f"tests/unit/test_c.py::test_{i}" for i in range(12)]


def scheduler(workers: list[Worker], max_stacks: int) -> StackLimitedScheduling:
    sched = StackLimitedScheduling(Config(len(workers)), max_stacks=max_stacks)
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, COLLECTION)
    sched.schedule()
    return sched


def stacks_held(sched: StackLimitedScheduling) -> list[str]:
    return [
        w.gateway.id
        for w, pending in sched.node2pending.items()
        if any(COLLECTION[i].startswith("tests/e2e/") for i in pending)
    ]


@pytest.mark.parametrize("max_stacks", [1, 2])
def test_at_most_max_stacks_workers_hold_stack_tests_and_every_test_runs_once(max_stacks):
    workers = [Worker(f"gw{i}") for i in range(4)]
    sched = scheduler(workers, max_stacks)
    assert len(stacks_held(sched)) == max_stacks, sched.node2pending
    # finish tests in the order a run might: always the first test of the busiest worker
    done: list[int] = []
    while any(sched.node2pending.values()):
        held = stacks_held(sched)
        assert len(held) <= max_stacks, sched.node2pending
        node = max(sched.node2pending, key=lambda w: len(sched.node2pending[w]))
        index = sched.node2pending[node][0]
        sched.mark_test_complete(node, index)
        done.append(index)
    assert sorted(done) == list(range(len(COLLECTION))), "each test exactly once"
    assert not sched.pending and all(w.shutting_down for w in workers)


def test_a_worker_may_queue_a_second_stack_test_behind_its_own():
    workers = [Worker(f"gw{i}") for i in range(3)]
    scheduler(workers, max_stacks=1)
    # the first worker holds the first two stack tests back to back; the others hold none
    assert workers[0].sent == [0, 1], [w.sent for w in workers]
    assert all(i >= 3 for w in workers[1:] for i in w.sent), [w.sent for w in workers]


def test_queue_key_puts_known_slow_tests_first_longest_first_then_tiers(tmp_path):
    known = {"tests/unit/x.py::a": 30.0, "tests/integration/y.py::b": 90.0}
    keys = {
        n: queue_key(n, known)
        for n in [
            "tests/unit/x.py::a",
            "tests/integration/y.py::b",
            "tests/e2e/z.py::new",  # untimed end-to-end test: slow
            "tests/integration/y.py::quick",
            "tests/unit/x.py::quick",
        ]
    }
    order = sorted(keys, key=keys.get)
    assert order == [
        "tests/e2e/z.py::new",
        "tests/integration/y.py::b",
        "tests/unit/x.py::a",
        "tests/integration/y.py::quick",
        "tests/unit/x.py::quick",
    ]


def test_the_recorder_sums_phases_and_merges_into_the_file(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"tests/unit/old.py::t": 1.5, "tests/unit/x.py::a": 9.0}))
    rec = DurationRecorder(path)
    for phase, seconds in (("setup", 0.25), ("call", 2.0), ("teardown", 0.25)):
        rec.pytest_runtest_logreport(
            pytest.TestReport(
                "tests/unit/x.py::a", ("x", 0, "a"), {}, "passed", None, phase, [], seconds
            )
        )
    rec.pytest_sessionfinish(None, pytest.ExitCode.OK)
    assert load_durations(path) == {"tests/unit/old.py::t": 1.5, "tests/unit/x.py::a": 2.5}


def test_the_cpu_meter_counts_a_tests_reaped_subprocesses_and_the_recorder_writes_them(pytester):
    """A test that runs a CPU-bound subprocess gets at least that CPU on its teardown report, and
    the recorder prints it and writes it beside the durations."""
    pytester.makepyfile(
        test_burn="""
        import subprocess, sys

        def test_burn():
            subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(30_000_000): x += i"], check=True)

        def test_idle():
            pass
        """
    )
    durations = pytester.path / "durations.json"
    meter, rec = CpuMeter(), DurationRecorder(durations)
    result = pytester.inline_run("-p", "no:xdist", plugins=[meter, rec])
    result.assertoutcome(passed=2)
    cpu = json.loads((pytester.path / "durations-cpu.json").read_text())
    burn, idle = cpu["test_burn.py::test_burn"], cpu["test_burn.py::test_idle"]
    assert burn > 0.5 and idle < 0.2 < burn, cpu
