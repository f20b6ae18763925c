"""One rank of tests/integration/trainer/test_fsdp.py, launched by torchrun (gloo, CPU).

    torchrun --standalone --nproc-per-node 2 fsdp_worker.py MODEL_DIR OUT full|lora

Every rank builds the policy from MODEL_DIR and shards it (trainer/fsdp.py); rank 0 also holds an
unsharded reference built from the same directory. The worker only computes and saves; the test
asserts. Under OUT, rank 0 writes `results.pt` (tensors, see `main`), `serving/` (the gathered
serving state as model.safetensors + config + tokenizer files) and `ranks.json` (per-rank values
that must agree, e.g. the clipped gradient norm).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from policy import build_policy
from policy.lora import to_lora
from policy.lora_spec import LoraSpec
from trainer import fsdp

LR = 1e-2
MAX_NORM = 0.5  # below the full tiny models' gradient norm (~1.9), so clipping scales them
TEXTS = [
    ("def main", "(): return 0"),
    ("the trainer", " ships a version"),
    ("", "policy"),
    ("replica", " loads the weights and serves"),
]


def batch(policy) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """The global batch: prompts, completions and one advantage per sequence."""
    tok = policy.tokenizer
    prompts = [tok.encode(p) for p, _ in TEXTS]
    comps = [tok.encode(c) for _, c in TEXTS]
    adv = torch.tensor([1.0, -0.5, 0.75, -1.0])
    return prompts, comps, adv


def loss_on(policy, idx: list[int], global_tokens: int) -> torch.Tensor:
    """Policy-gradient loss of the batch's sequences `idx`, normalised by the GLOBAL token count."""
    prompts, comps, adv = batch(policy)
    lp = policy.logprobs([prompts[i] for i in idx], [comps[i] for i in idx])
    return -(lp.sum(dim=1) * adv[idx]).sum() / global_tokens


def build(model_dir: str, lora: bool, cache: Path):
    """The policy; with `lora`, a LoRA policy on it (attention Linears + fused MoE experts) whose
    adapter is set to seeded random values (peft starts B at 0, which would hide the adapter)."""
    policy = build_policy({"type": "hf", "model_dir": model_dir, "kernels": "invariant"})
    if not lora:
        return policy
    spec = LoraSpec(
        r=4, target_modules=["q_proj", "v_proj"], target_parameters=["mlp.experts.gate_up_proj"]
    )
    policy = to_lora(policy, spec, cache)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.adapter_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return policy


def sharded(model_dir: str, lora: bool, cache: Path, reshard_after_forward: bool = True):
    policy = build(model_dir, lora, cache)
    fsdp.shard_policy(policy, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=LR)
    return policy, opt


def step_sharded(policy, opt, passes: list[list[int]], global_tokens: int) -> torch.Tensor:
    """One optimizer step accumulating one forward/backward per entry of `passes` (the batch's
    sequence indices; [] = an idle pass)."""
    opt.zero_grad(set_to_none=True)
    for idx in passes:
        loss = loss_on(policy, idx, global_tokens) if idx else fsdp.idle_participation_loss(policy)
        loss.backward()
    norm = fsdp.clip_grad_norm(policy, MAX_NORM)
    opt.step()
    return norm


def main() -> None:
    model_dir, out, lora = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "lora"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, f"the worker expects 2 ranks, got {world}"
    cache = out / f"cache-{rank}"  # to_lora's model-file cache, one per rank
    res: dict[str, object] = {}
    ranks: dict[str, object] = {}

    # 1. log-probs: sharded vs unsharded, and vs the behaviour log-probs of logged generations
    ref = build(model_dir, lora, cache)
    policy, opt = sharded(model_dir, lora, cache)
    prompts, comps, _ = batch(ref)
    samples = ref.generate(prompts, max_tokens=6, temperature=1.0, seed=7)
    gen_comps = [s.tokens for s in samples]
    routes = [s.routes for s in samples] if ref.moe_spec else None
    with torch.no_grad():
        lp_sharded = policy.logprobs(prompts, comps)
        lp_gen = policy.logprobs(prompts, gen_comps, routes)
    lp_grad = policy.logprobs(prompts, comps).detach()  # the training path (straight-through)
    behaviour = torch.zeros_like(lp_gen)
    for i, s in enumerate(samples):
        behaviour[i, : len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
    ranks[f"lp_sharded_{rank}"] = lp_sharded.tolist()
    for name, call in (
        ("serving_state_dict", lambda: policy.serving_state_dict()),
        ("load_serving_state_dict", lambda: policy.load_serving_state_dict({})),
    ):
        try:
            call()
            ranks[f"refused_{name}_{rank}"] = ""
        except RuntimeError as e:
            ranks[f"refused_{name}_{rank}"] = str(e)
    if rank == 0:
        with torch.no_grad():
            res["lp_ref"] = ref.logprobs(prompts, comps)
        res["lp_sharded"], res["lp_grad"] = lp_sharded, lp_grad
        res["lp_gen"], res["lp_behaviour"] = lp_gen, behaviour

    # 2. one AdamW step, each rank half of the global batch (loss / global tokens)
    global_tokens = sum(len(c) for c in comps)
    halves = [[0, 1], [2, 3]]
    ranks[f"norm_split_{rank}"] = float(step_sharded(policy, opt, [halves[rank]], global_tokens))
    serving = fsdp.full_serving_state(policy)
    model_sd, optim_sd = fsdp.full_train_state(policy, opt)
    if rank == 0:
        ref_opt = torch.optim.AdamW([p for p in ref.model.parameters() if p.requires_grad], lr=LR)
        ref_opt.zero_grad(set_to_none=True)
        loss_on(ref, [0, 1, 2, 3], global_tokens).backward()
        res["norm_ref"] = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), MAX_NORM)
        ref_opt.step()
        res["w_ref"] = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
        res["w_split"] = model_sd
        res["serving_ref"] = ref.serving_state_dict()
        res["serving"] = serving
        torch.save({"model": model_sd, "optim": optim_sd}, out / "train_state.pt")
        if not lora:  # a full model's serving directory; a LoRA serving state is the adapter
            sdir = out / "serving"
            sdir.mkdir()
            for f in Path(model_dir).iterdir():
                if f.is_file() and not f.name.endswith(".safetensors"):
                    shutil.copy2(f, sdir / f.name)
            from safetensors.torch import save_file

            save_file(serving, str(sdir / "model.safetensors"), metadata={"format": "pt"})
    else:
        assert serving is None and model_sd is None and optim_sd is None, "rank 1 got full state"

    # 3. full_train_state -> file -> load_train_state into a fresh sharded policy: same state
    dist.barrier()
    fresh, fresh_opt = sharded(model_dir, lora, cache)
    saved = torch.load(out / "train_state.pt", weights_only=True) if rank == 0 else None
    fsdp.load_train_state(fresh, fresh_opt, saved and saved["model"], saved and saved["optim"])
    model_sd2, optim_sd2 = fsdp.full_train_state(fresh, fresh_opt)
    with torch.no_grad():
        ranks[f"lp_loaded_{rank}"] = fresh.logprobs(prompts, comps).tolist()
        ranks[f"lp_stepped_{rank}"] = policy.logprobs(prompts, comps).tolist()
    if rank == 0:
        res["w_loaded"], res["optim_saved"], res["optim_loaded"] = model_sd2, optim_sd, optim_sd2
    del fresh, fresh_opt

    # 4. rank 1 idle (idle_participation_loss), rank 0 the whole batch: same as 1 process
    idle, idle_opt = sharded(model_dir, lora, cache)
    mine = [[0, 1, 2, 3]] if rank == 0 else [[]]
    ranks[f"norm_idle_{rank}"] = float(step_sharded(idle, idle_opt, mine, global_tokens))
    model_sd3, _ = fsdp.full_train_state(idle, idle_opt)
    del idle, idle_opt

    # 5. two accumulated passes per rank, uneven (rank 1's second pass idle), layers kept
    # gathered between forward and backward: the same global-batch step
    acc, acc_opt = sharded(model_dir, lora, cache, reshard_after_forward=False)
    passes = [[0, 1], [2]] if rank == 0 else [[3], []]
    ranks[f"norm_acc_{rank}"] = float(step_sharded(acc, acc_opt, passes, global_tokens))
    model_sd4, _ = fsdp.full_train_state(acc, acc_opt)
    if rank == 0:
        res["w_idle"], res["w_acc"] = model_sd3, model_sd4
        from kernels.hf_mode import uncovered_ops

        res["uncovered"] = sorted(uncovered_ops())
        torch.save(res, out / "results.pt")
    gathered: list[dict[str, object] | None] = [None] * world
    dist.all_gather_object(gathered, ranks)
    if rank == 0:
        merged = {k: v for d in gathered for k, v in (d or {}).items()}
        (out / "ranks.json").write_text(json.dumps(merged))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
