"""FSDP2 (`fully_shard`) for Hugging Face policies: `FLYWHEEL_TRAINER_PARALLEL=fsdp`.

    dist.init_process_group("gloo")               # trainer/distributed.py, under torchrun
    policy = build_policy({"type": "hf", "model_dir": d})
    shard_policy(policy)                          # before the optimizer is built
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], ...)
    loss = objective(policy.logprobs(...)) / global_tokens   # or idle_participation_loss(policy)
    loss.backward(); clip_grad_norm(policy, 1.0); opt.step()
    serving = full_serving_state(policy)          # collective; bf16 on rank 0, None elsewhere

What is sharded: every decoder layer (the classes in the model's `_no_split_modules`, else the
modules of its `layers` ModuleList) is one `fully_shard` unit, the root model (embeddings, final
norm, lm_head; tied weights stay in one unit) another. Parameters are fp32 DTensors sharded on
dim 0 over a 1-D mesh of all ranks (CPU + gloo, or CUDA + NCCL, from the process group's
backend). Torch's own APIs only: `fully_shard`, `torch.distributed.checkpoint.state_dict`,
`torch.nn.utils.get_total_norm` / `clip_grads_with_norm_`.

Gradients are SUMMED over ranks, not averaged: every unit gets `set_gradient_divide_factor(1)`
with sum-only reductions, so when each rank's loss is normalised by the GLOBAL token count the
reduce-scatter yields the gradient of the global batch (what one process computes on all of it,
up to float summation order: the per-rank partial sums are added once more).

Numerics (docs/NUMERICS.md): an unsharded HFPolicy substitutes the bf16-rounded value of every
fp32 master (`serving_weight`, straight-through gradient) with `functional_call` at the root.
FSDP swaps the all-gathered parameters into each unit in its own pre-forward hook, which would
overwrite a root substitution, so a sharded policy substitutes per unit instead: a forward
pre-hook on every unit (it runs after FSDP's unshard) shadows each parameter the unit manages
that the policy substitutes (`_forward_params`) with its rounded value in its module's instance
`__dict__` (attribute lookup finds it before `_parameters`), and a forward hook (prepended, so
before FSDP's reshard) removes the shadows.
Rounding is elementwise, so the forward sees the same values as unsharded, and with
`kernels="invariant"` the log-probs are bit-identical (tests/integration/trainer/test_fsdp.py).
The all-gather's own ops are on batch_invariant_mode's exact list (`EXACT_COMM_OPS`).

LoRA (policy/lora.py): the frozen bf16 base and the fp32 adapter are sharded together
(FSDP reduce-scatters only the adapter's gradients); as unsharded, only the adapter is
substituted (the base holds bf16 values already), so peft's per-forward parametrization of fused
expert parameters (`target_parameters`) runs on the unsharded base as usual.
`full_serving_state` gathers only the trainable (adapter) tensors.

Collective contract: all-gathers run in every unit's forward and backward and reduce-scatters in
backward, so EVERY rank must run the same number of forward/backward passes per step. A rank
without rollouts calls `idle_participation_loss` (a one-token forward whose loss is multiplied by
0: its gradient contribution is exactly zero) for each pass the others make. A parameter that a
rank's forward did not use (an expert held as its own module that no token of that rank was
routed to) is reduced as a zero gradient (`set_reduce_scatter_unused_params`), so the ranks'
reduce-scatters always match; one no rank used then has a zero gradient where one process would
leave it None (AdamW still decays its moments).

Not supported (`serving_state_dict` / `load_serving_state_dict` raise on a sharded policy):
rank-local serving state: gather with `full_serving_state`, load serving weights before sharding
or use `load_train_state`. Generation on a sharded policy is untested (every rank would have to
generate in lockstep; replicas serve the gathered bf16 state).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from policy.hf import HFPolicy
from policy.moe_lm import serving_weight

log = logging.getLogger(__name__)

__all__ = [
    "clip_grad_norm",
    "full_serving_state",
    "full_train_state",
    "idle_participation_loss",
    "is_sharded",
    "load_train_state",
    "shard_policy",
]


def is_sharded(policy: HFPolicy) -> bool:
    """True once `shard_policy` has run on the policy."""
    return bool(getattr(policy, "_fsdp_sharded", False))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: modules whose class is in `_no_split_modules` (transformers'
    list of blocks that must not be split), else the children of a ModuleList named `layers`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        lists = [
            m
            for n, m in model.named_modules()
            if n.endswith("layers") and isinstance(m, nn.ModuleList)
        ]
        layers = [layer for ml in lists for layer in ml]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: found no decoder layers to shard (no module of the classes "
            f"{sorted(names)} and no `layers` ModuleList)"
        )
    return layers


def shard_policy(policy: HFPolicy, *, reshard_after_forward: bool = True) -> None:
    """Apply FSDP2 to `policy.model` in place: each decoder layer, then the root (module docstring).

    Needs an initialised process group; call it before building the optimizer (the parameters
    become DTensors). `reshard_after_forward=False` keeps layers gathered between forward and
    backward (more memory, fewer all-gathers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(policy, HFPolicy):
        raise TypeError(
            f"FSDP shards Hugging Face policies (type 'hf'), not {type(policy).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_policy needs an initialised torch.distributed process group")
    if is_sharded(policy):
        raise RuntimeError("shard_policy: the policy is already sharded")
    with torch.no_grad():
        substituted = set(policy._forward_params())
    params = dict(policy.model.named_parameters())  # tied weights under their first name only
    ids = {id(params[n]) for n in substituted}
    rounded = {  # every name of every substituted parameter (a tied lm_head too)
        n for n, p in policy.model.named_parameters(remove_duplicate=False) if id(p) in ids
    }
    backend = dist.get_backend()
    device = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = policy.model
    for layer in reversed(decoder_layers(model)):  # inner units before the ones around them
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            m.set_reduce_scatter_unused_params(True, recurse=False)
    _install_rounding(model, rounded)
    policy._forward_params = dict  # type: ignore[method-assign]  # rounding is per module now
    policy.serving_state_dict = _refuse(  # type: ignore[method-assign]
        "serving_state_dict", "use trainer.fsdp.full_serving_state (every rank calls it)"
    )
    policy.load_serving_state_dict = _refuse(  # type: ignore[method-assign]
        "load_serving_state_dict", "load serving weights before shard_policy, or load_train_state"
    )
    policy._fsdp_sharded = True  # type: ignore[attr-defined]
    log.info(
        "fully_shard over %d ranks (%s): %d decoder layers + root",
        dist.get_world_size(),
        backend,
        len(decoder_layers(model)),
    )


def _refuse(name: str, instead: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name}() on a sharded policy sees only this rank's shards: {instead}")

    return refuse


def _rounded(w: torch.Tensor) -> torch.Tensor:
    """The bf16-rounded value of an unsharded fp32 master. Without autograd no cache is used
    (`serving_weight` caches by version counter; FSDP refills the same unsharded tensor)."""
    if torch.is_grad_enabled() and w.requires_grad:
        return serving_weight(w)
    return w.detach().to(torch.bfloat16).to(w.dtype)


def _unit_modules(unit: nn.Module) -> list[nn.Module]:
    """The modules whose parameters FSDP unit `unit` manages: `unit` and its descendants, not
    descending into another unit."""
    from torch.distributed.fsdp import FSDPModule

    out, stack = [], [unit]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))
    return out


def _install_rounding(model: nn.Module, rounded: set[str]) -> None:
    """Hooks on every FSDP unit that substitute the rounded values of the parameters it manages
    whose names are in `rounded` (what the policy's `_forward_params` substitutes: all of them
    for an HF policy, the adapter for LoRA) for the length of its forward (module docstring). The
    pre-hook runs after FSDP's unshard (FSDP prepends its own), the forward hook before FSDP's
    reshard (prepended here)."""
    from torch.distributed.fsdp import FSDPModule

    prefix = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}
    for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        slots = [
            (m, name)
            for m in _unit_modules(unit)
            for name, _ in m.named_parameters(recurse=False)
            if prefix[id(m)] + name in rounded
        ]

        def shadow(module: nn.Module, args: Any, slots: list = slots) -> None:
            for m, name in slots:
                m.__dict__[name] = _rounded(m._parameters[name])

        def unshadow(module: nn.Module, args: Any, output: Any, slots: list = slots) -> None:
            for m, name in slots:
                m.__dict__.pop(name, None)

        unit.register_forward_pre_hook(shadow)
        unit.register_forward_hook(unshadow, prepend=True)


def idle_participation_loss(policy: HFPolicy) -> torch.Tensor:
    """A loss whose backward runs every collective of one forward/backward pass and contributes
    exactly zero gradient: the log-prob of one eos token after the start token, times 0.

    A rank with no rollouts in a step calls `.backward()` on it once per pass the other ranks
    make, so their all-gathers and reduce-scatters are matched. Zero times a finite gradient is an
    exact zero, so the summed gradient equals the other ranks' alone."""
    lp = policy.logprobs([[]], [[policy.tokenizer.eos_id]])
    return lp.sum() * 0.0


def clip_grad_norm(policy: HFPolicy, max_norm: float) -> torch.Tensor:
    """Clip the gradients of `policy.model` to total L2 norm `max_norm`; return the total norm
    before clipping, the same on every rank (a DTensor norm is reduced with `full_tensor()`)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in policy.model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _tie_like_model(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Make keys whose parameters are one object in `model` (tied weights) one tensor in `state`:
    a gathered full state dict holds an independent copy per key."""
    first: dict[int, str] = {}
    out = dict(state)
    for k, v in model.state_dict(keep_vars=True).items():
        if k not in out:
            continue
        if id(v) in first:
            out[k] = out[first[id(v)]]
        else:
            first[id(v)] = k
    return out


def full_serving_state(policy: HFPolicy) -> dict[str, torch.Tensor] | None:
    """COLLECTIVE (every rank calls it): rank 0 gets what the unsharded policy's
    `serving_state_dict()` returns (bf16, save_pretrained names and layout, tied copies dropped);
    the other ranks get None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from policy.lora import LoraPolicy

    lora = isinstance(policy, LoraPolicy)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    state = get_model_state_dict(policy.model, options=opts)
    if dist.get_rank() != 0:
        return None
    if lora:  # LoraPolicy.serving_state_dict: the adapter, bf16, under peft's saved names
        keys = policy._adapter_keys  # saved name -> model state-dict key
        return {saved: state[key].to(torch.bfloat16).contiguous() for saved, key in keys.items()}
    return policy._bf16_saved_state(policy.model, _tie_like_model(policy.model, state))


def full_train_state(
    policy: HFPolicy, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]] | tuple[None, None]:
    """COLLECTIVE: (full fp32 model state dict, full optimizer state dict) on rank 0, keyed by
    parameter names, (None, None) elsewhere: the sharded trainer's checkpoint. The model state is
    the whole model (a LoRA policy's frozen base included)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(policy.model, optimizer, options=opts)
    if dist.get_rank() != 0:
        return None, None
    return model_sd, optim_sd


def load_train_state(
    policy: HFPolicy,
    optimizer: torch.optim.Optimizer,
    model_sd: dict[str, Any] | None,
    optim_sd: dict[str, Any] | None,
) -> None:
    """COLLECTIVE: load a `full_train_state` given on rank 0 (None elsewhere) into the sharded
    policy and its optimizer; rank 0 broadcasts and every rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if dist.get_rank() == 0 and (model_sd is None or optim_sd is None):
        raise ValueError("load_train_state: rank 0 must be given the model and optimizer state")
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(policy.model, model_sd or {}, options=opts)
    set_optimizer_state_dict(policy.model, optimizer, optim_sd or {}, options=opts)
