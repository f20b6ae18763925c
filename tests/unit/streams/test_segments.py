"""A session segment's MoE routes (streams/segments.py "Routes"): the multi-turn record's `routes`
cover its whole completion, each turn's logged rows at its span and zeros between the turns, only
when every turn logged them with one (layers, top_k); the stored state keeps them as logged.

The sessions are test_ledger's agent sessions (`agent_session`, assembled by the real `Ledger`),
each turn given routes whose ids say which turn and token logged them.

    .venv/bin/pytest tests/unit/streams/test_segments.py -q
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from app.contracts.events import decode_routes, encode_routes
from app.contracts.rollouts import Rollout
from streams.ledger import Ledger, LedgerConfig
from tests.unit.streams.test_ledger import agent_session, rollouts, run

LAYERS, TOP_K = 3, 2


def logged_routes(turn: int, n: int, layers: int = LAYERS, top_k: int = TOP_K) -> np.ndarray:
    """int32 [n, layers, top_k]: ids 1000 * (turn + 1) + 100 * token + ..., never 0, so a row
    names the turn and token that logged it."""
    base = 1000 * (turn + 1) + 100 * np.arange(n)[:, None, None]
    return (base + np.arange(layers * top_k).reshape(1, layers, top_k) + 1).astype(np.int32)


def with_routes(recs: list[dict[str, Any]], **shape: int) -> list[dict[str, Any]]:
    """`recs`, each turn with its `logged_routes` as the label join writes them."""
    out = []
    for rec in recs:
        routes, route_shape = encode_routes(
            logged_routes(rec["turn"], len(rec["completion_tokens"]), **shape)
        )
        out.append({**rec, "routes": routes, "route_shape": list(route_shape)})
    return out


def record_routes(rec: dict[str, Any]) -> np.ndarray:
    Rollout.model_validate(rec)  # the contract (route bytes vs route_shape)
    assert rec["route_shape"] == [len(rec["completion_tokens"]), LAYERS, TOP_K], rec["route_shape"]
    return decode_routes(rec["routes"], tuple(rec["route_shape"]))


def test_a_multi_turn_record_has_each_turn_s_routes_at_its_span_and_zeros_between():
    recs = with_routes(agent_session("s1", 3))
    _, out = run(recs)
    [rec] = rollouts(out)
    routes, mask = record_routes(rec), np.array(rec["loss_mask"])
    for k, span in enumerate(rec["turns"]):
        start, end = span["start"], span["end"]
        assert np.array_equal(routes[start:end], logged_routes(k, 3)), (k, routes[start:end])
    assert (routes[mask == 0] == 0).all() and (routes[mask == 1] != 0).all(), routes
    assert int((mask == 0).sum()) == 4  # the two tool results between the three turns


def test_a_dropped_final_eos_drops_its_route_row_too():
    recs = with_routes(agent_session("s1", 3, eos_in_history=False))
    _, out = run(recs)
    [rec] = rollouts(out)
    routes = record_routes(rec)
    spans = [(t["start"], t["end"]) for t in rec["turns"]]
    assert spans == [(0, 2), (4, 6), (8, 11)], spans  # turns 0 and 1 lost their eos
    assert np.array_equal(routes[0:2], logged_routes(0, 3)[:2])
    assert np.array_equal(routes[4:6], logged_routes(1, 3)[:2])
    assert np.array_equal(routes[8:11], logged_routes(2, 3))  # the last turn keeps its eos
    assert (routes[[2, 3, 6, 7]] == 0).all(), routes


@pytest.mark.parametrize(
    "change",
    ["other_top_k", "other_layers", "later_turn_without", "first_turn_without"],
)
def test_turns_that_did_not_all_log_one_route_shape_make_a_record_without_routes(change):
    recs = with_routes(agent_session("s1", 3))
    k = 0 if change == "first_turn_without" else 1
    if change == "other_top_k":
        recs[k] = with_routes([recs[k]], top_k=1)[0]
    elif change == "other_layers":
        recs[k] = with_routes([recs[k]], layers=LAYERS + 1)[0]
    else:
        recs[k] = {**recs[k], "routes": None, "route_shape": None}
    _, out = run(recs)
    [rec] = rollouts(out)
    Rollout.model_validate(rec)
    assert len(rec["turns"]) == 3 and rec["routes"] is None and rec["route_shape"] is None, rec


def test_a_one_turn_segment_keeps_its_routes_as_logged():
    [turn] = with_routes(agent_session("s1", 1))
    _, out = run([turn])
    [rec] = rollouts(out)
    assert (rec["routes"], rec["route_shape"]) == (turn["routes"], turn["route_shape"])
    assert "turns" not in rec and "loss_mask" not in rec, rec


def test_the_stored_state_keeps_each_turn_s_routes_once_as_logged_and_a_restart_gives_the_same_record():
    recs = with_routes(agent_session("s1", 3))
    _, uninterrupted = run(recs)
    ledger = Ledger(LedgerConfig(), {})
    for i, rec in enumerate(recs[:2]):
        ledger.on_rollout(rec, 1000.0 + i)
    stored = ledger.sessions["s1"]["seg"]
    # turn 0's routes are the first record's; turn 1's its part's, the logged base64 string
    assert stored["first"]["routes"] == recs[0]["routes"] and "ro" not in stored["parts"][0]
    assert stored["parts"][1]["ro"] == recs[1]["routes"], stored["parts"][1]
    table = orjson.loads(orjson.dumps(ledger.sessions))  # what the changelog holds
    restarted = Ledger(LedgerConfig(), table)
    out = restarted.on_rollout(recs[2], 1002.0) + restarted.end_session("s1", 1003.0)
    assert rollouts(out) == rollouts(uninterrupted)


def test_a_part_stored_before_routes_were_kept_makes_a_record_without_routes():
    recs = with_routes(agent_session("s1", 2))
    ledger = Ledger(LedgerConfig(), {})
    ledger.on_rollout(recs[0], 1000.0)
    ledger.on_rollout(recs[1], 1001.0)
    table = orjson.loads(orjson.dumps(ledger.sessions))
    for part in table["s1"]["seg"]["parts"]:
        part.pop("ro", None), part.pop("rs", None)
    [rec] = rollouts(Ledger(LedgerConfig(), table).end_session("s1", 1002.0))
    assert len(rec["turns"]) == 2 and rec["routes"] is None, rec
