"""What the gate reads from one pass over the rollouts topic: held-out rollouts past the trained ranges."""

from app.controller.gate_io import held_out


def test_held_out_keeps_rollouts_past_the_trained_ranges_newest_last():
    rolls = [
        (0, 3, {"id": "a"}),
        (1, 9, {"id": "b"}),
        (0, 5, {"id": "c"}),
        (1, 12, {"id": "d"}),
        (2, 0, {"id": "e"}),
    ]
    trained = {"partitions": {"0": [0, 5], "1": [4, 10]}}
    assert [r["id"] for r in held_out(rolls, trained, 10)] == ["c", "d", "e"]
    assert [r["id"] for r in held_out(rolls, trained, 2)] == ["d", "e"]
    assert [r["id"] for r in held_out(rolls, None, 10)] == ["a", "b", "c", "d", "e"]
    assert held_out(rolls, trained, 0) == []
