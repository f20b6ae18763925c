"""The demo's planted bad checkpoint is really bad in the way the gate checks (bounded change)."""

import torch

from trainer.shipping import plant_bad_weights


def test_planted_checkpoint_blows_up_only_the_largest_matrix():
    serving = {
        "emb": torch.ones(8, 4, dtype=torch.bfloat16),
        "w": torch.full((16, 16), 0.5, dtype=torch.bfloat16),
        "b": torch.zeros(16, dtype=torch.bfloat16),
    }
    bad = plant_bad_weights(serving)
    assert torch.equal(bad["w"], torch.full((16, 16), 32.0, dtype=torch.bfloat16))
    assert torch.equal(bad["emb"], serving["emb"]) and torch.equal(bad["b"], serving["b"])
    assert torch.equal(serving["w"], torch.full((16, 16), 0.5, dtype=torch.bfloat16)), (
        "the trainer's copy is untouched"
    )
