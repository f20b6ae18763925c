"""Pretrain the base checkpoint on the synthetic code corpus (trainer/corpus.py).

    flywheel pretrain --steps 600 --out .flywheel/base        # CLI, rich progress
    policy = pretrain({"steps": 20, "policy": {"d_model": 32, "n_layers": 1}}, seed=0)  # fixtures

Each training sequence is `[bos] + one document + [eos]`, right-padded; the loss is the
next-token cross-entropy on the non-pad targets plus a small MoE load-balance term. Training
uses the `default` (BLAS) kernels for speed: the weights are the same either way, and the saved
config keeps the policy's own kernel setting (`invariant` by default) for serving and RL.
Numerics: fp32 masters, bf16-rounded forward (straight-through), AdamW in fp32.
Progress goes to the gauges `flywheel_trainer_pretrain_step` / `_steps` / `_loss` (trainer/metrics.py),
which `flywheel run`'s status view reads from the trainer's /metrics.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from policy import build_policy, save_policy
from policy.base import Policy
from trainer.corpus import AgentDocument, iter_agent_documents, iter_documents
from trainer.metrics import MID_SKILL, PRETRAIN_LOSS, PRETRAIN_STEP, PRETRAIN_STEPS

log = logging.getLogger(__name__)


class PretrainConfig(BaseModel):
    """Pretraining hyper-parameters (the defaults reach code-like text in a few CPU minutes)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(600, ge=1, description="Optimizer steps.")
    batch_size: int = Field(16, ge=1, description="Documents per step.")
    lr: float = Field(
        3e-3, gt=0, description="Peak AdamW learning rate (linear warmup, cosine decay to 10%)."
    )
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the MoE load-balance loss.")
    train_kernels: Literal["invariant", "default"] = Field(
        "default", description="Kernel set used while pretraining."
    )
    policy: dict[str, Any] | None = Field(
        None, description="Policy config for build_policy (None: the default)."
    )
    agent_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of steps that train on agent sessions (trainer/corpus.py `agent_document`) instead of functions.",
    )
    agent_batch_size: int = Field(
        8, ge=1, description="Agent sessions per step (each is several times a function's length)."
    )
    hack_share: float = Field(
        0.0, ge=0, le=1, description="Share of agent sessions that edit the test file instead."
    )
    agent_skill: float = Field(
        0.25,
        ge=0,
        le=1,
        description="How often the corpus's agent tries the verb's operator first (0.25: at random; the others share the rest).",
    )
    mid_steps: int = Field(
        0,
        ge=0,
        description="After pretraining, steps on sessions of an agent that is always right (`midtrain`; 0: none): mid-training to a base that holds the agent tasks' skill weakly, which the corpus's skill prior alone does not give (docs/TRAINER.md \"Why it falls short\").",
    )
    mid_target: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Stop mid-training at the first probe (every 5 steps) whose p(right) reaches this (trainer/skill_probe.py); `mid_steps` is then a cap. None: all `mid_steps`.",
    )
    mid_lr: float = Field(
        1e-3,
        gt=0,
        description="AdamW learning rate of mid-training (constant): at 3e-4 the skill appeared after 175 steps on one base and not in 400 on another; at 1e-3 after about 120 on two streams.",
    )
    threads: int | None = Field(
        None,
        ge=0,
        description="Torch threads while pretraining (None: the process's setting; 0: every core). A run's base is pretrained before any other role has work, so it may take the machine; the process's own setting is restored after.",
    )


def _as_config(config: dict[str, Any] | PretrainConfig | None) -> PretrainConfig:
    """A PretrainConfig from itself, a dict of its fields, or a bare policy config (`Policy.config_dict()`)."""
    if isinstance(config, PretrainConfig):
        return config
    config = dict(config or {})
    if config and not set(config) & set(PretrainConfig.model_fields):
        config = {"policy": config}  # a policy config, e.g. {"type": "moe-byte", "d_model": 64}
    return PretrainConfig(**config)


def _batch(docs, policy: Policy, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next `batch_size` documents as (inputs [B, S], targets [B, S]) with pad in the targets' tail."""
    tok = policy.tokenizer
    max_len = policy.config_dict()["max_context"]
    seqs, eos_at = [], []
    for _ in range(batch_size):
        doc = next(docs)
        text, ends = (doc.text, doc.ends) if isinstance(doc, AgentDocument) else (doc, ())
        ids = [tok.bos_id, *tok.encode(text), tok.eos_id][: max_len + 1]
        seqs.append(ids)
        # an agent turn's completion ends with eos where the text goes on with the next prompt:
        # the target at its last token is eos (its input stays the text, as a replica's next prompt)
        eos_at.append([e for e in ends if e < len(ids) - 1])
    width = max(len(s) for s in seqs) - 1
    inputs = torch.full((batch_size, width), tok.pad_id, dtype=torch.int64)
    targets = torch.full((batch_size, width), tok.pad_id, dtype=torch.int64)
    for i, s in enumerate(seqs):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        targets[i, : len(s) - 1] = torch.tensor(s[1:])
        targets[i, eos_at[i]] = tok.eos_id
    return inputs, targets


def lm_loss(policy: Policy, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over non-pad targets."""
    b, s = inputs.shape
    hidden, _ = policy.forward_hidden(inputs, torch.arange(s).expand(b, s))
    logits = policy.lm_logits(hidden)
    return F.cross_entropy(
        logits.reshape(b * s, -1), targets.reshape(-1), ignore_index=policy.tokenizer.pad_id
    )


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` (0: every core; None: left as they are), then restored."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pretrain(
    config: dict[str, Any] | PretrainConfig | None = None,
    steps: int | None = None,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> Policy:
    """Build a policy and pretrain it; returns it (eval mode) with its configured kernels restored.

    `config` is a PretrainConfig, a dict of its fields, or a bare policy config dict.
    """
    cfg = _as_config(config)
    if steps is not None:
        cfg = cfg.model_copy(update={"steps": steps})
    policy_cfg = {"init_seed": seed, **(cfg.policy or {})}
    policy = build_policy(policy_cfg)
    serve_kernels = policy.config.kernels
    policy.set_kernels(cfg.train_kernels)
    torch.manual_seed(seed)
    decay = [p for p in policy.parameters() if p.dim() >= 2]
    no_decay = [p for p in policy.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    docs = iter_documents(seed)
    # a step is all functions or all agent sessions: a batch is as wide as its longest document
    agent_docs = (
        iter_agent_documents(seed + 1, cfg.hack_share, cfg.agent_skill) if cfg.agent_share else None
    )
    pick = random.Random(seed)
    policy.train()
    with _torch_threads(cfg.threads):
        # progress for the trainer's /metrics (trainer/metrics.py)
        PRETRAIN_STEPS.set(cfg.steps + cfg.mid_steps)
        PRETRAIN_STEP.set(0)
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            if agent_docs is not None and pick.random() < cfg.agent_share:
                inputs, targets = _batch(agent_docs, policy, cfg.agent_batch_size)
            else:
                inputs, targets = _batch(docs, policy, cfg.batch_size)
            loss = lm_loss(policy, inputs, targets)
            total = loss + cfg.aux_loss_coef * policy.aux_loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
            opt.step()
            assert math.isfinite(loss.item()), (
                f"pretraining diverged at step {step}: loss {loss.item()}"
            )
            PRETRAIN_STEP.set(step + 1)
            PRETRAIN_LOSS.set(loss.item())
            if on_step is not None:
                on_step(step, loss.item())
            if step % 50 == 0 or step == cfg.steps - 1:
                log.info(
                    "pretrain step %d/%d loss %.4f (%.0fs)",
                    step + 1,
                    cfg.steps,
                    loss.item(),
                    time.perf_counter() - t0,
                )
        if cfg.mid_steps:
            log.info(
                "mid-training on always-right agent sessions: %d steps%s",
                cfg.mid_steps,
                "" if cfg.mid_target is None else f" at most, to p(right) {cfg.mid_target}",
            )
            curve = midtrain(
                policy,
                cfg.mid_steps,
                cfg.mid_lr,
                seed + 2,
                on_step=lambda k, loss: _mid_step(cfg.steps + k, loss, on_step),
                target=cfg.mid_target,
                hack_share=cfg.hack_share,
            )
            if curve:  # probed: the progress's total is the steps taken (fewer at the target)
                log.info("mid-training stopped at step %d, p(right) %.3f", *curve[-1])
                PRETRAIN_STEPS.set(cfg.steps + curve[-1][0])
                PRETRAIN_STEP.set(cfg.steps + curve[-1][0])
    policy.eval()
    policy.set_kernels(serve_kernels)
    return policy


def _mid_step(step: int, loss: float, on_step: Callable[[int, float], None] | None) -> None:
    PRETRAIN_STEP.set(step + 1)
    PRETRAIN_LOSS.set(loss)
    if on_step is not None:
        on_step(step, loss)


def midtrain(
    policy: Policy,
    steps: int,
    lr: float,
    seed: int,
    batch_size: int = 8,
    on_step: Callable[[int, float], None] | None = None,
    target: float | None = None,
    probe_every: int = 5,
    hack_share: float = 0.0,
) -> list[tuple[int, float]]:
    """Fine-tune `policy` for up to `steps` on sessions of an agent that is always right
    (trainer/corpus.py `agent_document` with skill 1.0; `hack_share` of them edit the test file
    instead, as in pretraining, so a base seeded with the hack keeps it), `batch_size` a step, AdamW at a
    constant `lr` (betas 0.9, 0.95; no weight decay; clip 1.0); `on_step(step, loss)` after each.

    With a `target`, it probes the skill (trainer/skill_probe.py `probe`: p(right), the policy's
    mass on the verb's operator) before the first step and every `probe_every` steps, and stops at
    the first probe at or above `target`; `steps` is then a cap. Returns the probes as
    (steps taken, p(right)); none without a target.

    The verb-to-operator choice appears all at once, at a step that depends on the base and the
    sessions' stream (docs/TRAINER.md "Why it falls short" measures it with bench/agent_skill.py;
    at 3e-4 after 175 steps on one base and not within 400 on another): a fixed step count lands
    before the onset on one base and past it on another, and the target stops near the onset on
    both. The mean can reach the target on one verb while the others are at chance (measured:
    `sub` 0.64, the rest near 0.27 at a mean of 0.361), which the probe's `p_right_min` shows.
    Leaves `policy` in train mode."""
    from trainer.skill_probe import probe

    opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    docs = iter_agent_documents(seed, hack_share=hack_share, skill=1.0)
    curve: list[tuple[int, float]] = []

    def reached(step: int) -> bool:
        if target is None or (step % probe_every and step != steps):
            return False
        p = probe(policy)["p_right"]
        curve.append((step, p))
        MID_SKILL.set(p)
        log.info("mid-training step %d: p(right) %.3f (target %.3f)", step, p, target)
        return p >= target

    policy.train()
    t0 = time.perf_counter()
    for step in range(steps):
        if reached(step):
            break
        inputs, targets = _batch(docs, policy, batch_size)
        loss = lm_loss(policy, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        assert math.isfinite(loss.item()), f"mid-training diverged at step {step}: {loss.item()}"
        if on_step is not None:
            on_step(step, loss.item())
        if step % 50 == 0 or step == steps - 1:
            log.info(
                "mid-train step %d/%d loss %.4f (%.0fs)",
                step + 1,
                steps,
                loss.item(),
                time.perf_counter() - t0,
            )
    else:
        reached(steps)
    return curve


def pretrain_to_dir(
    out_dir: str | Path,
    config: dict[str, Any] | PretrainConfig | None = None,
    steps: int | None = None,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[Policy, Path]:
    """Pretrain and save the base checkpoint (fp32 masters + config.json) to `out_dir`."""
    cfg = _as_config(config)
    if steps is not None:
        cfg = cfg.model_copy(update={"steps": steps})
    policy = pretrain(cfg, seed=seed, on_step=on_step)
    path = save_policy(policy, out_dir, extra={"pretrain": {**cfg.model_dump(), "seed": seed}})
    return policy, path
