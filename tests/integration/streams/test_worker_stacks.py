"""`kill -USR2` on a running streams worker writes its asyncio tasks' and threads' stacks to its
stderr and the worker goes on (mode's Worker would stop in pdb). A stalled broker test's failure
shows these stacks and the worker's metrics (conftest.py `read_until`), so they must work on a
worker past start-up."""

from __future__ import annotations

from tests.integration.streams.conftest import broker_timed_settings, wait_for_assignment


def test_sigusr2_dumps_tasks_and_threads_and_the_worker_goes_on(make_settings, start_worker):
    worker = start_worker(broker_timed_settings(make_settings))
    wait_for_assignment(worker, [worker])  # past start-up: mode's Worker has its handlers
    assert worker.proc.poll() is None, worker.tail()
    dump = worker.stacks()
    assert "--- asyncio <Task" in dump, dump  # the agents' awaits
    assert "Current thread" in dump and "in <module>" in dump, dump  # every thread, main last
    assert "(Pdb)" not in dump and "BdbQuit" not in dump, dump  # mode's handler: pdb
    assert worker.proc.poll() is None, worker.tail()
    assert "flywheel_streams_" in worker.metrics()  # the other half of a stall's report
    again = worker.stacks()  # a second dump: the handler stays
    assert "Current thread" in again, again
