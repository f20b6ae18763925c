"""No pause, no torn weights: requests hammering a replica while it swaps versions all succeed and
each names the version whose weights produced it (proved by recomputing its logged log-probs bit
for bit on that version); a replica SIGKILLed in the middle of applying a version restarts serving
its last verified version from the local cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from app.contracts.events import decode_routes, parse_event_bytes
from tests.integration.replica.conftest import (
    perturb,
    publish_deployment,
    read_topic,
    tiny_state,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_requests_during_a_swap_all_succeed_and_name_the_version_that_produced_them(
    registered, replica_factory
):
    settings, make = registered
    reg = make(anchor_every=8)
    _, s1 = tiny_state(0)
    s2 = perturb(s1, 5, frac=0.3)
    reg.add(s1)
    reg.add(s2)
    publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
    srv = replica_factory(settings, id="replica-swap")
    wait_for(lambda: httpx.get(f"{srv.url}/readyz").status_code == 200, what="ready on v1")

    responses, errors, stop = [], [], threading.Event()

    def hammer(worker: int) -> None:
        with httpx.Client(timeout=60) as http:
            i = 0
            while not stop.is_set():
                r = http.post(
                    f"{srv.url}/v1/complete",
                    json={
                        "session_id": f"w{worker}-{i}",
                        "prompt": "def f(x):",
                        "max_tokens": 6,
                        "n": 1 + i % 2,
                    },
                )
                (responses if r.status_code == 200 else errors).append(
                    r.json() if r.status_code == 200 else r.text
                )
                i += 1

    with ThreadPoolExecutor(4) as pool:
        for w in range(4):
            pool.submit(hammer, w)
        wait_for(lambda: len(responses) >= 8, what="requests on v1")
        publish_deployment(settings, "promoted", "2", traffic_pct=100.0)
        wait_for(
            lambda: sum(r["model_version"] == "2" for r in responses) >= 8,
            timeout_s=120,
            what="requests on v2",
        )
        stop.set()
    assert not errors, f"{len(errors)} requests failed during the swap, e.g. {errors[:2]}"
    versions = [r["model_version"] for r in responses]
    assert set(versions) == {"1", "2"}
    first_v2 = versions.index("2")
    assert versions[first_v2:].count("1") <= 4, (
        "after the swap only requests already in flight may finish on v1"
    )

    ids = {c["request_id"]: r["model_version"] for r in responses for c in r["completions"]}
    events = read_topic(settings, "interactions", len(ids), where=lambda e: e["request_id"] in ids)
    assert len(events) == len(ids)
    from policy import build_policy

    policies = {}
    for v, st in (("1", s1), ("2", s2)):
        policies[v] = build_policy(reg.config)
        policies[v].load_serving_state_dict(st)
    other_matches = 0
    for e in events:
        p = parse_event_bytes(json.dumps(e).encode())
        assert p.model_version == ids[p.request_id], "event and response name the same version"
        routes = decode_routes(p.routes, p.route_shape)
        logged = torch.tensor(p.logprobs, dtype=torch.float32).view(torch.int32)

        def recompute(v: str) -> torch.Tensor:
            with torch.no_grad():
                lp = policies[v].logprobs(
                    [p.prompt_tokens],
                    [p.completion_tokens],
                    routes=[routes],
                    temperature=p.temperature,
                )
            return lp[0, : len(p.completion_tokens)].contiguous().view(torch.int32)

        assert torch.equal(recompute(p.model_version), logged), (
            f"request {p.request_id} says v{p.model_version} but its log-probs are not that version's"
        )
        other_matches += torch.equal(recompute("2" if p.model_version == "1" else "1"), logged)
    assert other_matches < len(events) / 10, (
        "the two versions must be distinguishable by their log-probs"
    )


def _start_process(settings, cache_dir, port: int, pause_s: float) -> subprocess.Popen:
    env = dict(
        os.environ,
        FLYWHEEL_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        FLYWHEEL_TOPIC_NAMESPACE=settings.topic_namespace,
        FLYWHEEL_MLFLOW_URI=settings.mlflow_uri,
        FLYWHEEL_MODEL_NAME=settings.model_name,
        FLYWHEEL_DATA_DIR=str(settings.data_dir),
        FLYWHEEL_REPLICA_CACHE_DIR=str(cache_dir),
        FLYWHEEL_REPLICA_DEBUG_PAUSE_IN_APPLY=str(pause_s),
        FLYWHEEL_REPLICA_RETRY_INTERVAL="1",
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "replica",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--replica-id",
            "replica-kill",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _status(url: str) -> dict:
    try:
        return httpx.get(f"{url}/v1/status", timeout=2).json()
    except httpx.HTTPError:
        return {}


def _readyz(url: str):
    try:
        r = httpx.get(f"{url}/readyz", timeout=2)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def test_a_replica_killed_mid_apply_restarts_serving_its_last_verified_version(
    registered, tmp_path
):
    from tests.conftest import free_port

    settings, make = registered
    reg = make(anchor_every=8)
    _, s1 = tiny_state(0)
    reg.add(s1)
    reg.add(perturb(s1, 3))
    cache = tmp_path / "kill-cache"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = []
    try:
        publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
        procs.append(_start_process(settings, cache, port, pause_s=0))
        wait_for(
            lambda: (_readyz(url) or {}).get("champion") == "1", timeout_s=120, what="v1 served"
        )
        wait_for(lambda: (cache / "v1.json").exists(), what="v1 in the cache")
        os.killpg(procs[-1].pid, signal.SIGKILL)
        procs[-1].wait(10)

        procs.append(
            _start_process(settings, cache, port, pause_s=120)
        )  # every apply now stalls halfway
        publish_deployment(settings, "promoted", "2", traffic_pct=100.0)
        wait_for(
            lambda: (_status(url).get("syncing") or {}).get("version") == "2",
            timeout_s=120,
            what="v2 reconstructed, not yet swapped",
        )
        assert _status(url)["champion"] == "1", (
            "the old version serves while the new one is applied"
        )
        os.killpg(procs[-1].pid, signal.SIGKILL)  # killed in the middle of applying v2
        procs[-1].wait(10)
        assert not (cache / "v2.json").exists()

        procs.append(
            _start_process(settings, cache, port, pause_s=120)
        )  # restart: v2's apply stalls again
        ready = wait_for(lambda: _readyz(url), timeout_s=120, what="restarted replica ready")
        assert ready["champion"] == "1", (
            f"a restarted replica must serve its last verified version, got {ready}"
        )
        wait_for(
            lambda: (_status(url).get("syncing") or {}).get("version") == "2",
            timeout_s=120,
            what="v2 again",
        )
        r = httpx.post(
            f"{url}/v1/complete",
            json={"session_id": "s", "prompt": "x", "max_tokens": 3},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["model_version"] == "1", r.text
        os.killpg(procs[-1].pid, signal.SIGKILL)
        procs[-1].wait(10)

        procs.append(
            _start_process(settings, cache, port, pause_s=0)
        )  # and without the stall it completes v2
        wait_for(
            lambda: (_readyz(url) or {}).get("champion") == "2",
            timeout_s=120,
            what="v2 after restart",
        )
        wait_for(lambda: (cache / "v2.json").exists(), what="v2 cached")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
