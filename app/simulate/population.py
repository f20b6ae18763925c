"""Drive a deployment with simulated users: ask replicas for completions, react with feedback.

    flywheel simulate --api http://127.0.0.1:8000 --api-key <ingest key> \
        --replica http://127.0.0.1:8100 --replica http://127.0.0.1:8101

Each user is an editor session: it asks a replica (round-robin, like a load balancer) for
completions of a code prompt via the replica contract (`POST /v1/complete`), looks at each
candidate, and sends its reactions to the ingest API (`POST /v1/events`) through the
FeedbackClient. Works against any deployment that speaks those two contracts. Requests whose
prompt is hard (`FLYWHEEL_SIMULATE_HARD_FRACTION`, app/simulate/prompts.py `is_hard`) get the
hard-request reactions of app/simulate/users.py; `Stats` also sums each version's true
satisfaction, which no event carries.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from app.edits import classify
from app.simulate.config import SimulateConfig
from app.simulate.prompts import is_hard, prompts
from app.simulate.users import SimulatedUser, population

log = logging.getLogger(__name__)


@dataclass
class Stats:
    requests: int = 0
    completions: int = 0
    errors: int = 0
    events: int = 0
    accepted: Counter = field(default_factory=Counter)  # per model_version
    shown: Counter = field(default_factory=Counter)
    satisfaction: Counter = field(
        default_factory=Counter
    )  # per model_version: sum of true satisfaction
    kinds: Counter = field(
        default_factory=Counter
    )  # (model_version, app.edits kind) -> completions

    def acceptance(self) -> dict[str, float]:
        return {v: self.accepted[v] / n for v, n in self.shown.items() if n}

    def mean_satisfaction(self) -> dict[str, float]:
        return {v: self.satisfaction[v] / n for v, n in self.shown.items() if n}


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class Driver:
    """What the editor population and the agent users (app/simulate/agents.py) share: replicas in
    turn, like a load balancer, and an outbox of feedback events sent in batches."""

    def __init__(self, api_url: str, api_key: str, replica_urls: list[str], cfg: SimulateConfig):
        assert replica_urls, "at least one replica URL is needed"
        self.cfg = cfg
        self.replicas = itertools.cycle(replica_urls)
        self.api_url, self.api_key = api_url, api_key
        self.rng = random.Random(cfg.seed)
        self._outbox: list[dict[str, Any]] = []
        self.events_sent = 0

    async def _flush(self, client: Any) -> None:
        """Send the outbox through the FeedbackClient `client` (in a thread: it blocks)."""
        batch, self._outbox = self._outbox, []
        if batch:

            def _send() -> None:
                for event in batch:
                    client.send(event)
                client.flush()

            await asyncio.to_thread(_send)
            self.events_sent += len(batch)


class Population(Driver):
    def __init__(self, api_url: str, api_key: str, replica_urls: list[str], cfg: SimulateConfig):
        super().__init__(api_url, api_key, replica_urls, cfg)
        self.stats = Stats()
        self.users = population(cfg.users, seed=cfg.seed)
        self.prompts = prompts(512, seed=cfg.seed)

    async def _complete(
        self, http: httpx.AsyncClient, user: SimulatedUser, prompt: str
    ) -> dict[str, Any] | None:
        url = next(self.replicas)
        body = {
            "session_id": user.user_id,
            "prompt": prompt,
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "n": self.cfg.candidates,
        }
        try:
            r = await http.post(f"{url}/v1/complete", json=body, timeout=60)
            r.raise_for_status()
            return r.json()
        except httpx.HTTPError as exc:
            self.stats.errors += 1
            log.warning("completion from %s failed: %s", url, exc)
            return None

    def _react(self, user: SimulatedUser, resp: dict[str, Any], prompt: str = "") -> None:
        version = str(resp.get("model_version"))
        hard = is_hard(prompt, self.cfg.hard_fraction)
        for c in resp.get("completions", []):
            rid = c.get("request_id") or resp["request_id"]
            text = c.get("text", "")
            self.stats.completions += 1
            self.stats.shown[version] += 1
            self.stats.satisfaction[version] += user.satisfaction(text, hard)
            self.stats.kinds[(version, classify(text))] += 1
            for e in user.react(text, hard):
                if e["type"] == "accept":
                    self.stats.accepted[version] += 1
                self._outbox.append(
                    {
                        **e,
                        "event_id": uuid.uuid4().hex,
                        "request_id": rid,
                        "session_id": user.user_id,
                        "ts": now(),
                        "model_version": version,
                    }
                )

    async def _user_loop(
        self, http: httpx.AsyncClient, user: SimulatedUser, gap_s: float, until: float | None
    ) -> None:
        await asyncio.sleep(self.rng.random() * gap_s)
        while until is None or time.monotonic() < until:
            prompt = self.rng.choice(self.prompts)
            resp = await self._complete(http, user, prompt)
            self.stats.requests += 1
            if resp is not None:
                await asyncio.sleep(
                    self.rng.expovariate(1 / self.cfg.feedback_delay_s)
                    if self.cfg.feedback_delay_s
                    else 0
                )
                self._react(user, resp, prompt)
            await asyncio.sleep(gap_s * (0.5 + self.rng.random()))

    async def _flush_loop(self, client: Any, until: float | None) -> None:
        while until is None or time.monotonic() < until:
            await asyncio.sleep(1.0)
            await self._flush(client)

    async def run(self, duration_s: float | None = None) -> Stats:
        from app.client import FeedbackClient

        until = None if duration_s is None else time.monotonic() + duration_s
        gap_s = self.cfg.users / self.cfg.rps
        client = FeedbackClient(self.api_url, self.api_key, flush_interval_s=0)
        try:
            async with httpx.AsyncClient() as http:
                tasks = [
                    asyncio.create_task(self._user_loop(http, u, gap_s, until)) for u in self.users
                ]
                tasks.append(asyncio.create_task(self._flush_loop(client, until)))
                await asyncio.gather(*tasks)
            await self._flush(client)
        finally:
            client.close()
        self.stats.events = self.events_sent
        return self.stats
