"""The TypeScript feedback client (clients/typescript) against the real API and Kafka broker.

Runs `npm test` in the package (its build, a type-check of the tests, then `node --test`:
unit tests with a scripted fetch, and test/integration.test.ts against what this driver
serves): two real ingest APIs (uvicorn, in this process) on a Kafka broker of the test's own,
one with the default limits and one with small body and event limits (for the oversized-batch
test), and a small HTTP control plane the Node tests call:

    POST /broker/stop, POST /broker/start   stop and restart that broker (same storage and ports)
    GET  /interactions?api=main|small       every record of that API's interactions topic,
                                            [{"key": str, "value_b64": str}] (the raw value bytes)

The broker is the test's own because one Node test stops it (the session broker stays up).
Node packages come from `make node` (`npm ci` from the committed lockfile); without them the
test fails and says so.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from app.infra.broker import LocalKafka
from tests.conftest import REPO, free_port
from tests.integration.api.conftest import Api, api_factory, read_interactions  # noqa: F401

pytestmark = pytest.mark.integration

PACKAGE = REPO / "clients" / "typescript"
SMALL_MAX_EVENT_BYTES = 1024  # the smallest the settings allow
SMALL_MAX_BODY_BYTES = 4096
NPM_TEST_TIMEOUT_S = 900
SUMMARY = re.compile(r"^# (tests|pass|fail|cancelled|skipped|todo) (\d+)$", re.MULTILINE)


@pytest.fixture()
def own_broker(tmp_path_factory) -> Iterator[LocalKafka]:
    broker = LocalKafka(
        home=tmp_path_factory.mktemp("ts-client-kafka"),
        port=free_port(),
        controller_port=free_port(),
        heap="384m",
    )
    broker.start(timeout=180)
    yield broker
    pid = broker.pid()
    if pid is not None:
        os.kill(pid, signal.SIGCONT)
    broker.stop()


class ControlPlane:
    """The HTTP control plane of the Node tests (see the module docstring), on a free port."""

    def __init__(self, apis: dict[str, Api], broker: LocalKafka):
        self.apis, self.broker = apis, broker
        self.lock = threading.Lock()  # one broker operation or topic read at a time
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self._answer(plane.post)

            def do_GET(self) -> None:
                self._answer(plane.get)

            def _answer(self, handle: Any) -> None:
                url = urlparse(self.path)
                try:
                    status, body = handle(url.path, parse_qs(url.query))
                except Exception as exc:  # surfaced to the Node test, which fails with it
                    status, body = 500, {"error": f"{type(exc).__name__}: {exc}"}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def post(self, path: str, _query: dict[str, list[str]]) -> tuple[int, Any]:
        with self.lock:
            if path == "/broker/stop":
                return 200, {"stopped": self.broker.stop()}
            if path == "/broker/start":
                self.broker.start(timeout=180)  # same storage and ports
                return 200, {"started": True}
        return 404, {"error": f"no POST {path}"}

    def get(self, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        if path != "/interactions":
            return 404, {"error": f"no GET {path}"}
        name = query.get("api", ["main"])[0]
        if name not in self.apis:
            return 404, {"error": f"no api {name!r}; one of {sorted(self.apis)}"}
        with self.lock:
            records = read_interactions(self.apis[name].settings, timeout_s=60)
        return 200, [
            {"key": key, "value_b64": base64.b64encode(value).decode()} for key, value in records
        ]

    def __enter__(self) -> ControlPlane:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def test_typescript_client_against_the_real_api_and_broker(api_factory, own_broker):
    """The TypeScript client's own tests (`npm test` in clients/typescript) against two real
    APIs on this test's own broker, which the test stops and starts under them. Needs about a
    minute: a broker of its own, two APIs, and node compiling and running the client's tests."""
    if not (PACKAGE / "node_modules" / "typescript").is_dir():
        pytest.fail(
            f"{PACKAGE / 'node_modules'} is missing: run `make node` "
            "(npm ci in clients/typescript from its package-lock.json)"
        )
    npm = shutil.which("npm")
    assert npm is not None, "npm is not on PATH: install Node >= 20 with npm"
    main = api_factory(kafka_bootstrap=own_broker.bootstrap, kafka_produce_timeout=2.0)
    small = api_factory(
        kafka_bootstrap=own_broker.bootstrap,
        max_event_bytes=SMALL_MAX_EVENT_BYTES,
        max_body_bytes=SMALL_MAX_BODY_BYTES,
    )
    with ControlPlane({"main": main, "small": small}, own_broker) as plane:
        env = {
            **os.environ,
            "FLYWHEEL_TEST_API_URL": main.url,
            "FLYWHEEL_TEST_API_KEY": main.ingest_key,
            "FLYWHEEL_TEST_SMALL_API_URL": small.url,
            "FLYWHEEL_TEST_SMALL_API_KEY": small.ingest_key,
            "FLYWHEEL_TEST_SMALL_MAX_EVENT_BYTES": str(SMALL_MAX_EVENT_BYTES),
            "FLYWHEEL_TEST_CONTROL_URL": plane.url,
        }
        proc = subprocess.run(
            [npm, "test", "--silent"],
            cwd=PACKAGE,
            env=env,
            capture_output=True,
            text=True,
            timeout=NPM_TEST_TIMEOUT_S,
        )
    output = proc.stdout + proc.stderr
    print(output)  # the Node test report (shown with -s or on failure)
    assert proc.returncode == 0, f"npm test failed (exit {proc.returncode}):\n{output[-20000:]}"
    counts = dict(SUMMARY.findall(proc.stdout))  # node --test's TAP summary: "# pass 23"
    assert counts.get("fail") == "0" and int(counts.get("pass", "0")) > 0, counts
    assert counts.get("skipped") == "0" and counts.get("todo") == "0", counts
    assert counts.get("cancelled") == "0", counts
