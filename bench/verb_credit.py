"""Where an agent run's policy gradient went, per verb and operator, read off its rollouts.

`flywheel run --agents` trains on agent sessions whose task names a verb (`add_rows`: app/sandbox/
tasks.py `OPS`), so what each session wrote for the verb's operator says what its advantage
pushed up. This reads a stopped run's `flywheel.rollouts` topic straight from the embedded
broker's log segments (no broker needed), finds each session's verb and the operator its last
`apply_edit` wrote, and prints per version the operators written and their mean reward, then
the positive advantage the trainer's rule gives each (verb, operator) pair
(trainer/objective.py `advantages` over each group's sessions, a session counted once; only the
positive side, as `FLYWHEEL_TRAINER_ADV_NEGATIVE_SCALE=0` trains) under both advantage scales
(and in reward units with only successes pushed up), with the share that came from groups where no session succeeded (there a "least bad" failure,
fewer tool errors, is pushed up):

    .venv/bin/python -m bench.verb_credit /tmp/run-dir

`--replay BASE` then trains the saved policy BASE (the run's base, saved while the run is up:
`python -m bench.agent_skill save 1 BASE`) on those same records offline, in the order the
streams wrote them (`--whole-groups`: each group's sessions together, in the order groups
first appear), read and batched as the trainer reads them, 16 a step, with the trainer's policy
gradient on-policy (bench/agent_rl.py `pg_step`: no importance weights, no KL, AdamW at `--lr`)
and its advantages at `--adv-scale` and `--negative-scale` (`--positive-needs-success`: only
sessions that succeeded pushed up, FLYWHEEL_TRAINER_ADV_POSITIVE_NEEDS_SUCCESS), and prints the held-out probe by
verb (bench/agent_skill.py) every `--probe-every` steps: whether the run's data alone, under one
objective or another, loses a verb.

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
from policy.tokenizer import ByteTokenizer
from trainer.objective import ADV_SCALES, advantages, unsuccessful

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
    key: str  # trainer/batch.py `baseline_key`: a split session's segments share it


def log_records(data_dir: Path, topic: str = TOPIC) -> Iterator[tuple[int, bytes]]:
    """(timestamp in ms, value) of every record of `topic` in an embedded broker's log segments,
    partition by partition."""
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
                        yield r.timestamp, r.value


def parse(value: bytes) -> Session | None:
    """The session of one rollout record; None for a record that is no agent task's. The record
    is read as the trainer reads it (trainer/rollouts.py `parse_rollout`), and its baseline key
    is the trainer's (trainer/batch.py `baseline_key`)."""
    from trainer.batch import baseline_key
    from trainer.rollouts import parse_rollout

    d = json.loads(value)
    if d.get("tokenizer", "byte-v1") != "byte-v1":
        raise SystemExit(f"record {d.get('request_id')}: tokenizer {d['tokenizer']!r}, not byte-v1")
    r, refusal = parse_rollout(value)
    if r is None:
        raise SystemExit(f"record {d.get('request_id')} is no rollout record: {refusal.message}")
    text = ByteTokenizer().decode
    verb = _VERB.search(text(r.prompt_tokens))
    if verb is None:
        return None
    ops = _OP.findall(text(r.completion_tokens))
    op = ops[-1] if ops and ops[-1] in OPS.values() else "?"
    return Session(
        version=int(r.model_version),
        verb=verb.group(1),
        op=op,
        reward=r.reward,
        success=d.get("outcome") == "success",  # the trainer's record does not keep the outcome
        group=r.group_id,
        key=baseline_key(r),
    )


def credit(
    sessions: list[Session], scale: str, needs_success: bool = False
) -> tuple[Counter, Counter]:
    """The positive advantage each (verb, op) gets over its group's sessions, and the part of it
    from groups where none succeeded. A group with one session has no baseline: left out.
    `needs_success`: FLYWHEEL_TRAINER_ADV_POSITIVE_NEEDS_SUCCESS (a session that did not succeed
    gets none)."""
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
            unsuccessful=[not s.success for s in members] if needs_success else None,
        )
        failed = not any(s.success for s in members)
        for s, a in zip(members, adv.tolist(), strict=True):
            if a > 0:
                total[(s.verb, s.op)] += a
                if failed:
                    all_failed[(s.verb, s.op)] += a
    return total, all_failed


def replay(
    values: list[bytes],
    base: str,
    adv_scale: str,
    negative_scale: float,
    needs_success: bool,
    lr: float,
    whole_groups: bool,
    probe_every: int,
) -> dict:
    """Train `base` on the records (`values`, in the order written) offline; the last probe.

    The records are read as the trainer reads them (trainer/rollouts.py `parse_rollout` against
    the base's tokenizer and context; a refused one is counted and left out) and batched by
    trainer/batch.py `collate` (the loss mask, each record's temperature, its baseline key)."""
    from bench.agent_rl import optimizer, pg_step
    from bench.agent_skill import probe
    from policy.checkpoint import load_policy
    from trainer.batch import collate
    from trainer.rollouts import parse_rollout
    from trainer.validate import ModelSpec

    torch.manual_seed(0)
    policy = load_policy(base)
    spec = ModelSpec.of(policy, replay_routes=False, max_abs_reward=1e6)
    rollouts, refused = [], Counter()
    for v in values:
        r, refusal = parse_rollout(v, spec)
        if refusal is not None:
            refused[refusal.reason] += 1
        else:
            rollouts.append(r)
    if refused:
        print(f"left out {sum(refused.values())} refused records: {dict(refused)}")
    if whole_groups:
        by: dict[str, list] = {}
        for r in rollouts:
            by.setdefault(r.group_id or r.request_id, []).append(r)
        rollouts = [r for g in by.values() for r in g]
    opt = optimizer(policy, lr)

    def show(step: int) -> dict:
        p = probe(policy)
        verbs = " ".join(
            f"{verb} " + "/".join(f"{x:.2f}" for x in dist) for verb, dist in p["by_verb"].items()
        )
        print(
            f"step {step}: p(right) {p['p_right']:.3f}; p(op | verb) over {' '.join(OPS.values())}: {verbs}",
            flush=True,
        )
        return p

    last = show(0)
    steps = len(rollouts) // 16
    for step in range(steps):
        c = collate(rollouts[step * 16 : (step + 1) * 16])
        held = unsuccessful(c.outcomes) if needs_success else None
        adv = advantages(c.rewards, c.group_ids, adv_scale, negative_scale, c.baseline_keys, held)
        policy.train()
        logp = policy.logprobs(c.prompts, c.completions, None, c.temperatures)
        pg_step(opt, policy, logp, c.mask, adv)
        if (step + 1) % probe_every == 0 or step + 1 == steps:
            last = show(step + 1)
    return last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data_dir", type=Path, help="a run's FLYWHEEL_DATA_DIR (the run stopped)")
    ap.add_argument("--replay", metavar="BASE", help="train this saved policy on the records")
    ap.add_argument("--adv-scale", choices=ADV_SCALES, default="group")
    ap.add_argument("--negative-scale", type=float, default=0.0)
    ap.add_argument(
        "--positive-needs-success",
        action="store_true",
        help="FLYWHEEL_TRAINER_ADV_POSITIVE_NEEDS_SUCCESS: only sessions that succeeded are pushed up",
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--whole-groups", action="store_true")
    ap.add_argument("--probe-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    records = list(log_records(a.data_dir))
    if a.replay:
        torch.set_num_threads(a.threads)
        replay(
            [v for _, v in sorted(records, key=lambda tv: tv[0])],  # stable: written order
            a.replay,
            a.adv_scale,
            a.negative_scale,
            a.positive_needs_success,
            a.lr,
            a.whole_groups,
            a.probe_every,
        )
        return
    sessions = [s for _, v in records if (s := parse(v)) is not None]
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
    for scale, needs in (("group", False), ("none", False), ("none", True)):
        total, failed = credit(sessions, scale, needs)
        rule = ", successes only" if needs else ""
        print(f"positive advantage, scale {scale}{rule} (of it from groups where none succeeded)")
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
