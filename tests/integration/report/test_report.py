"""`flywheel report` on real data: a real MLflow server, the real broker and the real projections,
opened in a real headless Chromium (Debian's /usr/bin/chromium, `make chromium`).

The history is made by the code that makes it in production: the controller's pure state machine
(`app.controller.canary.transition`) turns registrations, gate verdicts (`GateResult.decision`,
tags from `GateResult.tags`) and observed canary windows into deployment events, which go to
`<ns>.deployments` through `DeploymentLog` and into the data dir's SQLite projection through
`projector.rebuild`, with the sessions of agent sessions' rollout records on `<ns>.rollouts` (the
sessions projection). MLflow holds versions tagged as the trainer tags them, a `flywheel-trainer`
run with per-step metrics and a `flywheel-heldout` run with acceptance per version. Nothing is
mocked. The data dir's `mlflow/` is the MLflow server's own store, read directly as SQLite.

    make chromium && .venv/bin/pytest tests/integration/report -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
CANARY = {"steps": (25.0, 50.0, 100.0), "min_step": 60.0, "min_samples": 20, "margin": 0.05}
GATE_CHECKS = (
    "weights_finite",
    "weight_change",
    "ope_reward",
    "kl_to_champion",
    "regression_prompts",
    "empty_completion_rate",
    "completion_length_shift",
    "tool_error_rate",
)
# version -> (kind, parent, held-out acceptance, CI or None); v5 is registered and not evaluated yet
VERSIONS = {
    "1": ("base", None, 0.356, (0.321, 0.391)),
    "2": ("trained", "1", 0.412, (0.380, 0.444)),
    "3": ("trained", "2", 0.298, None),
    "4": ("trained", "2", 0.377, (0.340, 0.414)),
    "5": ("trained", "2", None, None),
}


@dataclass
class History:
    settings: Settings  # noqa: F821
    data_dir: Path
    model: str
    events: list[dict]


def _arm(n: int, mean: float, sd: float):
    from app.controller.canary import ArmStats

    return ArmStats(n, n * mean, n * (mean * mean + sd * sd))


def _gate(version: str, parent: str | None, failing: dict[str, tuple[float, float, str]]):
    """A GateResult with every check, `failing` = {name: (value, threshold, detail)}; the rest pass."""
    from app.controller.gate import GateResult
    from app.controller.monitors import Check

    checks = [
        Check(n, "fail", *failing[n])
        if n in failing
        else Check(n, "pass", 0.01, 0.5, "within bounds")
        for n in GATE_CHECKS
    ]
    return GateResult(checks, {"snips": 0.41, "dr": 0.42, "ess": 48.0, "behaviour_value": 0.40})


def _make_history(settings, client, model: str, t0: datetime) -> list[dict]:
    """Drive the controller's state machine through the scenario; returns the events, oldest first."""
    from app.contracts.deployments import Decision
    from app.controller.canary import Event, Observe, transition
    from app.controller.state import DeploymentState
    from app.registry.operator import CanaryConfig

    cfg = CanaryConfig(**CANARY)
    state = DeploymentState(model=model)
    events: list[dict] = []
    clock = [t0]

    def at(minutes: float) -> datetime:
        clock[0] = t0 + timedelta(minutes=minutes)
        return clock[0]

    def feed(ev: dict) -> None:
        nonlocal state
        events.append(ev)
        state, out = transition(state, Event(ev), cfg)
        events.extend(out)

    def observe(
        minutes: float, cand: tuple[float, float], champ: tuple[float, float], n: int = 2000
    ) -> None:
        nonlocal state
        state, out = transition(state, Observe(at(minutes), _arm(n, *cand), _arm(n, *champ)), cfg)
        assert out, f"the canary of v{state.candidate} made no decision at {minutes} min"
        events.extend(out)

    def register(v: str, minutes: float) -> None:
        kind, parent, _, _ = VERSIONS[v]
        feed(
            Decision(
                type="version_registered",
                version=v,
                from_version=parent,
                source="trainer",
                actor="flywheel-trainer",
                reason=f"{kind} version: {100 * int(v)} rollouts",
                details={
                    "run_id": "r" * 32,
                    "rollouts_consumed": 100 * int(v),
                    "reward_spec": "v1",
                },
            ).to_event(model, at(minutes))
        )

    def gate(v: str, minutes: float, failing: dict | None = None) -> None:
        result = _gate(v, VERSIONS[v][1], failing or {})
        for key, value in result.tags().items():  # as the controller tags a gated version
            client.set_model_version_tag(model, v, key, value)
        feed(result.decision(v, VERSIONS[v][1]).to_event(model, at(minutes)))

    register("1", 0)
    gate("1", 1)  # no champion yet: promoted directly
    register("2", 4)
    gate("2", 5)  # canary at 25%
    observe(7, (0.60, 0.3), (0.50, 0.3))  # better -> 50%
    observe(9, (0.61, 0.3), (0.50, 0.3))  # better -> promoted
    register("3", 12)
    gate("3", 13, {"kl_to_champion": (0.731, 0.5, "mean per-token KL 0.731 > 0.5 nats")})
    register("4", 16)
    gate("4", 17)  # canary at 25%
    observe(19, (0.20, 0.3), (0.50, 0.3))  # worse -> rolled back to v2
    register("5", 22)
    return events


def _publish_sessions(settings) -> None:
    """Agent sessions' records on `<ns>.rollouts`: v1 served a (3 turns, success) and b's first
    segment; v2 b's second (4 turns in all, failure), c (one call, no outcome yet) and d (2
    turns, abandoned); a relabelled copy of a that must not count twice; v3 to v5 served none."""
    import json

    from app.infra.kafka import make_producer
    from tests.unit.deployments.rollout_records import kafka_key, one_call, segment

    a = segment("a", ["a0", "a1", "a2"], ["1"] * 3, [0.5, 0.0, 0.25], "success", 1.0)
    records = [
        a,
        {**a, "reward_spec": "hackable-tools", "relabel_run": "run-1", "reward": 2.0},
        segment("b", ["b0", "b1"], ["1", "1"], [0.0, 0.0], closed_by="version_tokenizer_changed"),
        segment("b", ["b2", "b3"], ["2", "2"], [0.0, 0.0], "failure", -1.0, at=60.0),
        one_call("c0", "c", version="2"),
        segment("d", ["d0", "d1"], ["2", "2"], [0.25, 0.0], "abandoned", 0.0),
    ]
    producer = make_producer(settings, profile="immediate")
    try:
        for rec in records:
            topic = settings.topic("rollouts")
            producer.send(topic, key=kafka_key(rec), value=json.dumps(rec).encode()).get(10)
    finally:
        producer.close()


@pytest.fixture()
def history(mlflow_server, make_settings, tmp_path: Path) -> History:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from app.contracts.deployments import DeploymentEvent, DeploymentLog
    from app.db.migrate import upgrade
    from app.projector.projector import rebuild

    model = f"report-policy-{uuid.uuid4().hex[:8]}"
    data_dir = tmp_path / "data"
    settings = make_settings(data_dir=data_dir, model_name=model)
    (data_dir / "mlflow").symlink_to(
        mlflow_server.root, target_is_directory=True
    )  # the server's own SQLite store
    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)

    def experiment(name: str) -> str:
        exp = client.get_experiment_by_name(name)
        return exp.experiment_id if exp else client.create_experiment(name)

    # the trainer's run: 120 optimizer steps, a version shipped every 30
    run = client.create_run(
        experiment("flywheel-trainer"), tags={"model_name": model, "mlflow.runName": "trainer-test"}
    )
    rid = run.info.run_id
    weights = tmp_path / "weights.txt"
    weights.write_text("serving weights")
    client.log_artifact(rid, str(weights), artifact_path="model")
    metrics = [
        Metric(k, v, 0, s)
        for s in range(1, 121)
        for k, v in (
            ("reward_mean", 0.2 + 0.002 * s),
            ("kl", 0.01 * (s % 30)),
            ("loss", 1.0 - 0.003 * s),
        )
    ]
    for i in range(0, len(metrics), 900):
        client.log_batch(rid, metrics=metrics[i : i + 900])
    client.create_registered_model(model)
    for v, (kind, parent, acc, _) in VERSIONS.items():
        tags = {
            "kind": kind,
            "parent_version": parent or "none",
            "trainer_step": str(30 * (int(v) - 1)),
            "reward_spec": "v1",
        }
        if acc is not None:
            tags["heldout_acceptance"] = f"{acc:.4f}"
        mv = client.create_model_version(
            model, f"{run.info.artifact_uri}/model", run_id=rid, tags=tags
        )
        assert mv.version == v, f"expected version {v} of a fresh model, got {mv.version}"
    client.set_terminated(rid)
    # the held-out evaluator's run: acceptance at step = version, a CI where the evaluator gave one
    held = client.create_run(
        experiment("flywheel-heldout"),
        tags={"model": model, "mlflow.runName": "heldout-acceptance"},
    )
    for v, (_, _, acc, ci) in VERSIONS.items():
        if acc is None:
            continue
        client.log_metric(held.info.run_id, "heldout_acceptance", acc, step=int(v))
        if ci is not None:
            client.log_metric(held.info.run_id, "heldout_acceptance_ci_low", ci[0], step=int(v))
            client.log_metric(held.info.run_id, "heldout_acceptance_ci_high", ci[1], step=int(v))

    events = _make_history(
        settings,
        client,
        model,
        datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1),
    )
    with DeploymentLog(settings) as dlog:
        for ev in events:
            dlog.publish(DeploymentEvent.model_validate(ev))
    _publish_sessions(settings)
    upgrade(settings.db_url)
    report = rebuild(settings)
    assert report.events_applied == len(events), f"projected {report} of {len(events)} events"
    assert report.rollouts_applied == 6, report
    return History(settings, data_dir, model, events)


def run_report(
    history: History | None, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    if history is not None:
        s = history.settings
        base.update(
            FLYWHEEL_DATA_DIR=str(history.data_dir),
            FLYWHEEL_MODEL_NAME=history.model,
            FLYWHEEL_KAFKA_BOOTSTRAP=s.kafka_bootstrap,
            FLYWHEEL_TOPIC_NAMESPACE=s.topic_namespace,
        )
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "report", *args],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def section(html: str, sid: str) -> str:
    m = re.search(rf'<section id="{sid}">(.*?)</section>', html, re.S)
    assert m, f"no section {sid!r} in the page"
    return m.group(1)


def rows(html: str, sid: str) -> dict[str, list[str]]:
    """version -> the cell texts of its row in section `sid` (tags stripped)."""
    out = {}
    for v, body in re.findall(r'<tr data-version="(\d+)">(.*?)</tr>', section(html, sid), re.S):
        out[v] = [
            re.sub(r"<[^>]+>", "", c).strip()
            for c in re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)
        ]
    return out


def canary_rows(html: str) -> list[list[str]]:
    body = section(html, "canary")
    return [
        [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
        for r in re.findall(r'<tr data-version="\d+">(.*?)</tr>', body, re.S)
    ]


def test_report_of_a_data_dir_shows_every_decision_and_renders_cleanly(
    history: History, tmp_path: Path
):
    from app.report.screenshot import render

    out = tmp_path / "report.html"
    done = run_report(history, "--out", str(out), "--markdown")
    assert done.returncode == 0, f"flywheel report failed ({done.returncode}):\n{done.stderr}"
    assert done.stdout.strip().splitlines()[-1] == str(out.resolve()), done.stdout
    html = out.read_text()

    # self-contained: nothing to fetch, no script
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I), (
        "the page references the network"
    )
    assert not re.search(r"<script|<link|@import|url\(", html, re.I), (
        "the page loads a script or an external resource"
    )
    assert html.count('src="data:image/svg+xml;base64,') == 4, "expected 4 inline figures"

    # versions: kind, parent, held-out with its CI when there is one, gate + failing check, canary, outcome
    versions = rows(html, "versions")
    assert sorted(versions, key=int) == ["1", "2", "3", "4", "5"], versions
    assert versions["1"][:6] == ["v1", "base", "—", "v1", "0.356 [0.321, 0.391]", "passed"], (
        versions["1"]
    )
    assert versions["2"][4:9] == [
        "0.412 [0.380, 0.444]",
        "passed",
        "—",
        "promoted",
        "champion promoted",
    ], versions["2"]
    assert versions["3"][4:9] == ["0.298", "failed", "kl_to_champion", "—", "—"], versions["3"]
    assert versions["4"][4:9] == [
        "0.377 [0.340, 0.414]",
        "passed",
        "—",
        "rolled back",
        "rolled back",
    ], versions["4"]
    assert versions["5"][1:9] == ["trained", "v2", "v1", "—", "—", "—", "—", "—"], versions["5"]
    # sessions served per version, from the sessions projection; blanks where a version served none
    assert versions["1"][9:] == ["2", "3.5", "50% · 50% · 0% (of 2)"], versions["1"]
    assert versions["2"][9:] == ["3", "2.3", "0% · 50% · 50% (of 2)"], versions["2"]
    assert all(versions[v][9:] == ["—"] * 3 for v in ("3", "4", "5")), versions
    markdown = {
        line.split(" | ")[0].strip("| "): [c.strip() for c in line.strip("|").split("|")]
        for line in done.stdout.splitlines()
        if re.match(r"\| \d+ \|", line)
    }
    assert markdown["1"][7:] == ["2", "3.5", "2", "50%", "50%", "0%"], markdown["1"]
    assert markdown["2"][7:] == ["3", "2.3", "2", "0%", "50%", "50%"], markdown["2"]
    assert markdown["5"][7:] == [""] * 6, "a version without sessions: blanks, not zeros"
    assert "4 sessions" in done.stderr, done.stderr  # the summary line (rich, on stderr)

    # the gate: v3 failed on exactly kl_to_champion, with its value and why
    gate = rows(html, "gate")
    assert gate["3"][:3] == ["v3", "failed", "kl_to_champion"], gate["3"]
    assert "fail 0.731" in gate["3"] and gate["3"].count("pass 0.01") == len(GATE_CHECKS) - 1, gate[
        "3"
    ]
    assert "v3: kl_to_champion: mean per-token KL 0.731 &gt; 0.5 nats" in section(html, "gate")
    assert all(gate[v][1] == "passed" for v in ("1", "2", "4")), gate

    # canary steps: v2 passed 25% and 50%, v4 was judged worse at 25%; bounds are the events' own
    judged = [
        e for e in history.events if isinstance((e.get("details") or {}).get("analysis"), dict)
    ]
    assert [(e["type"], e["version"], e["from_version"]) for e in judged] == [
        ("traffic_shifted", "2", "1"),
        ("promoted", "2", "1"),
        ("rolled_back", "2", "4"),
    ], judged
    steps = canary_rows(html)
    assert [r[:4] + r[7:8] for r in steps] == [
        ["v2", "0", "25%", "better_or_equal", "traffic shifted"],
        ["v2", "1", "50%", "better_or_equal", "promoted"],
        ["v4", "0", "25%", "worse", "rolled back"],
    ], steps
    for row, ev in zip(steps, judged):
        a = ev["details"]["analysis"]
        assert (
            row[4] == f"{a['delta']:+.4f}" and row[5] == f"[{a['lower']:+.4f}, {a['upper']:+.4f}]"
        ), (row, a)
        assert row[6] == f"{a['candidate']['n']} / {a['champion']['n']}"

    # promotions and rollbacks on the timeline
    timeline = section(html, "timeline")
    assert (
        "v1 promoted" in timeline
        and "v2 promoted over v1" in timeline
        and "v4 rolled back to v2" in timeline
    )
    assert 'class="empty"' not in html, (
        "a section says it has no data although every source has some"
    )
    assert "champion now</dt><dd>v2</dd>" in html

    # a real browser: no console error, nothing fetched, every figure laid out with a size
    shot = render(out, tmp_path / "report.png")
    assert shot.console_errors == [], shot.console_errors
    assert shot.requests == [], f"the page tried to fetch {shot.requests}"
    assert len(shot.images) == 4 and all(w > 200 and h > 100 for _, w, h in shot.images), (
        shot.images
    )
    assert shot.png.stat().st_size > 20_000 and shot.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot.png} ({shot.page_height:.0f}px tall)")


def test_report_of_a_running_stack_reads_mlflow_and_the_topic_or_the_api(
    history: History, mlflow_server, tmp_path: Path
):
    """The same history read three ways (data dir; MLflow server + topic; MLflow server + the API over
    real HTTP) gives the same rows."""
    from app.api.main import create_app
    from app.api.server import ServerThread
    from app.db.keys import create_key
    from app.db.session import session_scope

    by_dir = tmp_path / "dir.html"
    assert run_report(history, "--out", str(by_dir)).returncode == 0
    expected = by_dir.read_text()
    with session_scope(history.settings.db_url) as session:
        read_key, _ = create_key(session, ["read"], name="report-test")
    with ServerThread(create_app(history.settings)) as api:
        ways = {
            "kafka": (["--from-kafka"], f"topic {history.settings.topic('deployments')}"),
            "api": (["--api", api.url, "--api-key", read_key], f"{api.url}/v1/deployments/history"),
        }
        for way, (args, source) in ways.items():
            out = tmp_path / f"{way}.html"
            done = run_report(
                history,
                "--out",
                str(out),
                "--mlflow-uri",
                mlflow_server.uri,
                "--data-dir",
                str(tmp_path / "nowhere"),
                *args,
            )
            assert done.returncode == 0, (way, done.stderr)
            page = out.read_text()
            assert source in page and mlflow_server.uri in page, way
            assert rows(page, "gate") == rows(expected, "gate"), way
            # the sessions projection is the app database's: not there for this data dir
            got, want = rows(page, "versions"), rows(expected, "versions")
            assert {v: r[:9] for v, r in got.items()} == {v: r[:9] for v, r in want.items()}, way
            assert all(r[9:] == ["—"] * 3 for r in got.values()) and want["1"][9] == "2", way
            assert "not read: no app database" in page, way
            assert canary_rows(page) == canary_rows(expected), way
            assert (
                section(page, "timeline").count("<li")
                == section(expected, "timeline").count("<li")
                == 3
            ), way
        refused = run_report(
            history,
            "--mlflow-uri",
            mlflow_server.uri,
            "--api",
            api.url,
            "--api-key",
            "fw_00000000_" + "A" * 43,
        )
        assert refused.returncode == 2 and "refused the key" in refused.stderr, refused.stderr


def test_missing_sources_are_named_with_exit_2(mlflow_server, tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--data-dir", str(empty)], str((empty / "mlflow" / "mlflow.db").resolve())),
        (
            ["--data-dir", str(empty), "--mlflow-uri", mlflow_server.uri],
            str((empty / "flywheel.db").resolve()),
        ),
        (
            ["--data-dir", str(empty), "--mlflow-uri", "http://127.0.0.1:9"],
            "MLflow server at http://127.0.0.1:9",
        ),
    ]
    for args, named in cases:
        done = run_report(None, *args)
        assert done.returncode == 2, (args, done.returncode, done.stderr)
        assert named in " ".join(done.stderr.split()), (args, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
    assert not (empty / "flywheel.db").exists() and not (empty / "mlflow").exists(), (
        "a missing source was created"
    )


def test_a_stack_without_data_gets_a_page_that_says_so_per_section(tmp_path: Path):
    from mlflow import MlflowClient

    from app.db.migrate import upgrade

    data_dir = tmp_path / "fresh"
    (data_dir / "mlflow").mkdir(parents=True)
    store = f"sqlite:///{data_dir / 'mlflow' / 'mlflow.db'}"
    MlflowClient(
        tracking_uri=store
    ).search_experiments()  # creates the empty store, as a first `flywheel run` does
    upgrade(f"sqlite:///{data_dir / 'flywheel.db'}")
    done = run_report(None, "--data-dir", str(data_dir))
    assert done.returncode == 0, done.stderr
    html = (data_dir / "report.html").read_text()
    for sid, says in (
        ("heldout", "No held-out results yet"),
        ("training", "No training metrics yet"),
        ("gate", "No gate decisions yet"),
        ("canary", "No canary steps yet"),
        ("timeline", "No deployment events yet"),
        ("versions", "No versions yet"),
    ):
        assert says in section(html, sid), sid
    assert "<img" not in html
