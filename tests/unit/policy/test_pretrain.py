"""Synthetic corpus determinism and a tiny pretraining run that lowers the loss."""

import torch

from policy import load_policy
from trainer.corpus import documents
from trainer.pretrain import _batch, lm_loss, pretrain, pretrain_to_dir

TINY_PRETRAIN = {
    "batch_size": 8,
    "lr": 1e-2,
    "warmup_steps": 2,
    "policy": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_context": 256},
}


def test_corpus_is_deterministic_code_like_and_fits_the_context():
    a, b = documents(seed=3, n=200), documents(seed=3, n=200)
    assert a == b and a != documents(seed=4, n=200)
    text = "\n".join(a)
    for keyword in ("def ", "return ", "if ", "for ", '"""', "#"):
        assert keyword in text, keyword
    assert max(len(d.encode()) for d in a) <= 254


def test_pretraining_lowers_the_loss_and_is_seed_deterministic(tmp_path):
    losses = []
    policy, path = pretrain_to_dir(
        tmp_path / "base",
        TINY_PRETRAIN,
        steps=25,
        seed=0,
        on_step=lambda s, loss: losses.append(loss),
    )
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, (
        f"loss did not fall: {losses[0]:.3f} -> {losses[-5:]}"
    )
    assert policy.config.kernels == "invariant"  # trained with default kernels, serves invariant
    again = pretrain(TINY_PRETRAIN, steps=25, seed=0)
    assert all(
        torch.equal(a, b) for a, b in zip(policy.state_dict().values(), again.state_dict().values())
    )
    loaded = load_policy(path)
    docs = iter(documents(seed=0, n=8))
    inputs, targets = _batch(docs, loaded, 8)
    with torch.no_grad():
        assert torch.equal(lm_loss(loaded, inputs, targets), lm_loss(policy, inputs, targets))


def test_pretrain_accepts_a_bare_policy_config():
    policy = pretrain({"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16}, steps=1, seed=1)
    assert policy.config.d_model == 16 and not policy.training
