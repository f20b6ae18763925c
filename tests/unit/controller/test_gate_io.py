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


def test_the_base_policy_is_loaded_once_per_runner(monkeypatch):
    """Version 1 never changes: the runner downloads it for the first gate that needs it only."""
    from app.controller import gate_io

    loads = []

    def fake_load(client, model, version):  # stands in for the MLflow download (no server here)
        loads.append((model, version))
        return object(), {}, {}

    monkeypatch.setattr(gate_io, "load_version", fake_load)
    runner = gate_io.GateRunner(settings=None, client=None, cfg=None, n_rollouts=0)
    first = runner.base_policy("m")
    assert runner.base_policy("m") is first
    assert loads == [("m", gate_io.BASE_VERSION)]
