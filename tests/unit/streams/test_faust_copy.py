"""The copy of Faust's fetch loop in streams/consumer.py stays a copy of the installed Faust.

`EagerDrainConsumer._drain_messages` is Faust's `Consumer._drain_messages` with one change (the
delivery is stepped synchronously). The copy relies on the original's body: the private
attributes it reads (`_read_offset`, `_n_acked`, `_commit_every`, `suspend_flow`, `diag`), the
gap and commit handling, and the shutdown branches. When Faust changes that function, the copy
must be compared with the new source by hand; this test makes such an upgrade fail loudly.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect

import pytest
from faust.transport.consumer import Consumer

from streams import consumer

RECHECK = (
    "streams/consumer.py copies Faust's {function} as of faust-streaming {copied_version}; the "
    "installed faust-streaming {installed_version} has a different source for it (SHA-256 "
    "{installed} instead of {recorded}). Diff the installed function against "
    "EagerDrainConsumer._drain_messages in streams/consumer.py: carry every change of Faust's "
    "loop (offset and gap handling, commit_every, the shutdown and error branches, the private "
    "attributes it reads) into the copy, keeping only the marked `changed:` lines different; "
    "check that Faust still hands each record to `self.callback` under "
    "`wait_first(..., self.suspend_flow.wait())`; then run tests/unit/streams/test_consumer.py "
    "and the streams integration tests, and record the new version and hash in "
    "FAUST_COPIED_VERSION and FAUST_COPIED_SOURCE_SHA256."
)


def source_sha256(source: str) -> str:
    """SHA-256 (hex) of a function's source text as `inspect.getsource` returns it."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def copy_mismatch(source: str, recorded: str, installed_version: str) -> str | None:
    """None when `source` hashes to `recorded`, else the message that says what to re-check."""
    installed = source_sha256(source)
    if installed == recorded:
        return None
    return RECHECK.format(
        function=consumer.FAUST_COPIED_FUNCTION,
        copied_version=consumer.FAUST_COPIED_VERSION,
        installed_version=installed_version,
        installed=installed,
        recorded=recorded,
    )


def installed_source() -> str:
    return inspect.getsource(Consumer._drain_messages)


def test_the_copied_function_is_the_installed_one() -> None:
    module, _, qualname = consumer.FAUST_COPIED_FUNCTION.rpartition(".Consumer.")
    assert module == Consumer.__module__, "FAUST_COPIED_FUNCTION names another module"
    assert qualname == "_drain_messages"
    assert consumer.EagerDrainConsumer._drain_messages is not Consumer._drain_messages


def test_installed_faust_source_matches_the_copied_one() -> None:
    mismatch = copy_mismatch(
        installed_source(),
        consumer.FAUST_COPIED_SOURCE_SHA256,
        importlib.metadata.version("faust-streaming"),
    )
    if mismatch is not None:
        pytest.fail(mismatch)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.replace("yield_every = 100", "yield_every = 1000"),
        lambda s: s + "\n",
        lambda s: s.replace("await self.commit()", "pass"),
    ],
    ids=["constant", "trailing-newline", "statement"],
)
def test_a_changed_source_is_reported_with_what_to_recheck(edit) -> None:
    source = installed_source()
    changed = edit(source)
    assert changed != source
    message = copy_mismatch(changed, source_sha256(source), "9.9.9")
    assert message is not None
    assert "streams/consumer.py" in message
    assert "9.9.9" in message and consumer.FAUST_COPIED_VERSION in message
    assert source_sha256(changed) in message
    assert "FAUST_COPIED_SOURCE_SHA256" in message


def test_the_unchanged_source_is_not_reported() -> None:
    source = installed_source()
    assert copy_mismatch(source, source_sha256(source), "9.9.9") is None
