"""The statistics of bench/mismatch.py on constructed log-probs (no vLLM is started here: the bench
itself runs the real engine). Each expected value is computed by hand from the inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.mismatch import correction, logprob_gap, parse_args, route_agreement


def test_logprob_gap_max_mean_fractions_and_kl_estimates():
    behaviour = [[-1.0, -2.0, -0.5], [-3.0]]
    trainer = [[-1.0, -2.5, -0.5], [-2.9995]]  # Δ = lp_b - lp_t: 0, 0.5, 0, -0.0005
    g = logprob_gap(behaviour, trainer)
    assert g["tokens"] == 4
    assert g["max_abs"] == pytest.approx(0.5)
    assert g["mean_abs"] == pytest.approx((0.5 + 0.0005) / 4, rel=1e-4)
    assert g["frac_differ"] == 0.5  # two of four tokens differ at all
    assert g["frac_gt_1e-3"] == 0.25  # one differs by more than 1e-3
    assert g["kl_k1"] == pytest.approx((0.5 - 0.0005) / 4, rel=1e-3)
    # k3 per token: r - 1 - log r with log r = lp_t - lp_b
    k3 = [math.expm1(q) - q for q in (0.0, -0.5, 0.0, 0.0005)]
    assert g["kl_k3"] == pytest.approx(sum(k3) / 4, rel=1e-3)
    assert g["kl_k3"] > 0


def test_logprob_gap_is_exactly_zero_on_identical_float32_values_and_compares_as_float32():
    lp = [[-0.123456789, -7.5], [-1e-3]]
    g = logprob_gap(lp, [list(row) for row in lp])
    assert g["max_abs"] == 0 and g["mean_abs"] == 0 and g["frac_differ"] == 0
    assert g["kl_k1"] == 0 and g["kl_k3"] == 0
    # two float64 values that round to the same float32 do not count as differing
    a = float(np.float32(-0.3))
    assert logprob_gap([[a]], [[a + 1e-12]])["frac_differ"] == 0
    # one float32 ulp does
    b = float(np.nextafter(np.float32(a), np.float32(0)))
    assert logprob_gap([[a]], [[b]])["frac_differ"] == 1.0


def test_logprob_gap_refuses_misaligned_or_empty_input():
    with pytest.raises(AssertionError, match="completion 1"):
        logprob_gap([[-1.0], [-1.0, -2.0]], [[-1.0], [-1.0]])
    with pytest.raises(AssertionError, match="2 vs 1"):
        logprob_gap([[-1.0], [-1.0]], [[-1.0]])
    with pytest.raises(ValueError, match="no tokens"):
        logprob_gap([[]], [[]])


def test_correction_clips_tokens_and_masks_sequences_as_the_trainer_does():
    # seq 0: log ratios 0, log 3 -> token 1 clipped (3 > C = 2); geometric mean sqrt(3) = 1.73: kept
    # seq 1: log ratio log 4 on its only token -> ratio 4: clipped and masked (> 2)
    # seq 2: identical: ratio 1
    behaviour = [[-1.0, -2.0], [-3.0], [-0.5, -0.5]]
    trainer = [[-1.0, -2.0 + math.log(3)], [-3.0 + math.log(4)], [-0.5, -0.5]]
    c = correction(behaviour, trainer)
    assert c["clip_fraction"] == pytest.approx(2 / 5)
    assert c["masked_fraction"] == pytest.approx(1 / 3)
    assert c["seq_ratio_min"] == pytest.approx(1.0)
    assert c["seq_ratio_max"] == pytest.approx(4.0, rel=1e-5)
    ratios = np.array([1.0, 3.0, 4.0, 1.0, 1.0])
    assert c["ess"] == pytest.approx(ratios.sum() ** 2 / (5 * (ratios**2).sum()), rel=1e-5)
    # the same data with the bounds widened: nothing clipped or masked
    wide = correction(behaviour, trainer, trunc_c=10.0, mask_low=0.1, mask_high=10.0)
    assert wide["clip_fraction"] == 0 and wide["masked_fraction"] == 0


def test_correction_of_no_mismatch_keeps_everything_with_full_ess():
    lp = [[-1.0, -2.0, -3.0], [-0.25]]
    c = correction(lp, lp)
    assert c["clip_fraction"] == 0 and c["masked_fraction"] == 0
    assert c["ess"] == pytest.approx(1.0)
    assert c["seq_ratio_min"] == c["seq_ratio_max"] == 1.0


def test_route_agreement_compares_expert_sets_per_token_and_layer():
    logged = [np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])]  # 1 completion: 2 tokens x 2 layers
    same_sets = [np.array([[[1, 0], [3, 2]], [[2, 1], [3, 0]]])]  # order within top-k differs
    assert route_agreement(logged, same_sets) == 1.0
    one_flip = [np.array([[[0, 1], [2, 3]], [[1, 3], [0, 3]]])]  # token 1, layer 0: {1,2} -> {1,3}
    assert route_agreement(logged, one_flip) == 0.75
    with pytest.raises(AssertionError, match="routes"):
        route_agreement(logged, [np.zeros((1, 2, 2), dtype=int)])
    with pytest.raises(ValueError, match="zip"):
        route_agreement(logged, [])


def test_quick_sets_the_small_run():
    a = parse_args(["--quick"])
    assert (a.prompts, a.samples, a.tokens, a.updates) == (8, 4, 16, 2)
    assert a.prompts * a.samples == 32  # 32 completions x 16 tokens
    with pytest.raises(AssertionError, match="--prompts"):
        parse_args(["--prompts", "99"])


def test_full_reload_dir_copies_the_model_files_with_the_given_weights(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from bench.mismatch import full_reload_dir

    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "tokenizer.json").write_text("{}")
    save_file({"w": torch.zeros(2, 3)}, str(src / "model.safetensors"))
    save_file({"extra": torch.zeros(1)}, str(src / "model-00002.safetensors"))
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16)}
    out = full_reload_dir(src, state, tmp_path / "reload")
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'
    assert (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == {"w"} and got["w"].dtype == torch.bfloat16
    assert torch.equal(got["w"], state["w"])
    assert torch.equal(load_file(str(src / "model.safetensors"))["w"], torch.zeros(2, 3))
