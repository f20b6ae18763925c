"""FSDP2 on Hugging Face policies (trainer/fsdp.py): 2 ranks, gloo, CPU, under real torchrun.

For each tiny model (dense Llama, Llama with tied embeddings, Qwen2-MoE with fused experts, and
a LoRA policy on the MoE: attention Linears + fused experts, seeded non-zero adapter) one
`torchrun --standalone --nproc-per-node 2` run of fsdp_worker.py computes, on sharded policies,
log-probs, one AdamW step with the global batch split over the ranks, one step with rank 1 idle,
one step of two accumulated uneven passes (one of them idle), the gathered serving state and a
train-state round trip; rank 0 also runs the unsharded reference.
The worker saves; these tests assert.

Tolerances, measured max |Δw| after one AdamW step (lr 1e-2, clip 0.5) vs one process on the
global batch: split 3.5e-6 dense, 1.4e-6 tied, 3.0e-6 MoE, 3.7e-6 LoRA; idle 6e-8 dense, 0 for
the others; accumulated 2.3e-5 dense, 1.3e-6 tied, 3.3e-6 MoE, 1.7e-6 LoRA. Not bitwise, because float sums differ: split, each rank sums the gradient of its
half and the reduce-scatter adds the two partial sums, where one process sums all rows in one
BLAS reduction; idle (the idle rank adds exact zeros), the weights are bit-identical whenever the
clipping norm is, and the dense model's norm (a sum of per-shard norms, in another order) is 1 ulp
off, which moves the clip coefficient. AdamW's first step divides the gradient by its own
magnitude, so an ulp in g moves w by much more than lr * 1e-7 where |g| is tiny: W_TOL is 1e-4
(1% of lr), far below a real step (~lr) and far above the noise. The forward has no sums across
ranks: sharded log-probs are asserted bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.ranks, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("fsdp_worker.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
W_TOL = 1e-4  # max |Δw| after one step (module docstring); lr is 1e-2
NORM_RTOL = 1e-6  # the global gradient norm, sharded vs one process
BF16_RTOL = 2.0**-7  # one bf16 ulp: a serving weight may round the other way
MODELS = ("llama", "llama_tied", "moe", "moe_lora")  # moe_lora: LoRA on the MoE model


def _model_dir(kind: str, root: Path, tok: Path) -> Path:
    from tests.hf_models import tiny_llama_dir, tiny_qwen2_moe_dir

    if kind.startswith("moe"):
        return tiny_qwen2_moe_dir(root / kind, tok)
    return tiny_llama_dir(root / kind, tok, tie_word_embeddings=kind == "llama_tied")


def _torchrun(kind: str, root: Path) -> None:
    """One 2-rank torchrun of the worker on a fresh tiny model of `kind`, into `root`."""
    from tests.hf_models import train_bpe_tokenizer

    assert TORCHRUN.is_file(), f"{TORCHRUN} not found: install torch into the venv (make venv)"
    model_dir = _model_dir(kind, root, train_bpe_tokenizer(root / "tok"))
    out = root / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        str(model_dir),
        str(out),
        "lora" if kind.endswith("_lora") else "full",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module", params=MODELS)
def run(request, tmp_path_factory) -> dict:
    """The torchrun of `request.param`: its results and directories. Run once per test run and
    shared by every xdist worker (tests/shared.py `shared_artifact`): the tests only read it."""
    from tests.shared import shared_artifact

    kind = request.param
    root = shared_artifact(
        tmp_path_factory.getbasetemp(), f"fsdp-{kind}", lambda d: _torchrun(kind, d)
    )
    out = root / "out"
    return {
        "kind": kind,
        "lora": kind.endswith("_lora"),
        "model_dir": root / kind,
        "out": out,
        "res": torch.load(out / "results.pt", weights_only=False),
        "ranks": json.loads((out / "ranks.json").read_text()),
    }


def _policy(run: dict, cache: Path):
    """The worker's unsharded policy for this run (the same build, incl. the seeded adapter)."""
    from tests.integration.trainer.fsdp_worker import build

    return build(str(run["model_dir"]), run["lora"], cache)


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), f"keys differ: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _initial_weights(run: dict, cache: Path) -> dict[str, torch.Tensor]:
    policy = _policy(run, cache)
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def test_sharded_logprobs_equal_unsharded_bit_for_bit(run):
    r, ranks = run["res"], run["ranks"]
    assert torch.equal(r["lp_sharded"], r["lp_ref"]), (r["lp_sharded"] - r["lp_ref"]).abs().max()
    assert torch.equal(r["lp_grad"], r["lp_ref"]), "the training (autograd) forward differs"
    assert ranks["lp_sharded_0"] == ranks["lp_sharded_1"], "the ranks computed different log-probs"
    assert bool((r["lp_ref"] != 0).any()), "no log-probs were compared"


def test_sharded_forward_dispatches_only_covered_or_exact_ops(run):
    assert run["res"]["uncovered"] == [], "ops batch_invariant_mode neither covers nor lists"


def test_rank_local_serving_state_calls_are_refused(run):
    for name in ("serving_state_dict", "load_serving_state_dict"):
        for rank in (0, 1):
            msg = run["ranks"][f"refused_{name}_{rank}"]
            assert "sharded policy" in msg, f"rank {rank}: {name}() was not refused ({msg!r})"


def test_sharded_logprobs_of_logged_generations_equal_behaviour_logprobs(run):
    r = run["res"]
    diff = (r["lp_gen"] - r["lp_behaviour"]).abs().max()
    assert torch.equal(r["lp_gen"], r["lp_behaviour"]), f"max |Δ logp| {diff}"


def test_two_rank_step_on_half_batches_matches_global_batch_on_one_process(run, tmp_path):
    r, ranks = run["res"], run["ranks"]
    assert ranks["norm_split_0"] == ranks["norm_split_1"], "clip_grad_norm differs across ranks"
    assert ranks["norm_split_0"] == pytest.approx(float(r["norm_ref"]), rel=NORM_RTOL)
    dw = _max_abs_diff(r["w_split"], r["w_ref"])
    moved = _max_abs_diff(r["w_ref"], _initial_weights(run, tmp_path))
    assert moved > 100 * W_TOL, f"the reference step barely moved the weights ({moved})"
    assert dw <= W_TOL, f"{run['kind']}: max |Δw| {dw} > {W_TOL}"


def test_idle_rank_with_zero_loss_matches_one_process_on_the_batch(run):
    r, ranks = run["res"], run["ranks"]
    assert ranks["norm_idle_0"] == ranks["norm_idle_1"]
    assert ranks["norm_idle_0"] == pytest.approx(float(r["norm_ref"]), rel=NORM_RTOL)
    dw = _max_abs_diff(r["w_idle"], r["w_ref"])
    assert dw <= W_TOL, f"{run['kind']}: max |Δw| {dw} > {W_TOL}"


def test_uneven_accumulated_passes_with_an_idle_one_match_one_process(run):
    """Rank 0: sequences [0, 1] then [2]; rank 1: [3] then an idle pass; no reshard after
    forward. Two backward passes accumulate into one step of the global batch."""
    r, ranks = run["res"], run["ranks"]
    assert ranks["norm_acc_0"] == ranks["norm_acc_1"]
    assert ranks["norm_acc_0"] == pytest.approx(float(r["norm_ref"]), rel=NORM_RTOL)
    dw = _max_abs_diff(r["w_acc"], r["w_ref"])
    assert dw <= W_TOL, f"{run['kind']}: max |Δw| {dw} > {W_TOL}"


def test_full_serving_state_is_the_unsharded_serving_state_dict(run, tmp_path):
    r = run["res"]
    serving, ref = r["serving"], r["serving_ref"]
    assert set(serving) == set(ref), sorted(set(serving) ^ set(ref))
    for k in ref:
        assert serving[k].dtype == ref[k].dtype == torch.bfloat16, k
        assert serving[k].shape == ref[k].shape, k
        a, b = serving[k].float(), ref[k].float()
        # the fp32 weights may differ by W_TOL (the tests above), then each rounds to bf16
        excess = (a - b).abs() - (BF16_RTOL * b.abs() + W_TOL)
        worst = int(excess.flatten().argmax())
        assert bool((excess <= 0).all()), (
            f"{k}: element {worst}: {a.flatten()[worst]} vs {b.flatten()[worst]}"
        )
    # exactly what the unsharded conversion gives for the gathered fp32 weights
    policy = _policy(run, tmp_path)
    policy.model.load_state_dict(r["w_split"])
    expect = policy.serving_state_dict()
    assert all(torch.equal(serving[k], expect[k]) for k in expect), "serving != bf16(w_split)"


def test_gathered_serving_state_loads_where_a_replica_loads_it(run, tmp_path):
    """A full model: the directory (safetensors + config + tokenizer) loads with
    `from_pretrained`. LoRA: the adapter loads into a fresh LoRA policy on the same base."""
    from transformers import AutoModelForCausalLM

    from policy import build_policy

    serving = run["res"]["serving"]
    if run["lora"]:
        policy = _policy(run, tmp_path)
        policy.load_serving_state_dict(serving)
        loaded = policy.serving_state_dict()
        assert set(loaded) == set(serving)
        assert all(torch.equal(loaded[k], serving[k]) for k in serving), "adapter differs"
        return
    sdir = run["out"] / "serving"
    model, info = AutoModelForCausalLM.from_pretrained(
        str(sdir), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    loaded = build_policy({"type": "hf", "model_dir": str(sdir)}).serving_state_dict()
    assert set(loaded) == set(serving)
    assert all(torch.equal(loaded[k], serving[k]) for k in serving), "loaded weights differ"


def test_train_state_round_trip_is_identical(run):
    r, ranks = run["res"], run["ranks"]
    assert set(r["w_loaded"]) == set(r["w_split"])
    assert all(torch.equal(r["w_loaded"][k], r["w_split"][k]) for k in r["w_split"])
    saved, loaded = r["optim_saved"], r["optim_loaded"]
    assert set(saved["state"]) == set(loaded["state"]) and saved["state"], "optimizer state keys"
    for name, st in saved["state"].items():
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][name][field], st[field]), f"{name}.{field}"
    for rank in (0, 1):
        assert ranks[f"lp_loaded_{rank}"] == ranks[f"lp_stepped_{rank}"], f"rank {rank} log-probs"
