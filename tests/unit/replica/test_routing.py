"""Session routing: stable across processes, monotone in the split, and matches it statistically."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.replica.routing import BUCKETS, pick_slot, session_bucket


def test_bucket_is_the_same_in_another_process():
    ids = [f"user-{i}" for i in range(20)]
    code = (
        "from app.replica.routing import session_bucket;"
        f"print(','.join(str(session_bucket(s)) for s in {ids!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
        cwd=".",
    ).stdout.strip()
    assert out == ",".join(str(session_bucket(s)) for s in ids)


@given(st.text(min_size=1, max_size=64), st.floats(0, 100), st.floats(0, 100))
@settings(max_examples=200, deadline=None)
def test_raising_the_split_never_moves_a_session_back_to_the_champion(sid, a, b):
    lo, hi = sorted((a, b))
    if pick_slot(sid, lo, True) == "candidate":
        assert pick_slot(sid, hi, True) == "candidate"
    assert 0 <= session_bucket(sid) < BUCKETS


def test_no_candidate_means_champion_and_edges():
    assert pick_slot("s", 100.0, False) == "champion"
    assert all(pick_slot(f"s{i}", 0.0, True) == "champion" for i in range(500))
    assert all(pick_slot(f"s{i}", 100.0, True) == "candidate" for i in range(500))


@pytest.mark.parametrize("pct", [5.0, 25.0, 50.0])
def test_candidate_share_matches_the_split_within_sampling_error(pct):
    n = 20_000
    got = sum(pick_slot(f"session-{i}", pct, True) == "candidate" for i in range(n)) / n
    p = pct / 100
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(got - p) < 4 * sigma, (
        f"candidate share {got:.4f} vs split {p} (4 sigma = {4 * sigma:.4f})"
    )
