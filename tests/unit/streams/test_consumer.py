"""streams/consumer.py: a coroutine stepped synchronously and finished by `finish_stepped`
behaves like the same coroutine run as an asyncio task (results, exceptions, cancellation)."""

from __future__ import annotations

import asyncio

import pytest

from streams.consumer import _PENDING, EagerDrainTransport, finish_stepped, install, step


async def _run_eager(coro):
    result, yielded = step(coro)
    if yielded is _PENDING:
        return result
    return await finish_stepped(coro, yielded)


def test_a_coroutine_that_never_suspends_finishes_in_the_first_step_without_the_loop():
    log = []

    async def deliver(x):
        log.append(x)
        return x * 2

    coro = deliver(21)
    result, yielded = step(coro)
    assert (result, yielded, log) == (42, _PENDING, [21])


def test_exceptions_raised_before_any_suspension_propagate_from_the_step():
    async def bad():
        raise ValueError("bad record")

    with pytest.raises(ValueError, match="bad record"):
        step(bad())


def test_a_suspended_coroutine_finishes_with_the_result_it_would_have_as_a_task():
    async def main():
        fut = asyncio.get_running_loop().create_future()
        order = []

        async def deliver():
            order.append("start")
            await asyncio.sleep(0)  # bare yield
            order.append("after yield")
            value = await fut  # a future resolved later
            order.append(f"got {value}")
            await asyncio.sleep(0.01)  # a timer future
            return value + 1

        coro = deliver()
        result, yielded = step(coro)
        assert result is _PENDING and order == ["start"]
        task = asyncio.ensure_future(finish_stepped(coro, yielded))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert order == ["start", "after yield"]
        fut.set_result(41)
        assert await task == 42
        assert order == ["start", "after yield", "got 41"]

    asyncio.run(main())


def test_an_awaited_future_s_exception_is_raised_inside_the_coroutine_where_it_can_be_handled():
    async def main():
        fut = asyncio.get_running_loop().create_future()

        async def deliver():
            try:
                await fut
            except KeyError as e:
                return f"handled {e.args[0]}"
            return "no error"

        coro = deliver()
        _, yielded = step(coro)
        task = asyncio.ensure_future(finish_stepped(coro, yielded))
        fut.set_exception(KeyError("k"))
        assert await task == "handled k"

        fut2 = asyncio.get_running_loop().create_future()

        async def unhandled():
            await fut2

        coro = unhandled()
        _, yielded = step(coro)
        task = asyncio.ensure_future(finish_stepped(coro, yielded))
        fut2.set_exception(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            await task

    asyncio.run(main())


@pytest.mark.parametrize("future_done_first", [False, True])
def test_cancelling_the_finishing_task_cancels_the_coroutine_like_a_task(future_done_first):
    """What wait_first does when the flow is suspended: cancel the delivery. Its cleanup runs and
    it ends cancelled, also when the awaited future completed just before the cancel."""

    async def main():
        fut = asyncio.get_running_loop().create_future()
        cleaned = []

        async def deliver():
            try:
                await fut
                await asyncio.sleep(10)
            finally:
                cleaned.append(True)

        coro = deliver()
        _, yielded = step(coro)
        task = asyncio.ensure_future(finish_stepped(coro, yielded))
        await asyncio.sleep(0)  # the task now waits on fut
        if future_done_first:
            fut.set_result(None)  # done, but the task has not run its next step yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == [True]
        assert fut.done()

    asyncio.run(main())


def test_eager_and_task_runs_of_the_same_coroutines_agree():
    """The same mixes of sync/async steps, results and errors, run both ways."""

    def make(kind):
        async def c():
            if kind == "sync":
                return "s"
            if kind == "yield":
                await asyncio.sleep(0)
                return "y"
            if kind == "timer":
                await asyncio.sleep(0.001)
                return "t"
            if kind == "error-after-yield":
                await asyncio.sleep(0)
                raise LookupError("late")
            raise LookupError("early")

        return c()

    async def outcome(runner, kind):
        try:
            return ("ok", await runner(make(kind)))
        except LookupError as e:
            return ("err", str(e))

    async def main():
        kinds = ["sync", "yield", "timer", "error-after-yield", "error"]
        as_task = [await outcome(lambda c: asyncio.ensure_future(c), k) for k in kinds]
        eager = [await outcome(_run_eager, k) for k in kinds]
        assert eager == as_task, (eager, as_task)

    asyncio.run(main())


def test_install_swaps_the_transport_before_first_use_and_refuses_afterwards():
    import faust

    app = faust.App("t-eager-drain", broker="kafka://127.0.0.1:1", web_enabled=False)
    install(app)
    assert isinstance(app.transport, EagerDrainTransport)
    assert app.transport.Consumer.__name__ == "EagerDrainConsumer"
    late = faust.App("t-eager-drain-late", broker="kafka://127.0.0.1:1", web_enabled=False)
    late.transport  # noqa: B018 - created by first use
    with pytest.raises(AssertionError, match="before the app creates its transport"):
        install(late)
