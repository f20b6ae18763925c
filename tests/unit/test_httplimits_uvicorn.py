"""app/httplimits.py is written against one uvicorn: its protocol subclasses uvicorn's private
`HttpToolsProtocol`, copies its `data_received` and calls its private helpers. Another uvicorn
fails here with what to do, instead of failing somewhere in the HTTP limits' behaviour."""

from __future__ import annotations

import hashlib
import inspect
from importlib.metadata import version

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app import httplimits

# what GuardedHttpToolsProtocol uses of uvicorn's protocol beyond its public callbacks
PRIVATE = (
    "_unset_keepalive_if_required",
    "_should_upgrade",
    "_unsupported_upgrade_warning",
    "handle_websocket_upgrade",
    "send_400_response",
)

PORT = (
    "app/httplimits.py subclasses uvicorn's private HttpToolsProtocol and copies its "
    "data_received; it was written against uvicorn {want}. Diff "
    "uvicorn/protocols/http/httptools_impl.py between {want} and {got}, port the changes into "
    "GuardedHttpToolsProtocol, run tests/integration/api and tests/integration/replica, then "
    "update UVICORN_VERSION (and UVICORN_DATA_RECEIVED_SHA256) there and the pin in pyproject.toml"
)


def test_the_installed_uvicorn_is_the_one_httplimits_is_written_against():
    got = version("uvicorn")
    assert got == httplimits.UVICORN_VERSION, PORT.format(want=httplimits.UVICORN_VERSION, got=got)


def test_the_copied_data_received_is_still_uvicorns_and_its_helpers_exist():
    source = inspect.getsource(HttpToolsProtocol.data_received)
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest == httplimits.UVICORN_DATA_RECEIVED_SHA256, (
        PORT.format(want=httplimits.UVICORN_VERSION, got=version("uvicorn"))
        + f"; uvicorn's data_received now reads:\n{source}"
    )
    missing = [name for name in PRIVATE if not callable(getattr(HttpToolsProtocol, name, None))]
    assert not missing, f"uvicorn's HttpToolsProtocol has no {missing}: " + PORT.format(
        want=httplimits.UVICORN_VERSION, got=version("uvicorn")
    )
