"""MLflow as a control surface, on the real MLflow server and the real Kafka broker.

An alias moved with MlflowClient (what the MLflow UI does) reaches the receiver as a signed
webhook and becomes an `alias_changed` event; Flywheel's own moves do not; forged, stale and
replayed deliveries are rejected or ignored; with no webhook the poller alone carries the move.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from prometheus_client import REGISTRY

from app.contracts.aliases import read_snapshot, sync_aliases
from app.controller.reconciler import Reconciler
from app.registry.webhooks import ensure_webhook, sign
from tests.conftest import MlflowServer, free_port
from tests.integration.controller.conftest import deployment_events, wait_for

pytestmark = pytest.mark.integration
SECRET = "test-webhook-secret"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A private MLflow server for this module (overrides the session one): MLflow's webhooks are
    server-wide and its delivery pool is shared, so deliveries queued for other tests' receivers
    (dead or slow by now) must not delay the ones these tests wait for."""
    root = tmp_path_factory.mktemp("mlflow-webhooks")
    server = MlflowServer(root, free_port(), {"MLFLOW_WEBHOOK_CACHE_TTL": "1"})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def mlflow_log_tail(server, n: int = 40) -> str:
    lines = (server.root / "mlflow.log").read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if "webhook" in line.lower() or "Error" in line)[
        -4000:
    ] or "\n".join(lines[-n:])


def alias_events(settings, alias=None):
    return [
        e
        for e in deployment_events(settings)
        if e["type"] == "alias_changed" and (alias is None or e["details"]["alias"] == alias)
    ]


def deliveries(outcome: str) -> float:
    return (
        REGISTRY.get_sample_value("flywheel_webhook_deliveries_total", {"outcome": outcome}) or 0.0
    )


def test_alias_move_in_mlflow_arrives_by_signed_webhook_and_is_recorded(
    registry, make_settings, api_server, mlflow_server
):
    client, model = registry.client, registry.model
    settings = make_settings(
        model_name=model, webhook_secret=SECRET, mlflow_uri=client.tracking_uri
    )
    sync_aliases(
        client, model, {"champion": "1"}
    )  # what the controller does: acknowledged, no event
    api = api_server(settings)
    # MLflow webhooks are server-wide: receivers left by earlier tests on this session's server
    # are dead, and deliveries to them (with retries) queue ahead of this one
    for w in client.list_webhooks(max_results=100):
        client.delete_webhook(w.webhook_id)
    hook_id = ensure_webhook(client, model, f"{api.url}/v1/hooks/mlflow", SECRET)
    # the server caches "which webhooks listen to alias events" for MLFLOW_WEBHOOK_CACHE_TTL (1 s here):
    # the sync_aliases above cached "none", so a move inside that second would go to nobody (in
    # production the poller carries such a move; this test is about the webhook path)
    time.sleep(2.5)
    try:
        t0 = time.monotonic()
        client.set_registered_model_alias(model, "champion", "2")  # the UI's move
        try:
            [ev] = wait_for(lambda: alias_events(settings), 120, "alias_changed from the webhook")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; deliveries by outcome: "
                f"{ {o: deliveries(o) for o in ('applied', 'no_change', 'rejected', 'duplicate', 'ignored', 'error')} }; "
                f"MLflow server log:\n{mlflow_log_tail(mlflow_server)}"
            ) from None
        took = time.monotonic() - t0
        assert (ev["version"], ev["from_version"], ev["source"], ev["actor"]) == (
            "2",
            "1",
            "mlflow-ui",
            "mlflow-ui",
        )
        assert ev["details"]["alias"] == "champion" and ev["details"]["observed_via"] == "webhook"
        assert ev["details"]["delivery_id"] and "champion" in ev["reason"]
        wait_for(
            lambda: read_snapshot(client, model).acked["champion"] == "2",
            10,
            "the move to be acknowledged",
        )
        print(f"webhook: alias move -> alias_changed on the topic in {took:.2f}s")

        # Flywheel's own move (tag first, then alias): the webhook comes and is recognised as ours
        before = deliveries("no_change")
        sync_aliases(client, model, {"candidate": "3"})
        wait_for(lambda: deliveries("no_change") > before, 30, "the webhook of our own move")
        assert alias_events(settings, "candidate") == [], (
            "a Flywheel move is not reported as a UI move"
        )

        # removing an alias in the UI is a move too (MLflow's delete payload has no version)
        client.delete_registered_model_alias(model, "candidate")
        [rm] = wait_for(lambda: alias_events(settings, "candidate"), 30, "candidate removal")
        assert (rm["version"], rm["from_version"]) == (None, "3")
    finally:
        client.delete_webhook(hook_id)


def test_forged_stale_and_replayed_deliveries(registry, make_settings, api_server):
    client, model = registry.client, registry.model
    settings = make_settings(
        model_name=model, webhook_secret=SECRET, mlflow_uri=client.tracking_uri
    )
    api = api_server(settings)
    url = f"{api.url}/v1/hooks/mlflow"
    body = json.dumps(
        {
            "entity": "model_version_alias",
            "action": "created",
            "timestamp": "x",
            "data": {"name": model, "alias": "champion", "version": "1"},
        }
    ).encode()

    def post(secret, delivery_id, ts, payload=body):
        headers = {
            "Content-Type": "application/json",
            "X-MLflow-Delivery-Id": delivery_id,
            "X-MLflow-Timestamp": ts,
            "X-MLflow-Signature": sign(secret, delivery_id, ts, payload),
        }
        return httpx.post(url, content=payload, headers=headers, timeout=30)

    now = str(int(time.time()))
    assert post("wrong-secret", str(uuid.uuid4()), now).status_code == 401
    tampered = sign(SECRET, "d1", now, body)
    r = httpx.post(
        url,
        content=body.replace(b'"1"', b'"2"'),
        timeout=30,
        headers={
            "X-MLflow-Delivery-Id": "d1",
            "X-MLflow-Timestamp": now,
            "X-MLflow-Signature": tampered,
        },
    )
    assert r.status_code == 401, "a modified body fails the signature"
    assert httpx.post(url, content=body, timeout=30).status_code == 401, "unsigned"
    assert post(SECRET, str(uuid.uuid4()), str(int(time.time()) - 3600)).status_code == 401, (
        "outside the replay window"
    )

    client.set_registered_model_alias(model, "champion", "1")  # a real move to find
    did = str(uuid.uuid4())
    first = post(SECRET, did, now)
    assert (
        first.status_code == 200
        and first.json()["status"] == "ok"
        and len(first.json()["events"]) == 1
    )
    second = post(SECRET, did, now)
    assert second.status_code == 200 and second.json()["status"] == "duplicate"
    assert len(alias_events(settings)) == 1, "the replayed delivery published nothing"
    other = json.dumps(
        {
            "entity": "model_version_alias",
            "action": "created",
            "timestamp": "x",
            "data": {"name": "someone-elses-model", "alias": "champion", "version": "1"},
        }
    ).encode()
    assert post(SECRET, str(uuid.uuid4()), now, other).json()["status"] == "ignored"


def test_reconciler_alone_carries_the_move_within_its_poll_interval(registry, make_settings):
    from app.api.routes.hooks import publish_dict
    from app.contracts.deployments import DeploymentLog

    client, model = registry.client, registry.model
    settings = make_settings(model_name=model)
    sync_aliases(client, model, {"champion": "1", "candidate": "2"})
    interval = 1.0
    with DeploymentLog(settings) as dlog:
        rec = Reconciler(
            client, model, lambda ev: publish_dict(dlog, ev), interval_s=interval
        ).start()
        try:
            time.sleep(interval * 1.5)
            assert alias_events(settings) == [], "nothing moved, nothing reported"
            t0 = time.monotonic()
            client.set_registered_model_alias(model, "champion", "3")
            [ev] = wait_for(
                lambda: alias_events(settings),
                interval + 10,
                "alias_changed from the poller",
                every=0.1,
            )
            took = time.monotonic() - t0
        finally:
            rec.stop()
    assert (ev["version"], ev["from_version"], ev["details"]["observed_via"]) == ("3", "1", "poll")
    assert took <= interval + 10
    print(f"poller: alias move -> alias_changed on the topic in {took:.2f}s (interval {interval}s)")
