"""The live status view of `flywheel run`: roles, versions, traffic split, recent decisions.

Reads the same status API an operator would (`GET /v1/deployments`, `/v1/deployments/history`)
with the local read key, plus the supervisor's view of the role processes.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Group
from rich.live import Live
from rich.table import Table


class StatusView:
    def __init__(self, api_url: str, read_key: str, supervisor: Any, interval_s: float = 2.0):
        self.api_url, self.sup, self.interval_s = api_url, supervisor, interval_s
        self.http = httpx.Client(
            base_url=api_url, headers={"Authorization": f"Bearer {read_key}"}, timeout=3
        )
        self.messages: list[str] = []

    def _get(self, path: str, **params: Any) -> Any:
        try:
            r = self.http.get(path, params=params)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def render(self) -> Group:
        roles = Table(title="roles", expand=True)
        for col in ("role", "pid", "state", "restarts", "url"):
            roles.add_column(col)
        for rp in self.sup.roles:
            roles.add_row(
                rp.spec.name,
                str(rp.proc.pid if rp.proc else "-"),
                rp.state,
                str(rp.restarts),
                rp.spec.url or "",
            )
        parts: list[Any] = [roles]
        status = self._get("/v1/deployments")
        if status:
            dep = Table(title="deployments", expand=True)
            for col in (
                "model",
                "champion",
                "candidate",
                "traffic %",
                "phase",
                "replicas",
                "next ship",
            ):
                dep.add_column(col)
            for m in status.get("models", []):
                reps = ", ".join(
                    f"{r.get('replica_id')}:{r.get('champion_version')}/{r.get('candidate_version')}"
                    for r in m.get("replicas", [])
                )
                dep.add_row(
                    str(m.get("model")),
                    str(m.get("champion")),
                    str(m.get("candidate")),
                    str(m.get("traffic_pct")),
                    str(m.get("phase")),
                    reps,
                    str(m.get("next_checkpoint_eta")),
                )
            parts.append(dep)
        history = self._get("/v1/deployments/history", limit=8)
        if history:
            hist = Table(title="last decisions", expand=True)
            for col in ("ts", "type", "version", "from", "source", "reason"):
                hist.add_column(col)
            for e in history.get("events", []):
                hist.add_row(
                    str(e.get("ts", ""))[:19],
                    e.get("type", ""),
                    str(e.get("version")),
                    str(e.get("from_version")),
                    e.get("source", ""),
                    (e.get("reason") or "")[:60],
                )
            parts.append(hist)
        if self.messages:
            parts.append("\n".join(self.messages[-5:]))
        return Group(*parts)

    def run(self, live: bool = True, until: float | None = None) -> None:
        if not live:
            while until is None or time.monotonic() < until:
                for m in self.sup.poll():
                    print(m, flush=True)
                time.sleep(self.interval_s)
            return
        with Live(self.render(), refresh_per_second=1, screen=False) as view:
            while until is None or time.monotonic() < until:
                self.messages.extend(self.sup.poll())
                view.update(self.render())
                time.sleep(self.interval_s)
