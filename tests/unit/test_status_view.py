"""The status view of `flywheel run` (app/status_view.py) against a real HTTP server.

One small `ThreadingHTTPServer` in a thread stands in for the three sources the view reads, to
keep the test fast (no stack): the status API (`GET /v1/deployments`, `/v1/deployments/history`,
with the read key), the trainer's Prometheus `/metrics` (the pretraining gauges, written by
prometheus_client itself) and MLflow's `GET /api/2.0/mlflow/model-versions/search` (the
`heldout_acceptance` tags of the simulator's evaluator). Each `/metrics` read advances the
pretraining by 75 of its 600 steps; once it is done the status API answers with a champion, a
canary, held-out results and decisions. The supervisor is a minimal object with `roles` and
`poll()`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from rich.console import Console

from app.status_view import Snapshot, StatusView, parse_pretraining, trainer_metrics_url

KEY = "read-key"
MODEL = "flywheel-policy"
STEPS, PER_READ = 600, 75


@dataclass
class Fake:
    """The sources' state: pretraining advances per /metrics read; then the loop has versions."""

    step: int = 0
    metrics_reads: int = 0
    unauthorized: int = 0
    mlflow_filters: list[str] = field(default_factory=list)

    @property
    def pretrained(self) -> bool:
        return self.step >= STEPS

    def metrics(self) -> bytes:
        self.metrics_reads += 1
        registry = CollectorRegistry()
        Gauge("flywheel_trainer_pretrain_steps", "total", registry=registry).set(STEPS)
        Gauge("flywheel_trainer_pretrain_step", "done", registry=registry).set(self.step)
        Gauge("flywheel_trainer_pretrain_loss", "loss", registry=registry).set(
            5.0 - self.step / 200
        )
        Gauge("flywheel_trainer_loss", "an RL gauge beside them", registry=registry).set(0.5)
        self.step = min(STEPS, self.step + PER_READ)
        return generate_latest(registry)

    def deployments(self) -> dict[str, Any]:
        if not self.pretrained:
            return {"models": [], "generated_at": "2025-01-01T00:00:00Z"}
        return {
            "models": [
                {
                    "model": MODEL,
                    "champion": "2",
                    "candidate": "3",
                    "traffic": {"champion_pct": 75.0, "candidate_pct": 25.0},
                    "phase": "canary",
                    "step": 0,
                    "replicas": [
                        {
                            "replica_id": "replica-0",
                            "champion_version": "2",
                            "candidate_version": "3",
                        }
                    ],
                    "next_checkpoint_eta": "2025-01-01T00:02:00Z",
                }
            ],
            "generated_at": "2025-01-01T00:00:00Z",
        }

    def history(self) -> dict[str, Any]:
        if not self.pretrained:
            return {"events": [], "next_cursor": None}
        events = [
            (1, "version_registered", "1", None, None, "trainer", "base"),
            (2, "promoted", "1", None, None, "controller", "first version"),
            (3, "version_registered", "2", "1", None, "trainer", ""),
            (4, "replica_synced", "2", None, None, "replica", ""),
            (5, "gate_passed", "2", "1", None, "controller", "all checks passed"),
            (6, "promoted", "2", "1", None, "controller", "canary held"),
            (7, "gate_failed", "4", "2", None, "controller", "validity fell"),
            (8, "version_registered", "3", "2", None, "trainer", ""),
            (9, "canary_started", "3", "2", 25.0, "controller", "gate passed"),
        ]
        rows = [
            {
                "seq": seq,
                "event_id": f"e{seq}",
                "type": kind,
                "model": MODEL,
                "version": version,
                "from_version": frm,
                "traffic_pct": pct,
                "source": source,
                "actor": source,
                "reason": reason,
                "details": {},
                "ts": f"2025-01-01T00:00:0{seq}Z",
            }
            for seq, kind, version, frm, pct, source, reason in events
        ]
        return {"events": rows[::-1], "next_cursor": None}  # newest first, as the API answers

    def model_versions(self) -> dict[str, Any]:
        if not self.pretrained:
            return {}  # MLflow's answer for no versions
        scored = {"1": ("0.3401", "0.3102", "0.3700"), "2": ("0.4420", None, None)}
        out = []
        for v in ("1", "2", "3"):  # version 3 not scored yet
            tags = [{"key": "reward_spec", "value": "v1"}]
            if v in scored:
                acc, low, high = scored[v]
                tags.append({"key": "heldout_acceptance", "value": acc})
                if low:
                    tags += [
                        {"key": "heldout_acceptance_ci_low", "value": low},
                        {"key": "heldout_acceptance_ci_high", "value": high},
                    ]
            out.append({"name": MODEL, "version": v, "tags": tags})
        return {"model_versions": out}


def _handler(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/metrics":
                return self._send(200, fake.metrics(), "text/plain; version=0.0.4")
            if url.path == "/api/2.0/mlflow/model-versions/search":
                fake.mlflow_filters += parse_qs(url.query).get("filter", [])
                return self._send(200, json.dumps(fake.model_versions()).encode())
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                fake.unauthorized += 1
                return self._send(401, b'{"detail": "no key"}')
            if url.path == "/v1/deployments":
                return self._send(200, json.dumps(fake.deployments()).encode())
            if url.path == "/v1/deployments/history":
                return self._send(200, json.dumps(fake.history()).encode())
            self._send(404, b"{}")

    return Handler


@pytest.fixture
def served() -> Iterator[tuple[Fake, str]]:
    fake = Fake()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class Sup:
    """What StatusView needs of app.supervisor.Supervisor: `roles` and `poll()`."""

    def __init__(self) -> None:
        self.roles = [
            SimpleNamespace(
                spec=SimpleNamespace(name="trainer", url=None),
                proc=SimpleNamespace(pid=4242),
                state="ready",
                restarts=0,
            )
        ]
        self.polls = 0
        self.stop = threading.Event()  # set at poll `stop_after`, for a run that ends by count
        self.stop_after: int | None = None

    def poll(self) -> list[str]:
        self.polls += 1
        if self.polls == self.stop_after:
            self.stop.set()
        return ["trainer exited with 1; see trainer.log"] if self.polls == 3 else []


def _view(url: str, **kw: Any) -> StatusView:
    return StatusView(
        url,
        KEY,
        Sup(),
        mlflow_uri=url,
        model_name=MODEL,
        trainer_metrics_url=f"{url}/metrics",
        **kw,
    )


def _text(view: StatusView) -> str:
    console = Console(record=True, width=200)
    console.print(view.render())
    return console.export_text()


def _rows(text: str) -> list[list[str]]:
    """The cells of every table row of rendered text."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")]
        for line in text.splitlines()
        if line.strip().startswith("│")
    ]


def test_live_view_shows_pretraining_then_traffic_split_and_heldout(served):
    fake, url = served
    view = _view(url)

    first = _text(view)
    assert "base policy pretraining" in first and "0/600" in first
    second = _text(view)
    assert "75/600" in second and "12%" in second and "4.625" in second  # loss 5 - 75/200
    assert "held-out" not in second and "deployments" in second

    while not fake.pretrained:
        view.fetch()
    shown = _text(view)
    # a champion exists: pretraining is over, its row gone; the trainer is no longer read
    assert "pretraining" not in shown
    reads = fake.metrics_reads
    _text(view)
    assert fake.metrics_reads == reads
    assert fake.unauthorized == 0 and fake.mlflow_filters[-1] == f"name='{MODEL}'"

    dep = next(cells for cells in _rows(shown) if cells[0] == MODEL)
    assert dep[1:5] == ["2", "3", "75% / 25%", "canary"]  # traffic.champion_pct / candidate_pct
    assert "trainer" in shown and "4242" in shown
    held = {cells[0]: cells for cells in _rows(shown) if cells[0] in ("v1", "v2", "v3")}
    assert held["v1"] == ["v1", "0.340", "[0.310, 0.370]", ""]
    assert held["v2"] == ["v2", "0.442", "", "champion"]
    assert "v3" not in held  # not scored yet
    assert "gate_failed" in shown and "canary_started" in shown


def test_no_live_prints_each_fact_once(served, capsys):
    fake, url = served
    view = _view(url, interval_s=0.01)
    view.sup.stop_after = 16  # more refreshes than the fake has facts (they are done by read 8)
    view.run(live=False, until=time.monotonic() + 120, stop=view.sup.stop)
    out = capsys.readouterr().out.splitlines()
    lines = [line.split(" ", 1)[1] for line in out]  # without the HH:MM:SS stamp
    assert view.sup.polls == 16, "the run ended by its poll count, not the 120 s bound"
    assert len(lines) == len(set(lines)), out  # yet every line once

    pre = [line for line in lines if line.startswith("pretraining")]
    assert pre == [
        "pretraining the base policy: step 0/600 (0%)",
        *(
            f"pretraining the base policy: step {s}/600 ({100 * s // 600}%), loss {5 - s / 200:.3f}"
            for s in range(75, 600, 75)
        ),
        "pretraining the base policy: done, 600 steps, loss 2.000",
    ]
    assert "traffic flywheel-policy: champion v2 75% / candidate v3 25% (canary)" in lines
    assert "held-out acceptance v1: 0.340 [0.310, 0.370]" in lines
    assert "held-out acceptance v2: 0.442" in lines
    assert not any("v3:" in line for line in lines if line.startswith("held-out"))
    decisions = [line for line in lines if line.startswith("decision ")]
    assert [d.split()[1] for d in decisions] == [
        "version_registered",
        "promoted",
        "version_registered",
        "gate_passed",
        "promoted",
        "gate_failed",
        "version_registered",
        "canary_started",
    ]  # oldest first, the replica's own event left out
    assert "decision gate_failed v4 from v2 (controller): validity fell" in decisions
    assert "decision canary_started v3 from v2 at 25% (controller): gate passed" in decisions
    assert "trainer exited with 1; see trainer.log" in lines


def test_piped_output_gets_the_log_lines(served, capsys, monkeypatch):
    """`flywheel run | tee run.log` without --no-live: stdout is no terminal, so log lines."""
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(var, raising=False)
    view = _view(served[1], interval_s=0.01)
    view.run(live=True, until=time.monotonic() + 0.3)
    out = capsys.readouterr().out
    assert "pretraining the base policy: step 0/600 (0%)" in out
    assert "┏" not in out  # no frame of the live view


def test_a_resumed_runs_backlog_of_decisions_is_cut_to_the_last_few():
    view = StatusView("http://127.0.0.1:9", KEY, Sup())
    events = [
        {"seq": n, "type": "gate_passed", "version": str(n), "source": "controller"}
        for n in range(30, 0, -1)
    ]
    first = view.new_lines(Snapshot(history=events))
    assert first == [f"decision gate_passed v{n} (controller)" for n in range(23, 31)]
    new = {
        "seq": 31,
        "type": "rolled_back",
        "version": "30",
        "from_version": "29",
        "source": "controller",
    }
    assert view.new_lines(Snapshot(history=[new, *events])) == [
        "decision rolled_back v30 from v29 (controller)"
    ]
    assert view.new_lines(Snapshot(history=[new, *events])) == []


def test_sources_that_do_not_answer_are_left_out():
    view = StatusView(
        "http://127.0.0.1:9",
        KEY,
        Sup(),
        mlflow_uri="http://127.0.0.1:9",
        model_name=MODEL,
        trainer_metrics_url="http://127.0.0.1:9/metrics",
    )
    snap = view.fetch()
    assert snap.status is None and snap.pretraining is None and snap.heldout == []
    assert view.new_lines(snap) == []
    assert "trainer" in _text(view)  # the roles table still shows


def test_trainer_metrics_url_follows_the_roles_env():
    assert trainer_metrics_url({}) == "http://127.0.0.1:9102/metrics"  # TrainerConfig's default
    assert trainer_metrics_url({"FLYWHEEL_TRAINER_METRICS_PORT": "9127"}).endswith(":9127/metrics")
    assert trainer_metrics_url({"FLYWHEEL_TRAINER_METRICS_PORT": "0"}) is None


def test_pretrain_sets_the_gauges_the_view_reads():
    """The trainer side of the contract: trainer/pretrain.py's gauges, as its /metrics exports them."""
    from prometheus_client import REGISTRY

    from trainer.pretrain import pretrain

    pretrain(
        {
            "batch_size": 2,
            "policy": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_context": 64},
        },
        steps=3,
    )
    seen = parse_pretraining(generate_latest(REGISTRY).decode())
    assert seen is not None and (seen.step, seen.steps, seen.done) == (3, 3, True)
    assert seen.loss is not None and seen.loss > 0


def test_agent_users_versions_show_their_held_out_task_success():
    """With agent users the versions carry `heldout_task_success` (app/simulate/agent_eval.py):
    the view names that figure, in its table and in its log lines."""
    from app.status_view import parse_heldout

    payload = {
        "model_versions": [
            {
                "version": "2",
                "tags": [
                    {"key": "heldout_task_success", "value": "0.375"},
                    {"key": "heldout_task_success_ci_low", "value": "0.25"},
                    {"key": "heldout_task_success_ci_high", "value": "0.5"},
                ],
            },
            {"version": "1", "tags": [{"key": "heldout_acceptance", "value": "0.34"}]},
            {"version": "3", "tags": []},
        ]
    }
    held = parse_heldout(payload)
    assert [(h.version, h.figure, h.acceptance) for h in held] == [
        (1, "acceptance", 0.34),
        (2, "task success", 0.375),
    ]
    assert held[1].describe() == "held-out task success v2: 0.375 [0.250, 0.500]"
