"""How often the agent target's interval condition fails by chance alone.

The agent demo's target (docs/TRAINER.md "Agents learn in the loop") asks that no promoted
champion's held-out task success fall below the previous champion's 95% interval. That interval
(app/simulate/agent_eval.py `success_interval`) is the sampling error of 2 sessions on each of 32
fixed held-out tasks: the within-task variance, from two draws per task. This measures, by
simulation, what that yardstick does when nothing changed:

- **coverage**: how often the interval holds the mean success probability of the tasks;
- **width**: its mean width;
- **false miss**: for two versions equally good on every task, evaluated independently on the
  same tasks (different sessions), how often the second's score falls below the first's interval:
  the target's condition failing for a promotion that lost nothing.

Side by side, the same three for the Wilson score interval of all sessions as independent
draws (64 sessions), which ignores that the tasks are fixed and is wider.

Each scenario draws every task's success probability from a Beta of mean `m` and concentration
`c` (small `c`: each task is solved nearly always or nearly never; large `c`: every task near `m`),
fresh for each replicate, and the sessions from those. "run-18 late" is the regime of run 18's
v13-v15 (61-63 of 64 held-out sessions: almost every task solved, in both of its sessions).

    .venv/bin/python -m bench.heldout_interval                 # 4,000 replicates a scenario
    .venv/bin/python -m bench.heldout_interval --reps 500      # quicker, noisier
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from statistics import NormalDist

from app.simulate.agent_eval import success_interval

SCENARIOS: dict[str, tuple[float, float]] = {  # name -> (mean m, concentration c)
    "half, spread": (0.5, 2.0),
    "half, all alike": (0.5, 50.0),
    "0.8, near-deterministic": (0.8, 0.5),
    "0.8, spread": (0.8, 4.0),
    "0.9, near-deterministic": (0.9, 0.5),
    "0.9, spread": (0.9, 4.0),
    "run-18 late (0.96, near-deterministic)": (0.96, 0.5),
    "0.96, all alike": (0.96, 50.0),
}


def wilson(successes: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (`successes` of `n`)."""
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Tally:
    """One interval's coverage, total width and false misses over a scenario's replicates."""

    covered: int = 0
    width: float = 0.0
    missed: int = 0

    def add(self, low: float, high: float, truth: float, other_mean: float) -> None:
        self.covered += low <= truth <= high
        self.width += high - low
        self.missed += other_mean < low


def sessions(p: list[float], k: int, rng: random.Random) -> list[float]:
    """`k` consecutive 0/1 sessions per task, task i succeeding with probability p[i]."""
    return [float(rng.random() < pi) for pi in p for _ in range(k)]


def scenario(
    m: float, c: float, tasks: int, k: int, reps: int, rng: random.Random
) -> tuple[Tally, Tally]:
    """(the evaluator's interval, Wilson's) over `reps` replicates of a Beta(m c, (1 - m) c) task set."""
    ours, theirs = Tally(), Tally()
    n = tasks * k
    for _ in range(reps):
        p = [rng.betavariate(m * c, (1 - m) * c) for _ in range(tasks)]
        truth = sum(p) / tasks
        first, second = sessions(p, k, rng), sessions(p, k, rng)
        _, low, high = success_interval(first, k)
        other = sum(second) / n
        ours.add(low, high, truth, other)
        theirs.add(*wilson(sum(first), n), truth, other)
    return ours, theirs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=4000, help="replicates per scenario")
    ap.add_argument("--tasks", type=int, default=32, help="held-out tasks (the evaluator's 32)")
    ap.add_argument("--k", type=int, default=2, help="sessions per task (the evaluator's 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    print(
        f"{args.tasks} tasks x {args.k} sessions, {args.reps} replicates a scenario, 95% intervals"
    )
    print(f"{'scenario':40s} | {'within-task (the yardstick)':>30s} | {'Wilson, 64 sessions':>30s}")
    print(f"{'':40s} | {'cover  width  false miss':>30s} | {'cover  width  false miss':>30s}")
    for i, (name, (m, c)) in enumerate(SCENARIOS.items()):
        print(f"[{i + 1}/{len(SCENARIOS)}] {name} ...", file=sys.stderr, flush=True)
        ours, theirs = scenario(m, c, args.tasks, args.k, args.reps, rng)
        cols = [
            f"{t.covered / args.reps:5.3f}  {t.width / args.reps:5.3f}  {t.missed / args.reps:10.3f}"
            for t in (ours, theirs)
        ]
        print(f"{name:40s} | {cols[0]:>30s} | {cols[1]:>30s}")


if __name__ == "__main__":
    main()
