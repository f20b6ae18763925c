"""Operator verbs over HTTP on the real broker: scopes, state checks, events with actor and reason."""

from __future__ import annotations

import httpx
import pytest

from app.contracts.deployments import Decision
from tests.integration.controller.conftest import deployment_events

pytestmark = pytest.mark.integration


@pytest.fixture()
def admin_api(make_settings, api_server):
    from app.contracts.deployments import DeploymentEvent, DeploymentLog
    from app.db.keys import create_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    settings = make_settings(model_name="fw-admin-test")
    upgrade(settings.db_url)
    with session_scope(settings.db_url) as s:
        admin, _ = create_key(s, ["admin"], name="alice")
        reader, _ = create_key(s, ["read"], name="bob")
    with DeploymentLog(settings) as dlog:  # history: 1 then 2 were champions; 3 is in canary
        for d in (
            Decision(type="promoted", version="1"),
            Decision(type="promoted", version="2", from_version="1"),
            Decision(
                type="canary_started",
                version="3",
                from_version="2",
                traffic_pct=5.0,
                details={"step": 0},
            ),
        ):
            dlog.publish(DeploymentEvent.model_validate(d.to_event(settings.model_name)))
    api = api_server(settings)
    return settings, api.url, admin, reader


def post(url, verb, key, **body):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/deployments/{verb}", json=body, headers=headers, timeout=60)


def test_verbs_need_an_admin_key(admin_api):
    settings, url, admin, reader = admin_api
    assert post(url, "pause", None).status_code == 401
    assert post(url, "pause", reader).status_code == 403
    assert post(url, "pause", admin, bogus=1).status_code == 422, "unknown fields are rejected"


def test_pause_resume_promote_rollback_become_events_with_actor_and_reason(admin_api):
    settings, url, admin, _ = admin_api
    r = post(url, "pause", admin, reason="looking into latency")
    assert r.status_code == 202, r.text
    [ev] = r.json()["events"]
    assert (ev["type"], ev["version"], ev["source"], ev["actor"], ev["reason"]) == (
        "canary_paused",
        "3",
        "api",
        "alice",
        "looking into latency",
    )
    assert post(url, "pause", admin).status_code == 409, "already paused"
    assert post(url, "resume", admin, reason="fine").json()["events"][0]["type"] == "canary_resumed"

    r = post(url, "rollback", admin, version="9", reason="typo")
    assert r.status_code == 422 and "known-good" in r.json()["detail"]
    r = post(url, "rollback", admin, version="1", reason="2 is bad too")
    assert r.status_code == 202
    assert [(e["type"], e["version"], e["from_version"]) for e in r.json()["events"]] == [
        ("aborted", "3", "3"),
        ("rolled_back", "1", "2"),
    ]
    r = post(url, "promote", admin, skip_remaining=True)
    assert r.status_code == 409 and "no canary" in r.json()["detail"]

    on_topic = [(e["type"], e["source"], e["actor"]) for e in deployment_events(settings)][3:]
    assert on_topic == [
        ("canary_paused", "api", "alice"),
        ("canary_resumed", "api", "alice"),
        ("aborted", "api", "alice"),
        ("rolled_back", "api", "alice"),
    ]


def test_promote_advances_one_step_or_skips_the_rest(admin_api):
    settings, url, admin, _ = admin_api
    r = post(url, "promote", admin, reason="metrics look fine")
    assert [(e["type"], e["traffic_pct"]) for e in r.json()["events"]] == [
        ("traffic_shifted", 25.0)
    ]
    r = post(url, "promote", admin, skip_remaining=True)
    assert [(e["type"], e["version"]) for e in r.json()["events"]] == [("promoted", "3")]
