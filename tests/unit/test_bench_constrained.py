"""Smoke test of bench/constrained.py at `--quick` (a tiny policy, seconds), so CI runs its code
paths. It asserts what the bench computes (every constrained token's -log Z >= 0, the steps it
timed, the cache's speed-up), never a timing ratio."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_quick_run_prints_both_modes_side_by_side_and_the_log_z_gap(capsys):
    from bench.constrained import main

    figures = main(["--quick"])
    out = capsys.readouterr().out
    for line in ("ms / decoding step", "generated tokens/s", "cold compile", "-log Z"):
        assert line in out, f"{line!r} missing from:\n{out}"
    tp = figures["throughput"]
    assert tp["plain"]["steps"] >= 1 and tp["constrained"]["steps"] >= 1, tp
    assert tp["plain"]["mask_ms_per_step"] == 0 < tp["constrained"]["mask_ms_per_step"], tp
    gap = figures["log_z"]
    # behaviour lp is of the masked softmax: never below the unmasked model's (Z <= 1); the
    # invariant kernels make the two scorings agree up to that gap, bit for bit elsewhere
    assert gap["tokens"] > 0 and gap["min"] >= -1e-6, gap
    assert gap["mean"] > 1.0, f"an untrained model puts most mass outside the grammar: {gap}"
    ft = figures["first_token_ms"]
    assert ft["cached"] < ft["cold"], ft
