"""Where an agent run's policy gradient went, per verb and operator, read off its rollouts.

`flywheel run --agents` trains on agent sessions whose task names a verb (`add_rows`: app/sandbox/
tasks.py `OPS`), so what each session wrote for the verb's operator says what its advantage
pushed up. This reads a stopped run's `flywheel.rollouts` topic straight from the embedded
broker's log segments (no broker needed), finds each session's verb and the operator its last
`apply_edit` wrote, and prints per version the operators written and their mean reward, then
the positive advantage the trainer's rule gives each (verb, operator) pair
(trainer/objective.py `advantages` over each group's sessions, a session counted once; only the
positive side, as `FLYWHEEL_TRAINER_ADV_NEGATIVE_SCALE=0` trains) under both advantage scales,
with the share that came from groups where no session succeeded (there a "least bad" failure,
fewer tool errors, is pushed up):

    .venv/bin/python -m bench.verb_credit /tmp/run-dir

Reads records of the built-in policy's byte tokenizer (`byte-v1`); other tokenizers are refused
by name. docs/TRAINER.md "Why it falls short" has what it found in a run.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from app.sandbox.tasks import OPS
from trainer.objective import advantages

TOPIC = "flywheel.rollouts"
_VERB = re.compile(r"implement (" + "|".join(OPS) + r")_\w+ in ")
_OP = re.compile(r"return a (\S+) b")
OPERATORS = (*OPS.values(), "?")  # "?": no edit with an operator, or one of none of OPS


@dataclass(frozen=True)
class Session:
    """One rollout record of an agent session (a ledger segment)."""

    version: int
    verb: str
    op: str  # the operator its last `apply_edit` wrote, or "?"
    reward: float
    success: bool
    group: str | None
    key: str  # the session (a split session's segments share it)


def log_records(data_dir: Path, topic: str = TOPIC) -> Iterator[bytes]:
    """Every record value of `topic` in an embedded broker's log segments, partition by partition."""
    from kafka.record import MemoryRecords

    parts = sorted(glob.glob(str(data_dir / "kafka" / "data" / f"{topic}-*")))
    if not parts:
        raise SystemExit(
            f"no partitions of {topic} under {data_dir}/kafka/data: not a run's data dir"
        )
    for part in parts:
        for seg in sorted(glob.glob(f"{part}/*.log")):
            records = MemoryRecords(Path(seg).read_bytes())
            while (batch := records.next_batch()) is not None:
                for r in batch:
                    if r.value is not None:
                        yield r.value


def parse(value: bytes) -> Session | None:
    """The session of one rollout record; None for a record that is no agent task's."""
    d = json.loads(value)
    if d.get("tokenizer", "byte-v1") != "byte-v1":
        raise SystemExit(f"record {d.get('request_id')}: tokenizer {d['tokenizer']!r}, not byte-v1")
    text = lambda ids: bytes(t for t in ids if t < 256).decode(errors="replace")  # noqa: E731
    verb = _VERB.search(text(d["prompt_tokens"]))
    if verb is None:
        return None
    ops = _OP.findall(text(d["completion_tokens"]))
    op = ops[-1] if ops and ops[-1] in OPS.values() else "?"
    return Session(
        version=int(d["model_version"]),
        verb=verb.group(1),
        op=op,
        reward=float(d["reward"]),
        success=d.get("outcome") == "success",
        group=d.get("group_id"),
        key=d["session_id"],
    )


def credit(sessions: list[Session], scale: str) -> tuple[Counter, Counter]:
    """The positive advantage each (verb, op) gets over its group's sessions, and the part of it
    from groups where none succeeded. A group with one session has no baseline: left out."""
    total, all_failed = Counter(), Counter()
    groups: dict[str, list[Session]] = defaultdict(list)
    for s in sessions:
        if s.group is not None:
            groups[s.group].append(s)
    for members in groups.values():
        if len({s.key for s in members}) < 2:
            continue
        adv = advantages(
            torch.tensor([s.reward for s in members]),
            [s.group for s in members],
            scale,
            baseline_keys=[s.key for s in members],
        )
        failed = not any(s.success for s in members)
        for s, a in zip(members, adv.tolist(), strict=True):
            if a > 0:
                total[(s.verb, s.op)] += a
                if failed:
                    all_failed[(s.verb, s.op)] += a
    return total, all_failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data_dir", type=Path, help="a run's FLYWHEEL_DATA_DIR (the run stopped)")
    a = ap.parse_args()
    sessions = [s for v in log_records(a.data_dir) if (s := parse(v)) is not None]
    print(f"{len(sessions)} agent rollouts")
    by: dict[tuple[int, str], list[Session]] = defaultdict(list)
    for s in sessions:
        by[(s.version, s.verb)].append(s)
    print("per version and verb: operator written (count, mean reward)")
    for v in sorted({s.version for s in sessions}):
        cells = []
        for verb in OPS:
            rs = by[(v, verb)]
            ops = " ".join(
                f"{o}:{len(x)}({sum(s.reward for s in x) / len(x):+.2f})"
                for o in OPERATORS
                if (x := [s for s in rs if s.op == o])
            )
            cells.append(f"{verb} {ops or '-'}")
        print(f"v{v:<3} " + " | ".join(cells))
    for scale in ("group", "none"):
        total, failed = credit(sessions, scale)
        print(f"positive advantage, scale {scale} (of it from groups where none succeeded)")
        for verb in OPS:
            right = OPS[verb]
            cells = [
                f"{o}{'*' if o == right else ''} {total[(verb, o)]:.1f} ({failed[(verb, o)]:.1f})"
                for o in OPERATORS
                if total[(verb, o)]
            ]
            wrong = sum(total[(verb, o)] for o in OPERATORS if o != right)
            print(
                f"  {verb}: "
                + ", ".join(cells)
                + f"; right {total[(verb, right)]:.1f} vs wrong {wrong:.1f}"
            )


if __name__ == "__main__":
    main()
